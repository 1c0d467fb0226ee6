"""DSpark speculative decoding through the CLI and the server (`--speculative-config`, vLLM's
flag), on the trained assets/ml4-small:
  - a model without a drafter, a malformed config and too many drafts are refused at start-up,
    naming the problem;
  - greedy completions with drafts are the completions without them (text and token counts),
    and `ml4 generate` prints the same ids with and without;
  - /metrics carries vLLM's vllm:spec_decode_* counters, consistent with each other;
  - `ml4 bench serve` prints the acceptance block from the /metrics deltas;
  - sampled requests (temperature 1, seeds) run with drafts too.
"""
import json
import os
import re
import subprocess
import urllib.request

import pytest

from conftest import ROOT, Server, ml4_bin

SMALL = os.path.join(ROOT, "assets", "ml4-small")
SPEC = json.dumps({"method": "dspark", "num_speculative_tokens": 7, "draft_sample_method": "greedy"})
PROMPTS = ["It is a truth universally acknowledged, that", "In the beginning God created",
           "def fibonacci(n):", "The quick brown fox", "SELECT name FROM"]


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:spec_decode_\w+)\{[^}]*?(?:position="(\d+)")?\}\s+(\S+)$', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


@pytest.fixture(scope="module")
def spec_server():
    s = Server(SMALL, "--max-model-len", "1024", "--speculative-config", SPEC, "--seed", "0", name="ml4-small")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server():
    s = Server(SMALL, "--max-model-len", "1024", "--seed", "0", name="ml4-small")
    yield s
    s.stop()


def refused(model, config):
    p = subprocess.run([ml4_bin(), "serve", "--model", model, "--port", "0", "--speculative-config", config],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    return p.stdout + p.stderr


def test_bad_configs_are_refused_at_start(model_dir, tmp_path):
    nodrafter = str(tmp_path / "m4")
    subprocess.run([ml4_bin(), "make-model", "--preset", "mistral4-tiny", "--out", nodrafter], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert "has no DSpark drafter" in refused(nodrafter, SPEC)
    assert "not valid JSON" in refused(model_dir, "{method")
    assert "unknown field 'k'" in refused(model_dir, '{"method":"dspark","num_speculative_tokens":2,"k":1}')
    # ml4-tiny's drafter block is 4: the accepted token + 3 drafts.
    assert "exceeds what the drafter proposes per step (3" in refused(
        model_dir, '{"method":"dspark","num_speculative_tokens":4}')
    assert "method 'ngram' is not supported" in refused(model_dir, '{"method":"ngram","num_speculative_tokens":2}')


def test_greedy_completions_equal_and_metrics(spec_server, plain_server):
    before = metrics(spec_server.url)
    assert before[("vllm:spec_decode_num_drafts_total", None)] == 0
    assert sorted(int(p) for (n, p) in before if p is not None) == list(range(7))
    for prompt in PROMPTS:
        body = {"model": "ml4-small", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        a, b = post(spec_server.url, body), post(plain_server.url, body)
        assert a["choices"][0]["text"] == b["choices"][0]["text"], prompt
        assert a["usage"] == b["usage"]
    m = metrics(spec_server.url)
    drafts = m[("vllm:spec_decode_num_drafts_total", None)]
    draft_tokens = m[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = m[("vllm:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [m[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(7)]
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 7 * drafts
    assert sum(per_pos) == accepted
    assert all(per_pos[j] >= per_pos[j + 1] for j in range(6))
    # Each verification emits its accepted drafts + 1 token; the first token of a request comes
    # from its prefill, and a last one with no room for a draft from a plain step.
    assert len(PROMPTS) * 40 <= accepted + drafts <= len(PROMPTS) * 47


def test_sampled_requests_with_drafts(spec_server):
    for seed in range(4):
        r = post(spec_server.url, {"model": "ml4-small", "prompt": PROMPTS[seed], "max_tokens": 30,
                                   "temperature": 1.0, "seed": seed, "ignore_eos": True})
        assert r["usage"]["completion_tokens"] == 30
        again = post(spec_server.url, {"model": "ml4-small", "prompt": PROMPTS[seed], "max_tokens": 30,
                                       "temperature": 1.0, "seed": seed, "ignore_eos": True})
        assert again["choices"][0]["text"] == r["choices"][0]["text"]  # a seed reproduces


def test_bench_serve_prints_acceptance(spec_server, tmp_path):
    out = tmp_path / "b.json"
    p = subprocess.run([ml4_bin(), "bench", "serve", "--base-url", spec_server.url, "--no-progress", "--num-prompts",
                        "4", "--max-concurrency", "2", "--input-len", "32", "--output-len", "24", "--result-file",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Speculative Decoding" in p.stdout and "Acceptance length:" in p.stdout
    assert "Position 6:" in p.stdout
    r = json.loads(out.read_text())["spec_decode"]
    assert r["num_drafts"] > 0 and 1.0 < r["acceptance_length"] <= 8.0
    # Only this run's requests (deltas): at most 4 x 23 tokens after the first ones.
    assert r["num_drafts"] + r["accepted_tokens"] <= 4 * 23
    assert len(r["accepted_per_pos"]) == 7


def test_generate_with_and_without_drafts():
    def ids(*extra):
        p = subprocess.run([ml4_bin(), "generate", "--model", SMALL, "--prompt", "In the beginning God created",
                            "--max-tokens", "40", "--ignore-eos", *extra], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        return re.search(r"^ids: (.*)$", p.stdout, re.M).group(1), p.stdout
    plain, _ = ids()
    spec, text = ids("--speculative-config", SPEC)
    assert spec == plain
    assert "mean acceptance length" in text
