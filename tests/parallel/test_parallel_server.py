"""`ml4 serve -tp 2` as two MPI ranks (issue 14): a request load with no failure, whose greedy
answers are those of `ml4 generate -tp 2` (the same ranks' arithmetic: the server's batching
changes nothing, and a sum of two partials does not depend on MPI's algorithm); then a worker killed mid-load stops the group: the
requests in flight fail (an error event or a closed connection, never a hang), rank 0 logs
which rank was lost, and the whole job exits non-zero, within KILL_STOP_S seconds.

The binary comes from $ML4_BIN (CTest sets it), else build*/ml4.
"""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The group must be gone this soon after a worker dies: the watchdog polls every 100 ms,
# rank 0's engine fails its requests at once and mpirun tears down the rest; measured
# ~0.3-1 s on the 2-core CI machine, the bound leaves room for a loaded machine.
KILL_STOP_S = 10.0


def ml4_bin():
    env = os.environ.get("ML4_BIN")
    if env and os.path.exists(env):
        return env
    for path in sorted(glob.glob(os.path.join(ROOT, "build*", "ml4"))):
        if os.path.exists(path):
            return path
    raise RuntimeError("no ml4 binary: set ML4_BIN")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    d = tempfile.mkdtemp(prefix="ml4-tp-")
    out = os.path.join(d, "ml4-tiny")
    subprocess.run([ml4_bin(), "make-model", "--preset", "ml4-tiny", "--seed", "3", "--out", out],
                   check=True, capture_output=True)
    return out


class MpiServer:
    def __init__(self, model, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="ml4-mpi-serve-", suffix=".log", delete=False)
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", ml4_bin(), "serve", "--model", model,
               "--served-model-name", "m", "--port", str(self.port), "--kv-cache-dtype", "bf16", "-tp", "2", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy: " + self.text())

    def text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def rank_pids(self):
        m = re.search(r"processes \(host:pid\):((?: \S+:\d+)+)", self.text())
        assert m, self.text()
        return [int(x.rsplit(":", 1)[1]) for x in m.group(1).split()]

    def stop(self, timeout=30):
        # The graceful stop is SIGTERM to rank 0: it drains, stops the workers, and every rank
        # and mpirun exit 0 (SIGTERM to mpirun also stops the job, but mpirun then exits 1).
        if self.proc.poll() is None:
            try:
                os.kill(self.rank_pids()[0], signal.SIGTERM)
            except (AssertionError, ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def complete(url, prompt_ids, max_tokens, stream=False, timeout=60, on_event=None):
    body = {"model": "m", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, "skip_special_tokens": False}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not stream:
            return json.loads(r.read())
        events = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if on_event:
                    on_event()
        return events


def generate_ids(model, prompt_ids, n, extra=()):
    # Against the single process, TP 2 on ml4-tiny agrees until an indexer near-tie flips
    # (tests/parallel/mpi/model_cases.cpp bounds the difference with the decisions forced).
    out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", ml4_bin(), "generate", "-tp", "2", "--model", model, "--prompt-ids", ",".join(map(str, prompt_ids)),
                          "--max-tokens", str(n), "--ignore-eos", "--kv-cache-dtype", "bf16", *extra],
                         check=True, capture_output=True, text=True)
    m = re.search(r"ids: ([\d,]+)", out.stdout + out.stderr)
    return [int(x) for x in m.group(1).split(",")]


# Each case also under decode context parallelism (issue 15): the KV sharded over the 2 ranks.
PARALLEL_ARGS = [pytest.param((), id="tp2"), pytest.param(("-dcp", "2"), id="tp2-dcp2"),
                 pytest.param(("-dcp", "2", "--dcp-comm-backend", "ag_rs", "--dcp-kv-cache-interleave-size", "4"),
                              id="tp2-dcp2-ag_rs")]


@pytest.mark.parametrize("extra", PARALLEL_ARGS)
def test_load_through_tp2_has_no_failure_and_matches_one_process(model_dir, extra):
    prompts = [[1 + (7 * i + 13 * k) % 500 for k in range(5 + 3 * i)] for i in range(24)]
    srv = MpiServer(model_dir, *extra)
    try:
        results, errors = {}, []

        def worker(i):
            try:
                results[i] = complete(srv.url, prompts[i], 12)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{i}: {e}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        elapsed = time.time() - t0
        assert not errors, errors
        assert len(results) == len(prompts)
        for i, r in results.items():
            assert r["usage"]["completion_tokens"] == 12, r
        print(f"tp2 {extra} load: {len(prompts)} requests x 12 tokens in {elapsed:.2f} s, no failure")
        # Greedy answers equal `ml4 generate -tp 2`'s: its ids, detokenized by the server, are
        # the text the server returned (special tokens kept).
        for i in (0, 5, 23):
            ids = generate_ids(model_dir, prompts[i], 12, extra)
            req = urllib.request.Request(srv.url + "/detokenize", data=json.dumps({"model": "m", "tokens": ids}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                text = json.loads(r.read())["prompt"]
            assert results[i]["choices"][0]["text"] == text, (i, ids)
    finally:
        rc = srv.stop()
    assert rc == 0, srv.text()[-3000:]
    assert "parallel group stopped" not in srv.text()


@pytest.mark.parametrize("extra", PARALLEL_ARGS[:2])
def test_killed_worker_stops_the_group_with_an_error(model_dir, extra):
    srv = MpiServer(model_dir, *extra)
    try:
        pids = srv.rank_pids()
        assert len(pids) == 2
        outcomes = []
        # The kill must land while every request is decoding. A fixed sleep (1.5 s) did that only
        # by timing: 6 x 400 tokens take ~5 s on 2 idle cores, so a faster or differently loaded
        # machine could finish them (finish_reason "length") or not have started them before the
        # kill. Now the kill comes once every stream has sent a token, and 1500 tokens each
        # (~50 s of decoding here) outlast the group's stop (~1 s after the kill) by far.
        decoding = [threading.Event() for _ in range(6)]

        def worker(i):
            try:
                ev = complete(srv.url, [3 + i, 5, 7, 11], 1500, stream=True, timeout=60, on_event=decoding[i].set)
                outcomes.append(("events", ev))
            except Exception as e:  # noqa: BLE001 - a closed connection is an acceptable failure
                outcomes.append(("error", repr(e)))
            finally:
                decoding[i].set()  # a request that ended early shows in outcomes below

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        for e in decoding:
            assert e.wait(max(0.0, deadline - time.time())), "a request sent no token within 120 s"
        assert not outcomes, outcomes  # all 6 still in flight: the kill lands mid-decode
        t_kill = time.time()
        os.kill(pids[1], signal.SIGKILL)
        srv.proc.wait(timeout=KILL_STOP_S + 20)
        stopped = time.time() - t_kill
        for t in threads:
            t.join(30)
        assert all(not t.is_alive() for t in threads), "a client hung"
        print(f"worker killed: group stopped in {stopped:.2f} s (mpirun rc {srv.proc.returncode})")
        assert stopped < KILL_STOP_S, srv.text()[-3000:]
        assert srv.proc.returncode != 0
        log = srv.text()
        assert re.search(rf"rank 1 \(pid {pids[1]} on \S+\) exited", log), log[-3000:]
        # No request finished normally: each ended with an error event or a closed connection.
        assert len(outcomes) == 6
        for kind, val in outcomes:
            if kind == "events":
                finished = [e for e in val if e.get("choices") and e["choices"][0].get("finish_reason") == "length"]
                assert not finished, val[-1]
    finally:
        srv.stop()
