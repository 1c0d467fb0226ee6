#!/usr/bin/env python3
"""On-policy data for the DSpark drafter (issue 13): the target's own continuations.

    python3 tools/train/gen_drafter_data.py --data DIR --out FILE \
        (--url http://HOST:PORT | --ml4 build/ml4 --model assets/ml4-small [--serve-arg=--device --serve-arg=cuda]) \
        [--n-seqs 512] [--prompt-len 256] [--gen-len 768] [--temperatures 0 1] [--concurrency 32]

Why: the drafter was distilled on corpus text, where the tokens that feed slots 2..B are the
corpus's; in the engine they are the target's own accepted tokens. A small target disagrees with
the corpus on about half the positions, so the drafter trained on corpus prefixes sees contexts
it never meets at inference (ML4-SMALL.md section 4: 1.68 acceptance on corpus anchors, 1.27-1.35
free running). Training on the target's continuations (EAGLE's and DFlash's self-distillation)
closes that gap; train.py --drafter-data reads this file.

Prompts are --prompt-len tokens at random offsets of DIR/train.tok.xz (prepare_data.py's stream);
each is continued by the target through ml4's OpenAI endpoint (/v1/completions with token-id
prompts, `return_token_ids`, `ignore_eos`), greedy and/or sampled (--temperatures, split evenly),
--concurrency requests in flight. With --ml4 the script starts `ml4 serve` on a free port and
stops it at the end.

Writes FILE (uint16 rows of prompt-len + gen-len tokens, row-major, LZMA-compressed) and
FILE.json (the row length, the prompt length, the count, each row's temperature and prompt index
(`row_index`: with --max-seconds only the rows finished in time are written), the model).
"""

import argparse
import concurrent.futures as cf
import json
import lzma
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_server(ml4, model, args):
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="gen-drafter-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([ml4, "serve", "--model", model, "--port", str(port), *args], stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"ml4 serve exited with {proc.returncode}; log: {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except Exception:
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"ml4 serve did not become healthy; log: {log.name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="prepare_data.py's output (train.tok.xz)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--url", default="", help="a running ml4 serve")
    ap.add_argument("--ml4", default="", help="start this ml4 binary's server instead")
    ap.add_argument("--model", default="", help="with --ml4: the model directory")
    ap.add_argument("--serve-arg", action="append", default=[], help="with --ml4: one more argument to ml4 serve")
    ap.add_argument("--n-seqs", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=768)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="stop sending after this long and write the rows finished by then (0: all rows)")
    a = ap.parse_args()
    if bool(a.url) == bool(a.ml4):
        sys.exit("give exactly one of --url and --ml4")
    if a.ml4 and not a.model:
        sys.exit("--ml4 needs --model")
    with open(os.path.join(a.data, "train.tok.xz"), "rb") as f:
        stream = np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16)
    rng = np.random.default_rng(a.seed)
    starts = rng.integers(0, len(stream) - a.prompt_len, size=a.n_seqs)
    temps = [a.temperatures[i % len(a.temperatures)] for i in range(a.n_seqs)]

    proc = None
    if a.ml4:
        proc, url = start_server(a.ml4, a.model, a.serve_arg)
    else:
        url = a.url.rstrip("/")
    try:
        model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
        L = a.prompt_len + a.gen_len

        def one(i):
            prompt = [int(t) for t in stream[starts[i]:starts[i] + a.prompt_len]]
            r = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": a.gen_len,
                                              "temperature": temps[i], "seed": a.seed * 1000003 + i,
                                              "ignore_eos": True, "return_token_ids": True}, a.timeout)
            c = r["choices"][0]
            got = list(c.get("prompt_token_ids") or prompt) + list(c["token_ids"])
            if got[:a.prompt_len] != prompt or len(got) != L:
                raise RuntimeError(f"row {i}: {len(got)} tokens back for {L} (prompt echoed "
                                   f"{got[:a.prompt_len] == prompt})")
            return i, got

        rows = np.zeros((a.n_seqs, L), dtype=np.uint16)
        finished = np.zeros(a.n_seqs, dtype=bool)
        t0, done = time.time(), 0
        ex = cf.ThreadPoolExecutor(a.concurrency)
        futures = [ex.submit(one, i) for i in range(a.n_seqs)]
        try:
            for fut in cf.as_completed(futures, timeout=a.max_seconds or None):
                i, got = fut.result()
                rows[i], finished[i] = got, True
                done += 1
                if done % max(1, a.n_seqs // 10) == 0:
                    el = time.time() - t0
                    print(f"{done}/{a.n_seqs} rows, {done * a.gen_len / el:.0f} generated tok/s", flush=True)
        except cf.TimeoutError:
            # --max-seconds: drop the rows not started, wait for those in flight (they finish
            # within --timeout) and keep every finished one; a failed request fails the run, as
            # without the limit.
            ex.shutdown(wait=True, cancel_futures=True)
            for i, fut in enumerate(futures):
                if not fut.cancelled() and not finished[i]:
                    rows[i], finished[i] = fut.result()[1], True
            print(f"--max-seconds {a.max_seconds:g}: {int(finished.sum())} of {a.n_seqs} rows finished", flush=True)
        ex.shutdown(wait=True)
        seconds = time.time() - t0
        kept = np.flatnonzero(finished)
        rows, temps = rows[kept], [temps[i] for i in kept]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    with open(a.out, "wb") as f:
        f.write(lzma.compress(rows.tobytes()))
    n = len(rows)
    meta = {"rows": n, "row_len": L, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
            "temperatures": temps, "row_index": [int(i) for i in kept], "model": model, "seconds": seconds,
            "generated_tok_s": n * a.gen_len / seconds}
    with open(a.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {a.out}: {n} rows of {L} tokens in {seconds:.1f} s "
          f"({meta['generated_tok_s']:.0f} generated tok/s)")


if __name__ == "__main__":
    main()
