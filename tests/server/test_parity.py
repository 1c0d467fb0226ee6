"""vLLM-parity items of issue 21 through the real `openai` client and raw HTTP: echo (streamed,
with logprobs, max_tokens 0), prompt_logprobs, stop_reason as an integer, logit_bias, refused
fields, continuous usage stats, logprobs 0, /tokenize's token_strs and model check, 405, /ping,
/openapi.json, and the KV usage metric as one series.

Prompt logprobs are checked against the engine's own generation: a greedy continuation's
logprobs (decode steps) must equal the logprobs that echo reports for the same tokens when they
are fed back as part of the prompt (one prefill). Both are f32 log_softmax values of the same
model; the CPU forward reduces in a different order for a prefill than for a decode step, so
they agree to ~1e-3, not bit for bit.
"""
import json
import urllib.error
import urllib.request

import openai
import pytest


def call(server, path, body=None, method=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, dict(r.headers), (json.loads(raw) if raw.strip() and path != "/metrics" else raw)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, dict(e.headers), (json.loads(raw) if raw.strip() else None)


def test_echo_logprobs_equal_generation_logprobs(client, server):
    gen = client.completions.create(model=server.name, prompt="Counting: one two", max_tokens=6, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    g = gen.choices[0]
    prompt_ids = g.model_extra["prompt_token_ids"]
    out_ids = g.model_extra["token_ids"]
    echo = client.completions.create(model=server.name, prompt=prompt_ids + out_ids, max_tokens=0, echo=True,
                                     logprobs=2)
    e = echo.choices[0]
    n = len(prompt_ids) + len(out_ids)
    assert len(e.logprobs.tokens) == n and len(e.logprobs.token_logprobs) == n
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    for k, lp in enumerate(g.logprobs.token_logprobs):
        assert abs(e.logprobs.token_logprobs[len(prompt_ids) + k] - lp) < 2e-3, (k, lp)
    # max_tokens 0 with echo: the prompt alone, no completion tokens.
    assert e.text == call(server, "/detokenize", {"tokens": prompt_ids + out_ids})[2]["prompt"]
    assert echo.usage.completion_tokens == 0
    assert e.logprobs.text_offset[0] == 0
    assert all(b >= a for a, b in zip(e.logprobs.text_offset, e.logprobs.text_offset[1:]))


def test_echo_streamed_equals_non_streamed(client, server):
    kw = dict(model=server.name, prompt="Echo this", max_tokens=5, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    assert full.text.startswith("Echo this")
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert chunks[0].choices[0].text.startswith("Echo this")
    streamed_lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    full_lps = full.logprobs.token_logprobs
    assert streamed_lps[0] is None and len(streamed_lps) == len(full_lps)
    for a, b in zip(streamed_lps, full_lps):
        assert (a is None and b is None) or abs(a - b) < 1e-6


def test_prompt_logprobs_field(client, server):
    r = client.completions.create(model=server.name, prompt="Alpha beta gamma", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    c = r.choices[0]
    plp = c.model_extra["prompt_logprobs"]
    ids = c.model_extra["prompt_token_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    echo = client.completions.create(model=server.name, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    for q in range(1, len(ids)):
        entry = plp[q][str(ids[q])]
        assert entry["rank"] >= 1 and entry["logprob"] <= 0
        assert abs(entry["logprob"] - echo.choices[0].logprobs.token_logprobs[q]) < 1e-5
        assert len(plp[q]) <= 3  # the prompt token and the top 2
    chat = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.name, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_stop_reason_is_the_stop_token_id(client, server):
    base = client.completions.create(model=server.name, prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = base.choices[0].model_extra["token_ids"]
    stop_id = ids[3]
    r = client.completions.create(model=server.name, prompt="abc", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop_id and isinstance(r.choices[0].model_extra["stop_reason"], int)


def test_logit_bias_forces_and_forbids(client, server):
    t = call(server, "/tokenize", {"prompt": "Z", "add_special_tokens": False})[2]["tokens"][-1]
    r = client.completions.create(model=server.name, prompt="hello", max_tokens=6, temperature=0.8, seed=3,
                                  logit_bias={str(t): 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [t] * 6
    base = client.completions.create(model=server.name, prompt="hello", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    first = base.choices[0].model_extra["token_ids"][0]
    r = client.completions.create(model=server.name, prompt="hello", max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"][0] != first
    for bad in [{"x": 1}, {"99999999": 1}, {"5": "a"}]:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=server.name, prompt="h", max_tokens=1, logit_bias=bad)


@pytest.mark.parametrize("field,value", [("suffix", "tail"), ("best_of", 3), ("use_beam_search", True)])
def test_unsupported_completion_fields_are_400(client, server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.name, prompt="h", max_tokens=1, extra_body={field: value})
    assert field in str(e.value)


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("function_call", "auto"),
                                         ("audio", {"voice": "x"}), ("modalities", ["audio"]),
                                         ("prediction", {"type": "content", "content": "x"})])
def test_unsupported_chat_fields_are_400(client, server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "h"}], max_tokens=1,
                                       extra_body={field: value})
    assert field in str(e.value)


def test_continuous_usage_stats(client, server):
    chunks = list(client.completions.create(model=server.name, prompt="count", max_tokens=5, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choice = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choice)
    done = [c.usage.completion_tokens for c in with_choice]
    assert done == sorted(done) and done[-1] == 5
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in with_choice)
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_completion_logprobs_zero_names_the_chosen_tokens(client, server):
    r = client.completions.create(model=server.name, prompt="zero", max_tokens=4, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(x <= 0 for x in lp.token_logprobs)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {tok: val}


def test_tokenize_token_strs_and_model_check(server):
    st, _, js = call(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True, "model": server.name})
    assert st == 200 and len(js["token_strs"]) == js["count"] == len(js["tokens"])
    assert "".join(js["token_strs"][1:]) == "Hello world"  # after <s>
    st, _, js2 = call(server, "/tokenize", {"prompt": "Hello world"})
    assert js2["token_strs"] is None and js2["tokens"] == js["tokens"]
    st, _, err = call(server, "/tokenize", {"prompt": "x", "model": "other"})
    assert st == 404 and "does not exist" in err["error"]["message"]
    st, _, err = call(server, "/detokenize", {"tokens": [1], "model": "other"})
    assert st == 404


def test_methods_ping_and_openapi(server):
    st, hdrs, err = call(server, "/v1/completions", method="GET")
    assert st == 405 and err["error"]["code"] == 405 and "POST" in hdrs.get("Allow", "")
    st, hdrs, err = call(server, "/health", {"x": 1}, method="POST")
    assert st == 405
    for method in ("GET", "POST"):
        st, _, _ = call(server, "/ping", {} if method == "POST" else None, method=method)
        assert st == 200
    st, _, doc = call(server, "/openapi.json")
    assert st == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(doc["paths"])
    assert "CompletionRequest" in doc["components"]["schemas"]


def test_kv_cache_usage_is_one_series(server):
    st, _, raw = call(server, "/metrics")
    lines = [l for l in raw.decode().splitlines() if l.startswith("vllm:kv_cache_usage_perc")]
    assert len(lines) == 1 and "cache_group" not in lines[0], lines
    per_group = [l for l in raw.decode().splitlines() if l.startswith("ml4:kv_cache_usage_perc")]
    assert any('cache_group="latent"' in l for l in per_group)
    fullest = max(float(l.rsplit(" ", 1)[1]) for l in per_group)
    assert float(lines[0].rsplit(" ", 1)[1]) == pytest.approx(fullest)
