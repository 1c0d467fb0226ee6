"""`ml4 bench serve` against a live `ml4 serve`: the run completes with zero failures, the
JSON has every figure with consistent totals, and Poisson arrivals, warm-up, a JSONL dataset
and the chat endpoint all work."""
import json
import subprocess

from conftest import ml4_bin


def run_bench(server, tmp_path, *args):
    out = tmp_path / "bench.json"
    p = subprocess.run([ml4_bin(), "bench", "serve", "--base-url", server.url, "--no-progress",
                        "--result-file", str(out), *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Serving Benchmark Result" in p.stdout and "Mean TTFT (ms)" in p.stdout
    return json.loads(out.read_text())


def test_random_prompts_fixed_concurrency(server, tmp_path):
    r = run_bench(server, tmp_path, "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "32",
                  "--output-len", "8", "--num-warmups", "1")
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_input_tokens"] == 6 * 32  # exact lengths from the server's own tokens
    assert r["total_output_tokens"] == 6 * 8
    assert r["max_concurrency_seen"] <= 3
    # The lengths each request really had, as the server counted them (vllm bench's fields).
    assert r["input_lens"] == [32] * 6 and r["output_lens"] == [8] * 6
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert r[k]["p99"] >= r[k]["median"] >= 0
    assert r["e2el_ms"]["mean"] >= r["ttft_ms"]["mean"]
    assert abs(r["output_throughput"] - r["total_output_tokens"] / r["duration_s"]) < 1e-6


def test_dataset_poisson_and_chat(server, tmp_path):
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("\n".join(json.dumps({"prompt": f"Tell me about item {i}", "output_len": 5}) for i in range(3)))
    r = run_bench(server, tmp_path, "--dataset", str(ds), "--num-prompts", "4", "--request-rate", "20",
                  "--endpoint", "/v1/chat/completions")
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["total_output_tokens"] == 4 * 5
    # A dataset has no single input / output length: the real ones are recorded instead.
    assert r["input_len"] is None and r["output_len"] is None
    assert r["output_lens"] == [5] * 4 and sum(r["input_lens"]) == r["total_input_tokens"]
    assert all(n > 0 for n in r["input_lens"])


def test_failures_are_counted(server, tmp_path):
    out = tmp_path / "bad.json"
    p = subprocess.run([ml4_bin(), "bench", "serve", "--base-url", server.url, "--no-progress", "--model", "nope",
                        "--num-prompts", "2", "--output-len", "4", "--result-file", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2  # ran, but requests failed
    r = json.loads(out.read_text())
    assert r["failed"] == 2 and r["completed"] == 0 and "404" in r["errors"][0]
