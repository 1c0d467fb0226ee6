"""Load: 64 concurrent streaming clients for ML4_LOAD_SECONDS (default 60) against one
server. Zero failed requests, every stream ends with a finish_reason, the server's RSS is
flat after warm-up (growth under 10% + 16 MiB), and the KV pool is whole again at the end.

The KV budget is kept small (48 MiB, ~250 blocks of 64 tokens per group, about what 64
clients hold at once) so the warm-up touches every cache page: the runner's pages are
first-touch memory, and the block pool's LRU order hands out never-used blocks before
evicting cached ones, so a large, partly touched pool would look like growth. For the same
reason the HTTP pool has 80 threads (64 keep-alive clients + scrapes), all busy during
warm-up: each thread that tokenizes a prompt keeps a thread_local BPE piece cache
(src/tokenizer/tokenizer.cpp), bounded per thread, which a 256-thread pool fills slowly.
"""
import os
import random
import threading
import time
import urllib.request

import openai
import pytest

from conftest import Server

CLIENTS = 64
SECONDS = float(os.environ.get("ML4_LOAD_SECONDS", "60"))
WARMUP = min(15.0, SECONDS / 4)


def metric(server, name, labels=""):
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_64_streaming_clients(model_dir):
    s = Server(model_dir, "--max-num-seqs", "64", "--max-model-len", "1024", "--kv-cache-memory-bytes",
               str(48 << 20), "--http-threads", "80", name="load")
    try:
        free0 = metric(s, "ml4:kv_cache_free_blocks", 'cache_group="latent"')
        stop_at = time.time() + SECONDS
        done, failures, tokens = [0], [], [0]
        lock = threading.Lock()

        def worker(i):
            rng = random.Random(i)
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            while time.time() < stop_at:
                prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(4, 40)))
                try:
                    n_tok, finish = 0, None
                    for chunk in client.completions.create(model="load", prompt=prompt, stream=True,
                                                           max_tokens=rng.randint(8, 48), temperature=0.8,
                                                           stream_options={"include_usage": True}):
                        if chunk.choices:
                            finish = chunk.choices[0].finish_reason or finish
                        if chunk.usage:
                            n_tok = chunk.usage.completion_tokens
                    if finish not in ("stop", "length") or n_tok < 1:
                        raise RuntimeError(f"bad stream end: finish={finish} tokens={n_tok}")
                    with lock:
                        done[0] += 1
                        tokens[0] += n_tok
                except Exception as e:  # noqa: BLE001 - every failure is counted
                    with lock:
                        failures.append(repr(e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(WARMUP)
        rss_warm = s.rss_kib()
        peak_running = 0
        while time.time() < stop_at:
            peak_running = max(peak_running, metric(s, "vllm:num_requests_running"))
            time.sleep(1.0)
        for t in threads:
            t.join(timeout=180)
        rss_end = s.rss_kib()
        print(f"load: {done[0]} requests, {tokens[0]} tokens in {SECONDS:.0f} s, peak running {peak_running}, "
              f"rss {rss_warm} -> {rss_end} KiB, failures {len(failures)}")
        assert not failures, failures[:5]
        assert done[0] >= CLIENTS
        assert peak_running >= 16  # really concurrent
        assert rss_end - rss_warm < 0.10 * rss_warm + 16 * 1024
        time.sleep(0.5)
        assert metric(s, "vllm:num_requests_running") == 0
        assert metric(s, "ml4:kv_cache_free_blocks", 'cache_group="latent"') == free0
    finally:
        assert s.stop() == 0
