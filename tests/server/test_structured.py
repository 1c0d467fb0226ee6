"""Structured outputs and tool_choice through the real `openai` client (issue 21).

ml4-tiny has random weights, so unconstrained text is arbitrary bytes: every constrained answer
below must nevertheless parse and satisfy its constraint, which only grammar-constrained
sampling can make happen. Schemas keep the output finite (enums, booleans, bounded integers,
compact whitespace) so each request ends by the grammar, with finish_reason "stop".
"""
import json
import re
import urllib.request

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}


def check_schema(obj):
    assert set(obj) == {"ok", "color", "size"}, obj
    assert isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue") and obj["size"] in (1, 2, 3)


def test_response_format_json_schema_chat(client, server):
    for seed in range(4):
        r = client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": "Describe a ball."}], max_tokens=60,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}},
            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        check_schema(json.loads(r.choices[0].message.content))


def test_guided_json_completions_streamed_equals_non_streamed(client, server):
    kw = dict(model=server.name, prompt="JSON:", max_tokens=60, temperature=0.8, seed=7,
              extra_body={"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True}})
    full = client.completions.create(**kw)
    check_schema(json.loads(full.choices[0].text))
    text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert text == full.choices[0].text


def test_regex_choice_and_grammar(client, server):
    rx = r"[0-9]{2}-[a-f]{3}"
    for seed in range(3):
        r = client.completions.create(model=server.name, prompt="code:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_regex": rx})
        assert re.fullmatch(rx, r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
    choices = ["yes", "no", 'a "quoted" one']
    seen = set()
    for seed in range(6):
        r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "?"}],
                                           max_tokens=20, temperature=1.5, seed=seed,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices
        seen.add(r.choices[0].message.content)
    r = client.completions.create(model=server.name, prompt="g:", max_tokens=20, temperature=1.0, seed=3,
                                  extra_body={"guided_grammar": 'root ::= "go" [0-9] ("!" | "?")'})
    assert re.fullmatch(r"go[0-9][!?]", r.choices[0].text), r.choices[0].text


def test_json_object_is_a_json_object(client, server):
    # Any JSON object: bias '}' up so the random model closes it quickly (logit_bias applies
    # after the grammar's mask, so it can only pick among allowed tokens).
    close = token_id(server, "}")
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=40, temperature=0.7, seed=1, response_format={"type": "json_object"},
                                       logit_bias={str(close): 30})
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                      "maximum": 5}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"],
        "additionalProperties": False}}},
]


def test_tool_choice_named(client, server):
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "weather?"}],
                                       max_tokens=60, temperature=1.0, seed=5, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert args["city"] in ("Paris", "Lima") and 1 <= args["days"] <= 5 and set(args) == {"city", "days"}
    # Streamed: the name first, then the arguments in pieces that concatenate to the same JSON.
    chunks = list(client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "weather?"}], max_tokens=60, temperature=1.0,
        seed=5, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments


def token_id(server, text):
    req = urllib.request.Request(server.url + "/tokenize", data=json.dumps({"prompt": text, "add_special_tokens": False}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["tokens"][-1]


def test_tool_choice_required(client, server):
    # The array of calls has no length bound (as in vLLM): bias ']' up so the random model
    # closes it after a call or two instead of running into max_tokens. The grammar's mask comes
    # first, so ']' can only be drawn where the array may end.
    close = token_id(server, "]")
    for seed in range(3):
        r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "do it"}],
                                           max_tokens=90, temperature=1.0, seed=seed, tools=TOOLS,
                                           tool_choice="required", logit_bias={str(close): 20})
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
        assert len(calls) >= 1
        for c in calls:
            args = json.loads(c.function.arguments)
            if c.function.name == "get_weather":
                assert args["city"] in ("Paris", "Lima") and 1 <= args["days"] <= 5
            else:
                assert c.function.name == "ping" and isinstance(args["loud"], bool)


@pytest.mark.parametrize("extra,fragment", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs a non-empty 'tools'"),
    ({"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "JSON schema"),
    ({"guided_regex": "([a-"}, "regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_structured_errors_are_400(client, server, extra, fragment):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       extra_body=extra)
    assert fragment in str(e.value), str(e.value)
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert r.usage.completion_tokens >= 1
