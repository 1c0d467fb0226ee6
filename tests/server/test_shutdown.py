"""SIGTERM semantics (issue 21): /health turns 503 at once and new requests get 503, streams in
flight run to completion within --shutdown-timeout, and a stream still open at the deadline ends
with an error event and `data: [DONE]` instead of a cut connection; the process exits 0.
"""
import json
import signal
import socket
import time
import urllib.error
import urllib.request

from conftest import Server


def status_of(url, body=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def open_stream(srv, max_tokens):
    body = json.dumps({"prompt": "go on", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data:") < 2:
        got += s.recv(4096)
    return s, got


def read_all(s, limit_s=60):
    s.settimeout(limit_s)
    got = b""
    while True:
        try:
            d = s.recv(65536)
        except socket.timeout:
            break
        if not d:
            break
        got += d
        if got.endswith(b"0\r\n\r\n"):
            break
    return got


def events(raw):
    out = []
    for line in raw.decode(errors="replace").split("\n"):
        if line.startswith("data: "):
            out.append(line[6:].strip())
    return out


def test_sigterm_health_503_and_streams_finish(model_dir):
    # The stream must outlive the /health polls below: 40 tokens took 60 ms here and the server,
    # drained, exited before the first poll on CI (connection refused). 1500 tokens take ~3.4 s
    # on 2 idle cores and well under the 60 s drain bound on a loaded machine.
    srv = Server(model_dir, "--shutdown-timeout", "60", "--max-model-len", "4096", name="drain")
    try:
        s, first = open_stream(srv, 1500)
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        while status_of(srv.url + "/health") != 503:
            assert time.time() - t0 < 2, "/health still 200 after SIGTERM"
            time.sleep(0.02)
        assert status_of(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}) == 503
        assert status_of(srv.url + "/ping") == 503
        evs = events(first + read_all(s, 90))
        assert evs[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0]["finish_reason"] for e in evs[:-1]
                  if e.startswith("{") and json.loads(e).get("choices")]
        assert finals[-1] == "length" and not any("error" in json.loads(e) for e in evs[:-1])
        s.close()
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_stream_open_at_the_deadline_ends_with_an_error_event(model_dir):
    srv = Server(model_dir, "--shutdown-timeout", "1", "--max-model-len", "4096", name="deadline")
    try:
        s, first = open_stream(srv, 3500)  # far more than one second of decoding
        srv.proc.send_signal(signal.SIGTERM)
        raw = first + read_all(s)
        assert raw.endswith(b"0\r\n\r\n"), raw[-200:]  # the chunked body was ended, not cut
        evs = events(raw)
        assert evs[-1] == "[DONE]"
        err = json.loads(evs[-2])
        assert err["error"]["code"] == 503 and "shut down" in err["error"]["message"]
        s.close()
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
