"""HiSparse host KV offload through `ml4 serve` (SYSTEM.md S12), on the CPU runner with ml4-tiny:
  - bad connector configs are refused at start-up, naming the field;
  - greedy completions of long prompts (several times the hot buffers) through the `openai`
    client equal those of a server without offload, text and token counts;
  - /metrics shows rows loaded and hit, layer-steps served from the hot buffers and from the
    host pool, and no region or row held once every request is done.
"""
import json
import re
import subprocess
import urllib.request

import openai
import pytest

from conftest import Server, ml4_bin

HS = json.dumps({"kv_connector": "HiSparseConnector",
                 "kv_connector_extra_config": {"host_pool_gb": 0.05, "hot_slots_per_request": 24}})


def refused(model, config):
    p = subprocess.run([ml4_bin(), "serve", "--model", model, "--port", "0", "--kv-transfer-config", config],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    return p.stdout + p.stderr


def test_bad_configs_are_refused_at_start(model_dir):
    base = {"kv_connector": "HiSparseConnector"}
    assert "needs kv_connector_extra_config" in refused(model_dir, json.dumps(base))
    assert "host_pool_gb must be a number" in refused(
        model_dir, json.dumps({**base, "kv_connector_extra_config": {"host_pool_gb": -2}}))
    assert "unknown kv_connector_extra_config field 'swap_in'" in refused(
        model_dir, json.dumps({**base, "kv_connector_extra_config": {"host_pool_gb": 1, "swap_in": 960}}))
    assert "holds no block" in refused(
        model_dir, json.dumps({**base, "kv_connector_extra_config": {"host_pool_gb": 0.00001}}))
    # ml4-tiny's indexer keeps 16 keys: a buffer must hold one decode token's selection.
    assert "below the indexer's top-k 16" in refused(
        model_dir, json.dumps({**base, "kv_connector_extra_config": {"host_pool_gb": 1, "hot_slots_per_request": 8}}))


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(ml4:hisparse_\w+)\{[^}]*?(?:read="(\w+)")?\}\s+(\S+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def test_completions_equal_without_offload(model_dir):
    plain = Server(model_dir, "--max-model-len", "1024")
    hs = Server(model_dir, "--max-model-len", "1024", "--kv-transfer-config", HS)
    try:
        words = "the quick brown fox jumps over the lazy dog and then some more words follow here".split()
        prompts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(30 + 20 * i)) for i in range(6)]
        answers = {}
        for s in (plain, hs):
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
            answers[s] = [c.completions.create(model="ml4-tiny", prompt=p, max_tokens=24, temperature=0)
                          for p in prompts]
        for a, b in zip(answers[plain], answers[hs]):
            assert a.choices[0].text == b.choices[0].text
            assert a.usage.completion_tokens == b.usage.completion_tokens == 24
            assert a.usage.prompt_tokens == b.usage.prompt_tokens
        m = metrics(hs.url)
        assert m[("ml4:hisparse_rows_loaded_total", None)] > 0
        assert m[("ml4:hisparse_hot_rows_hit_total", None)] > 0
        assert m[("ml4:hisparse_layer_steps_total", "hot")] > 0
        assert m[("ml4:hisparse_layer_steps_total", "host")] > 0  # long prompt chunks overflow 24 rows
        assert m[("ml4:hisparse_regions_in_use", None)] == 0
        assert m[("ml4:hisparse_resident_rows", None)] == 0
        assert not metrics(plain.url)
    finally:
        plain.stop()
        hs.stop()
