"""`ml4 serve` through the real `openai` Python client: completions and chat, streaming and
not, n > 1, logprobs, stop, seed reproducibility, usage, and the side endpoints.

The model is ml4-tiny with random weights, so texts are arbitrary bytes: every check
compares the server with itself (stream vs non-stream, seeded reruns, stop truncation of a
known greedy output) or with a rule (logprob <= 0, greedy token is the top-1 logprob).
"""
import json
import math
import urllib.request

import pytest


def post(server, path, body):
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.name]


def test_completion_stream_equals_non_stream(client, server):
    kw = dict(model=server.name, prompt="The quick brown fox", max_tokens=24, temperature=0, ignore_eos=False)
    full = client.completions.create(**{k: v for k, v in kw.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    chunks = list(client.completions.create(model=server.name, prompt="The quick brown fox", max_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_chat_stream_equals_non_stream(client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=server.name, messages=msgs, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=server.name, messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_n_choices_and_seed(client, server):
    kw = dict(model=server.name, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seed reproduces
    assert len({c.text for c in a.choices}) > 1  # choices differ
    c = client.completions.create(**{**kw, "seed": 99, "n": 1})
    assert a.usage.completion_tokens == sum(1 for _ in range(3)) * 12 or a.usage.completion_tokens <= 36
    # Streaming n = 2: every index finishes once.
    chunks = list(client.completions.create(**{**kw, "n": 2, "stream": True}))
    finished = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert finished == [0, 1]
    streamed = ["".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) for i in (0, 1)]
    assert streamed == [a.choices[0].text, a.choices[1].text]
    assert c.choices[0].text is not None


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.name, prompt="Numbers: 1 2 3", max_tokens=8, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 8 and len(lp.token_logprobs) == 8 and len(lp.top_logprobs) == 8
    for tok_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0.0
        assert len(top) <= 3 and len(top) >= 1  # distinct token strings may collide (U+FFFD)
        # Greedy: the sampled token is the most likely one (f32 logprobs, exact ties aside).
        assert tok_lp >= max(top.values()) - 1e-5
    assert lp.text_offset[0] == 0
    assert "".join(lp.tokens).encode() is not None


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for c in content:
        assert c.logprob <= 0.0 and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert abs(c.logprob - c.top_logprobs[0].logprob) < 1e-5
        assert isinstance(c.bytes, list)
        # Probabilities of the top 2 cannot exceed 1.
        assert math.exp(c.top_logprobs[0].logprob) + math.exp(c.top_logprobs[1].logprob) <= 1.0 + 1e-5


def test_stop_string_truncates(client, server):
    base = client.completions.create(model=server.name, prompt="abc", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    # A stop string taken from the middle of the greedy text: the output must end right
    # before its first occurrence.
    cands = [text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]]
    if not cands:
        pytest.skip("greedy text has no printable pair to stop on")
    stop = cands[0]
    r = client.completions.create(model=server.name, prompt="abc", max_tokens=40, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    chunks = list(client.completions.create(model=server.name, prompt="abc", max_tokens=40, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_stop_token_ids_and_min_tokens(server):
    body = {"prompt": [1, 300, 301, 302], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    ids = post(server, "/v1/completions", body)["choices"][0]["token_ids"]
    assert len(ids) == 10
    stop_id = ids[3]
    r = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id]})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == ids.index(stop_id) + 1
    assert r["choices"][0]["token_ids"] == ids[:ids.index(stop_id) + 1]
    r = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id], "min_tokens": 10})
    assert r["choices"][0]["finish_reason"] == "length"


def test_prefix_cache_hit_same_output(client, server):
    prompt = "A long shared prefix " * 12
    a = client.completions.create(model=server.name, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=server.name, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    assert b.usage.prompt_tokens_details.cached_tokens > 0


def test_tokenize_detokenize_metrics(server):
    t = post(server, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})
    assert t["count"] == len(t["tokens"]) > 0
    d = post(server, "/detokenize", {"tokens": t["tokens"]})
    assert d["prompt"] == "Hello world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > 2
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket"]:
        assert name in text, name
    assert 'cache_group="latent"' in text and 'cache_group="indexer"' in text


def test_chat_with_tools_is_encoded_and_answered(client, server):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    plain = client.chat.completions.create(model=server.name, messages=msgs, max_tokens=4, temperature=0)
    with_tools = client.chat.completions.create(model=server.name, messages=msgs, tools=tools, max_tokens=4,
                                                temperature=0)
    # The tool definitions are in the prompt ([AVAILABLE_TOOLS] block, mistral-common layout).
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A tool-result turn in the history is accepted too (ids rewritten to 9 alphanumerics).
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123xyz", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_abc123xyz", "content": "sunny"}]
    r = client.chat.completions.create(model=server.name, messages=history, tools=tools, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens


def test_seeded_sampling_same_alone_and_under_load(client, server):
    """Each request samples from its own seeded generator: batching with others changes nothing."""
    import concurrent.futures
    kw = dict(model=server.name, prompt="Seeded sampling", max_tokens=16, temperature=0.9, top_p=0.95, seed=77,
              extra_body={"ignore_eos": True})
    alone = client.completions.create(**kw).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(9) as ex:
        noise = [ex.submit(client.completions.create, model=server.name, prompt=f"noise {i}", max_tokens=24,
                           temperature=1.0) for i in range(8)]
        again = ex.submit(client.completions.create, **kw)
        assert again.result().choices[0].text == alone
        for f in noise:
            f.result()
