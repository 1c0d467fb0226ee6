"""Prefill/decode disaggregation on the CPU backend over UCX loopback (issue 16): a prefill
server (kv_producer), a decode server (kv_consumer) and `ml4 proxy`, as three processes.

- Outputs through the proxy equal one colocated server's, request by request (greedy,
  seeded sampling, long prompts, chat, streaming, prefix-cache hits on the decode side).
- Faults, each with its expected outcome and a leak check (no block held, every block free,
  on both sides, after): the client aborts during the prefill, the transfer and the decode;
  the decode never pulls (the prefill's timeout frees); corrupt, truncated and foreign
  metadata; the prefill or the decode killed mid-transfer, then restarted while the other
  keeps serving.
- Load: 32 concurrent clients through the proxy for ML4_PD_LOAD_SECONDS (default 30): no
  failed request, no failed transfer, flat RSS on all three processes.

Mid-transfer faults need a transfer that lasts: the decode servers of those tests delay each
load by `load_delay_ms` (kv_connector_extra_config, a fault-injection knob) so a kill or a
disconnect lands while the load is in flight.
"""
import http.server
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from conftest import Server, free_port, ml4_bin

TIMEOUT_S = 5  # --kv-transfer-timeout of these servers
COMMON = ["--max-model-len", "4096", "--seed", "0", "--kv-cache-memory-bytes", str(64 << 20)]


def kv_config(role, delay_ms=0):
    c = {"kv_connector": "UcxConnector", "kv_role": role}
    if delay_ms:
        c["kv_connector_extra_config"] = {"load_delay_ms": delay_ms}
    return json.dumps(c)


def start_server(model_dir, port, *args):
    # conftest.Server picks its own port; pass ours through the arguments it forwards.
    s = Server.__new__(Server)
    s.port = port
    s.url = f"http://127.0.0.1:{port}"
    s.name = "ml4-tiny"
    s.log = tempfile.NamedTemporaryFile(prefix="ml4-pd-", suffix=".log", delete=False)
    cmd = [ml4_bin(), "serve", "--model", model_dir, "--served-model-name", "ml4-tiny", "--port", str(port), *args]
    s.proc = subprocess.Popen(cmd, stdout=s.log, stderr=subprocess.STDOUT)
    wait_healthy(s)
    return s


def wait_healthy(s, limit=60):
    deadline = time.time() + limit
    while time.time() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"exited with {s.proc.returncode}: {s.log_text()}")
        try:
            with urllib.request.urlopen(s.url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001
            time.sleep(0.1)
    raise RuntimeError("not healthy: " + s.log_text())


def start_proxy(prefill_urls, decode_urls, *extra):
    s = Server.__new__(Server)
    s.port = free_port()
    s.url = f"http://127.0.0.1:{s.port}"
    s.name = "ml4-tiny"
    s.log = tempfile.NamedTemporaryFile(prefix="ml4-proxy-", suffix=".log", delete=False)
    cmd = [ml4_bin(), "proxy", "--port", str(s.port)]
    for u in prefill_urls:
        cmd += ["--prefill", u]
    for u in decode_urls:
        cmd += ["--decode", u]
    cmd += list(extra)
    s.proc = subprocess.Popen(cmd, stdout=s.log, stderr=subprocess.STDOUT)
    wait_healthy(s)
    return s


def metrics(s):
    with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric(s, name, labels=""):
    for line in metrics(s).splitlines():
        if line.startswith(name + "{") and labels in line or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def free_total(s):
    total = sum(metric(s, "ml4:kv_cache_free_blocks", f'cache_group="{g}"') for g in ("latent", "indexer"))
    return total


def post(url, path, body, timeout=120):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    def parse(raw):
        try:
            return json.loads(raw or b"{}")
        except ValueError:
            return {"unparsable": raw.decode(errors="replace")}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, parse(r.read())
    except urllib.error.HTTPError as e:
        return e.code, parse(e.read())


def wait_for(pred, limit=20.0, what=""):
    deadline = time.time() + limit
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


def leak_free(*servers, limit=TIMEOUT_S + 10.0):
    """Every side: nothing held for remote, nothing loading, every block free again."""
    for s in servers:
        wait_for(lambda: metric(s, "ml4:kv_blocks_held_for_remote") == 0 and
                 metric(s, "ml4:kv_transfer_loads_in_flight") == 0 and
                 metric(s, "vllm:kv_cache_usage_perc") == 0.0,
                 limit, f"{s.url} to free every block")


def words(n, seed):
    import random
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"]) for _ in range(n))


@pytest.fixture(scope="module")
def pd(model_dir):
    p = start_server(model_dir, free_port(), *COMMON, "--kv-transfer-config", kv_config("kv_producer"),
                     "--kv-transfer-timeout", str(TIMEOUT_S))
    d = start_server(model_dir, free_port(), *COMMON, "--kv-transfer-config", kv_config("kv_consumer"),
                     "--kv-transfer-timeout", str(TIMEOUT_S))
    x = start_proxy([p.url], [d.url], "--max-body-bytes", "65536")
    c = start_server(model_dir, free_port(), *COMMON)
    yield p, d, x, c
    for s in (x, d, p, c):
        s.stop()


def completion(url, prompt, **kw):
    body = {"model": "ml4-tiny", "prompt": prompt, "return_token_ids": True, **kw}
    status, out = post(url, "/v1/completions", body)
    assert status == 200, out
    assert "error" not in out, out
    return out["choices"][0]


def test_outputs_equal_colocated(pd):
    p, d, x, c = pd
    cases = []
    for i in range(3):
        cases.append(dict(prompt=words(8 + 40 * i, i), max_tokens=24, temperature=0, ignore_eos=True))
    cases.append(dict(prompt=words(600, 7), max_tokens=16, temperature=0, ignore_eos=True))  # ~10 blocks
    for i in range(3):
        cases.append(dict(prompt=words(30 + 70 * i, 100 + i), max_tokens=20, temperature=0.9, top_p=0.9,
                          seed=1000 + i, ignore_eos=True))
    shared = words(200, 55)
    cases.append(dict(prompt=shared + " one", max_tokens=12, temperature=0, ignore_eos=True))
    cases.append(dict(prompt=shared + " two", max_tokens=12, temperature=0, ignore_eos=True))  # decode-side hit
    cases.append(cases[3])  # the long prompt again: the decode's prefix cache has its full blocks
    blocks0 = metric(d, "ml4:kv_transfer_blocks_total")
    hits0 = metric(d, "vllm:prefix_cache_hits_total")
    for case in cases:
        want = completion(c.url, **case)
        got = completion(x.url, **case)
        assert got["token_ids"] == want["token_ids"], case
        assert got["text"] == want["text"]
        assert got["finish_reason"] == want["finish_reason"] == "length"
    # Streaming through the proxy equals the same request colocated, chat too.
    stream_case = dict(prompt=words(90, 9), max_tokens=20, temperature=0, ignore_eos=True)
    want = completion(c.url, **stream_case)
    text = sse_text(x.url, "/v1/completions", {"model": "ml4-tiny", "stream": True, **stream_case})
    assert text == want["text"]
    msgs = [{"role": "user", "content": words(50, 3)}]
    status, want_chat = post(c.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0})
    status2, got_chat = post(x.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0})
    assert status == status2 == 200, got_chat
    assert got_chat["choices"][0]["message"]["content"] == want_chat["choices"][0]["message"]["content"]
    # The transfers happened, and the decode side read less for the prompts it had cached.
    assert metric(d, "ml4:kv_transfer_failures_total") == 0
    assert metric(d, "ml4:kv_transfer_requests_total") >= len(cases) + 2
    assert metric(d, "ml4:kv_transfer_bytes_total") > 0
    assert metric(d, "vllm:prefix_cache_hits_total") > hits0
    assert metric(d, "ml4:kv_transfer_blocks_total") - blocks0 > 0
    assert metric(x, "ml4:proxy_failed_requests_total") == 0
    leak_free(p, d)


SPEC = ["--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": 3})]


def spec_counts(s):
    return (metric(s, "vllm:spec_decode_num_drafts_total"), metric(s, "vllm:spec_decode_num_accepted_tokens_total"))


def test_speculative_decoding_drafter_window_travels(model_dir):
    """DSpark under P/D: the drafter's sliding-window cache group goes with the KV. On the trained
    model (real acceptance) the decode side's drafts must be the colocated server's (the same
    draft and accepted-token counts: drafts read the transferred window rows, so a missing or
    wrong page shows as other drafts), outputs equal the colocated and the non-speculative ones
    (greedy is lossless); on ml4-tiny (a 64-token window) prompts past the window leave pages
    before it unheld on both sides. A producer without speculation is refused by name."""
    from conftest import ROOT
    small = os.path.join(ROOT, "assets", "ml4-small")
    for model, prompts in ((small, [words(120, 1), words(300, 2), "The history of the city begins " + words(60, 3)]),
                           (model_dir, [words(20, 4), words(150, 5), words(400, 6)])):
        p = start_server(model, free_port(), *COMMON, *SPEC, "--kv-transfer-config", kv_config("kv_producer"),
                         "--kv-transfer-timeout", str(TIMEOUT_S))
        d = start_server(model, free_port(), *COMMON, *SPEC, "--kv-transfer-config", kv_config("kv_consumer"),
                         "--kv-transfer-timeout", str(TIMEOUT_S))
        x = start_proxy([p.url], [d.url], "--max-body-bytes", "65536")
        c = start_server(model, free_port(), *COMMON, *SPEC)
        plain = start_server(model, free_port(), *COMMON)
        try:
            d0, c0 = spec_counts(d), spec_counts(c)
            for prompt in prompts:
                case = dict(prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
                want = completion(plain.url, **case)
                assert completion(c.url, **case)["token_ids"] == want["token_ids"]
                got = completion(x.url, **case)
                assert got["token_ids"] == want["token_ids"], prompt[:40]
            d1, c1 = spec_counts(d), spec_counts(c)
            drafts_d, acc_d = d1[0] - d0[0], d1[1] - d0[1]
            drafts_c, acc_c = c1[0] - c0[0], c1[1] - c0[1]
            print(f"{os.path.basename(model)}: P/D decode side {drafts_d} drafts, {acc_d} accepted; colocated "
                  f"{drafts_c}, {acc_c}")
            assert drafts_d > 0 and (drafts_d, acc_d) == (drafts_c, acc_c)
            if model == small:
                assert acc_c > 0  # a trained drafter: the counts carry information
            assert metric(d, "ml4:kv_transfer_failures_total") == 0
            leak_free(p, d)
        finally:
            for s_ in (x, d, p, c, plain):
                s_.stop()
    # Speculation on one side only: the metadata exchange names the mismatch.
    p = start_server(model_dir, free_port(), *COMMON, "--kv-transfer-config", kv_config("kv_producer"))
    d = start_server(model_dir, free_port(), *COMMON, *SPEC, "--kv-transfer-config", kv_config("kv_consumer"))
    x = start_proxy([p.url], [d.url])
    try:
        status, out = post(x.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(30, 8), "max_tokens": 4})
        assert status != 200 or "error" in out
        assert "speculative decoding is off on the producer and on here" in json.dumps(out), out
    finally:
        for s_ in (x, d, p):
            s_.stop()


def test_round_robin_over_instances(model_dir, pd):
    p, d, x, c = pd
    p2 = start_server(model_dir, free_port(), *COMMON, "--kv-transfer-config", kv_config("kv_producer"),
                      "--kv-transfer-timeout", str(TIMEOUT_S))
    proxy = start_proxy([p.url, p2.url], [d.url])
    try:
        before = [metric(s, "ml4:kv_transfer_holds_released_total") for s in (p, p2)]
        for i in range(4):
            case = dict(prompt=words(40 + i, 300 + i), max_tokens=8, temperature=0, ignore_eos=True)
            assert completion(proxy.url, **case)["token_ids"] == completion(c.url, **case)["token_ids"]
        after = [metric(s, "ml4:kv_transfer_holds_released_total") for s in (p, p2)]
        assert [a - b for a, b in zip(after, before)] == [2, 2]  # each prefill served every other request
        leak_free(p, p2, d)
    finally:
        proxy.stop()
        p2.stop()


def sse_text(url, path, body, stop_after=None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            ch = ev["choices"][0] if ev.get("choices") else None
            if ch:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return text


def raw_stream(url, path, body):
    """Opens a streaming request on a raw socket; returns the socket (close it to abort)."""
    host, port = url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_client_abort_during_prefill(model_dir, pd):
    p, d, x, c = pd
    # A long prompt prefilled 32 tokens a step on a slow prefill server, so the abort lands in it.
    slow = start_server(model_dir, free_port(), *COMMON, "--max-num-batched-tokens", "32",
                        "--kv-transfer-config", kv_config("kv_producer"), "--kv-transfer-timeout", str(TIMEOUT_S))
    proxy = start_proxy([slow.url], [d.url])
    try:
        aborted0 = metric(slow, "vllm:request_success_total", 'finished_reason="abort"')
        ids = [3 + (i * 131) % 500 for i in range(3000)]  # 3,000 tokens: ~90 prefill steps
        sock = raw_stream(proxy.url, "/v1/completions", {"model": "ml4-tiny", "prompt": ids,
                                                         "max_tokens": 8, "stream": True})
        wait_for(lambda: metric(slow, "vllm:num_requests_running") == 1, 20, "the prefill to start")
        sock.close()  # the client goes away while the prompt is being prefilled
        wait_for(lambda: metric(slow, "vllm:request_success_total", 'finished_reason="abort"') == aborted0 + 1, 20,
                 "the prefill server to abort the request")
        assert metric(slow, "ml4:kv_requests_held_for_remote") == 0
        assert metric(proxy, "ml4:proxy_client_aborts_total") >= 1
        leak_free(slow, d)
    finally:
        proxy.stop()
        slow.stop()


@pytest.fixture(scope="module")
def slow_decode(model_dir, pd):
    """A decode server whose loads wait 2.5 s before reading, and a proxy in front of it."""
    p, d, x, c = pd
    sd = start_server(model_dir, free_port(), *COMMON, "--kv-transfer-config", kv_config("kv_consumer", 2500),
                      "--kv-transfer-timeout", str(TIMEOUT_S))
    proxy = start_proxy([p.url], [sd.url])
    yield sd, proxy
    proxy.stop()
    sd.stop()


def test_client_abort_during_transfer(pd, slow_decode):
    p, d, x, c = pd
    sd, proxy = slow_decode
    released0 = metric(p, "ml4:kv_transfer_holds_released_total")
    expired0 = metric(p, "ml4:kv_transfer_expired_total")
    sock = raw_stream(proxy.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(300, 2), "max_tokens": 8,
                                                     "stream": True})
    wait_for(lambda: metric(sd, "ml4:kv_transfer_loads_in_flight") == 1, 20, "the load to start")
    assert metric(p, "ml4:kv_requests_held_for_remote") == 1
    sock.close()
    # The decode aborts the load and tells the prefill, which frees long before its timeout.
    wait_for(lambda: metric(p, "ml4:kv_transfer_holds_released_total") == released0 + 1, TIMEOUT_S - 0.5,
             "the prefill to free on the consumer's abort")
    assert metric(p, "ml4:kv_transfer_expired_total") == expired0
    assert metric(sd, "ml4:kv_transfer_failures_total") == 0
    leak_free(p, sd)


def test_client_abort_during_decode(pd):
    p, d, x, c = pd
    aborted0 = metric(d, "vllm:request_success_total", 'finished_reason="abort"')
    sock = raw_stream(x.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(100, 4), "max_tokens": 3000,
                                                 "ignore_eos": True, "stream": True})
    got = b""
    while got.count(b"data: ") < 4:  # a few tokens decoded
        got += sock.recv(4096)
    sock.close()
    wait_for(lambda: metric(d, "vllm:request_success_total", 'finished_reason="abort"') == aborted0 + 1, 20,
             "the decode server to abort")
    leak_free(p, d)


def test_decode_never_pulls(pd):
    p, d, x, c = pd
    expired0 = metric(p, "ml4:kv_transfer_expired_total")
    status, out = post(p.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(200, 5), "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200, out
    kv = out["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] and kv["remote_block_ids"][0]
    assert metric(p, "ml4:kv_blocks_held_for_remote") == sum(len(g) for g in kv["remote_block_ids"])
    t0 = time.time()
    wait_for(lambda: metric(p, "ml4:kv_transfer_expired_total") == expired0 + 1, TIMEOUT_S + 5, "the hold to expire")
    assert time.time() - t0 >= TIMEOUT_S - 1.0  # not before its timeout
    leak_free(p)
    # A consumer that comes after the timeout fails with the reason, nothing is computed locally.
    status, late = post(d.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(200, 5), "max_tokens": 4,
                                                   "kv_transfer_params": kv})
    assert "already freed" in json.dumps(late), late
    leak_free(p, d)


class FakeProducer:
    """Serves a fixed body at /kv_transfer/metadata (corrupt, truncated or foreign metadata)."""

    def __init__(self, body):
        outer = self
        self.body = body

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *a):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_bad_metadata_and_params_are_refused(pd):
    p, d, x, c = pd
    _, out = post(p.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(80, 6), "max_tokens": 1,
                                             "kv_transfer_params": {"do_remote_decode": True}})
    kv = out["kv_transfer_params"]
    with urllib.request.urlopen(p.url + "/kv_transfer/metadata", timeout=10) as r:
        good = r.read()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    for body, want in [(bytes(flipped), "corrupt"), (good[: len(good) // 3], "truncated"), (b"hello", "truncated"),
                       (b"X" * 200, "magic")]:
        fake = FakeProducer(body)
        try:
            bad = dict(kv, remote_engine_id="fake-" + want, remote_host="127.0.0.1", remote_port=fake.port)
            status, res = post(d.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(80, 6), "max_tokens": 4,
                                                          "kv_transfer_params": bad})
            assert status == 502, res
            assert want in res["error"]["message"], res
        finally:
            fake.close()
    # Malformed params: a 400 naming the field.
    for bad, field in [({"do_remote_prefill": True}, "remote_engine_id"),
                       (dict(kv, remote_block_ids="x"), "remote_block_ids"),
                       (dict(kv, remote_port=70000), "remote_port"),
                       (dict(kv, remote_num_tokens=3), "prompt tokens"),
                       ("yes", "kv_transfer_params")]:
        status, res = post(d.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(80, 6), "max_tokens": 4,
                                                      "kv_transfer_params": bad})
        assert status == 400, res
        assert field in res["error"]["message"], res
    # The proxy bounds bodies as the servers do, and refuses what it cannot route.
    status, res = post(x.url, "/v1/completions", {"model": "ml4-tiny", "prompt": "x" * 70000})  # limit 65536
    assert status == 413 and "too large" in res["error"]["message"], res
    status, res = post(x.url, "/v1/completions", {"model": "ml4-tiny", "prompt": "hi", "n": 2})
    assert status == 400 and "n = 1" in res["error"]["message"], res
    # A producer-only request on the consumer, and the reverse, are refused.
    status, res = post(d.url, "/v1/completions", {"model": "ml4-tiny", "prompt": "x", "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400 and "kv_producer" in res["error"]["message"], res
    # The consumer goes on serving: the real params still work.
    status, res = post(d.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(80, 6), "max_tokens": 4,
                                                  "kv_transfer_params": kv})
    assert status == 200 and "error" not in res, res
    leak_free(p, d)


def test_kill_prefill_mid_transfer_then_restart(model_dir, pd, slow_decode):
    p, d, x, c = pd
    sd, _ = slow_decode
    port = free_port()
    victim = start_server(model_dir, port, *COMMON, "--kv-transfer-config", kv_config("kv_producer"),
                          "--kv-transfer-timeout", str(TIMEOUT_S))
    proxy = start_proxy([victim.url], [sd.url])
    try:
        failures0 = metric(sd, "ml4:kv_transfer_failures_total")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(proxy.url, "/v1/completions",
                                                                 {"model": "ml4-tiny", "prompt": words(300, 8),
                                                                  "max_tokens": 8})))
        t.start()
        wait_for(lambda: metric(sd, "ml4:kv_transfer_loads_in_flight") == 1, 20, "the load to start")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        t.join(60)
        status, body = result["r"]
        assert status != 200 or "error" in body, body  # the request fails, clearly ...
        assert "KV transfer" in json.dumps(body), body  # ... naming the transfer
        assert metric(sd, "ml4:kv_transfer_failures_total") == failures0 + 1
        leak_free(sd)
        # Restart the prefill on the same port while the decode keeps serving: it works again
        # (a new engine id, whose metadata the decode loads).
        victim = start_server(model_dir, port, *COMMON, "--kv-transfer-config", kv_config("kv_producer"),
                              "--kv-transfer-timeout", str(TIMEOUT_S))
        status, body = post(proxy.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(120, 9),
                                                           "max_tokens": 6})
        assert status == 200 and "error" not in body, body
        leak_free(victim, sd)
    finally:
        proxy.stop()
        victim.stop()


def test_kill_decode_mid_transfer_then_restart(model_dir, pd):
    p, d, x, c = pd
    port = free_port()
    args = [*COMMON, "--kv-transfer-config", kv_config("kv_consumer", 2500), "--kv-transfer-timeout", str(TIMEOUT_S)]
    victim = start_server(model_dir, port, *args)
    proxy = start_proxy([p.url], [victim.url])
    try:
        expired0 = metric(p, "ml4:kv_transfer_expired_total")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(proxy.url, "/v1/completions",
                                                                 {"model": "ml4-tiny", "prompt": words(300, 10),
                                                                  "max_tokens": 8})))
        t.start()
        wait_for(lambda: metric(victim, "ml4:kv_transfer_loads_in_flight") == 1, 20, "the load to start")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        t.join(60)
        status, body = result["r"]
        assert status != 200 or "error" in body, body
        # The prefill never hears from the dead consumer: its timeout frees the blocks.
        wait_for(lambda: metric(p, "ml4:kv_transfer_expired_total") == expired0 + 1, TIMEOUT_S + 5,
                 "the prefill's timeout")
        leak_free(p)
        victim = start_server(model_dir, port, *args)
        status, body = post(proxy.url, "/v1/completions", {"model": "ml4-tiny", "prompt": words(120, 11),
                                                           "max_tokens": 6})
        assert status == 200 and "error" not in body, body
        leak_free(p, victim)
    finally:
        proxy.stop()
        victim.stop()


def test_32_clients_through_the_proxy(model_dir):
    import random
    seconds = float(os.environ.get("ML4_PD_LOAD_SECONDS", "30"))
    # The CPU runner's KV pages are first-touch memory and the block pool hands out never-used
    # blocks first (test_load.py), so a pool that the load does not fill during the warm-up
    # shows up as RSS growth: 8 MiB (~40 blocks per group) is full within seconds with 32
    # clients, so after the warm-up every page has been touched and growth means a leak.
    # Each HTTP thread's first requests grow RSS (its stack, malloc arena and tokenizer cache;
    # test_load.py), and the proxy opens a connection per leg, so requests walk the whole pool:
    # the warm-up lasts until the servers have answered twice as many requests as they have
    # threads.
    threads = 40
    args = ["--max-model-len", "1024", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(8 << 20),
            "--http-threads", str(threads), "--kv-transfer-timeout", "60"]
    p = start_server(model_dir, free_port(), *args, "--kv-transfer-config", kv_config("kv_producer"))
    d = start_server(model_dir, free_port(), *args, "--kv-transfer-config", kv_config("kv_consumer"))
    x = start_proxy([p.url], [d.url])
    try:
        stop_at = time.time() + 600
        done, failures = [0], []
        lock = threading.Lock()

        def worker(i):
            rng = random.Random(i)
            while time.time() < stop_at:
                body = {"model": "ml4-tiny", "prompt": words(rng.randint(4, 120), rng.random()),
                        "max_tokens": rng.randint(4, 24), "temperature": 0.8}
                try:
                    if i % 2:
                        text = sse_text(x.url, "/v1/completions", dict(body, stream=True))
                        del text
                    else:
                        status, out = post(x.url, "/v1/completions", body)
                        if status != 200 or "error" in out or out["choices"][0]["finish_reason"] not in ("stop", "length"):
                            raise RuntimeError(f"{status} {out}")
                    with lock:
                        done[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is counted
                    with lock:
                        failures.append(repr(e))

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in workers:
            t.start()
        warm_until = time.time() + 120
        while done[0] < 2 * threads and time.time() < warm_until and not failures:
            time.sleep(0.2)
        rss_warm = [s.rss_kib() for s in (p, d, x)]
        warm_done = done[0]
        stop_at = time.time() + seconds
        for t in workers:
            t.join(timeout=300)
        rss_end = [s.rss_kib() for s in (p, d, x)]
        print(f"pd load: {warm_done} warm-up requests, then {done[0] - warm_done} in {seconds:.0f} s, "
              f"rss {rss_warm} -> {rss_end} KiB, failures {len(failures)}")
        assert not failures, failures[:5]
        assert warm_done >= 2 * threads
        assert done[0] - warm_done >= 32
        assert metric(d, "ml4:kv_transfer_failures_total") == 0
        assert metric(d, "ml4:kv_transfer_timeouts_total") == 0
        assert metric(p, "ml4:kv_transfer_expired_total") == 0
        assert metric(x, "ml4:proxy_failed_requests_total") == 0
        for w, e in zip(rss_warm, rss_end):
            assert e - w < 0.10 * w + 16 * 1024, (rss_warm, rss_end)
        leak_free(p, d)
    finally:
        for s in (x, d, p):
            s.stop()
