#!/usr/bin/env python3
"""Encode throughput of ml4's tokenizer vs mistral-common and tiktoken, same text, same run.

    /tmp/tokvenv/bin/python tools/tokenizer/bench_reference.py \
        --tekken tests/golden/tokenizer/tekken_240911.json --bench build-tok/tokenizer_bench

The text (~16 MB) is Python standard-library source and documentation strings plus the
multilingual golden corpus, written to --text; it is not committed. Reported: best of
--repeats single-threaded encodes for each engine (mistral-common's Tekkenizer.encode calls
tiktoken's encode; tiktoken's encode_ordinary is timed directly too), and tiktoken's
encode_ordinary_batch over line slices with all cores against ml4's threaded figure.
"""
import argparse
import base64
import hashlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time

import mistral_common
import tiktoken
from mistral_common.tokens.tokenizers.tekken import Tekkenizer


def build_text(path, target_mb):
    parts = []
    size = 0
    golden = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "golden", "tokenizer", "encode_golden.json")
    multi = "\n".join(base64.b64decode(c["bytes_b64"]).decode("utf-8", "replace")
                      for c in json.load(open(golden))["encode"])
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, _, files in sorted(os.walk(stdlib)):
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            try:
                s = open(os.path.join(root, fn), encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            parts.append(s)
            size += len(s.encode())
            if len(parts) % 20 == 0:
                parts.append(multi)
                size += len(multi.encode())
            if size > target_mb * 1e6:
                break
        if size > target_mb * 1e6:
            break
    text = "\n".join(parts)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return text


def best_of(n, fn):
    best = 1e30
    out = None
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tekken", required=True)
    ap.add_argument("--bench", required=True, help="the tokenizer_bench binary")
    ap.add_argument("--text", default="/tmp/ml4_tokenizer_bench.txt")
    ap.add_argument("--mb", type=float, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    text = build_text(args.text, args.mb)
    data = text.encode()
    mb = len(data) / 1e6
    tok = Tekkenizer.from_file(args.tekken)
    t_mc, ids = best_of(args.repeats, lambda: tok.encode(text, bos=False, eos=False))
    t_tt, _ = best_of(args.repeats, lambda: tok._model.encode_ordinary(text))
    # One slice per core, cut at line ends, as tokenizer_bench does for ml4.
    threads = os.cpu_count()
    slices, begin = [], 0
    for i in range(1, threads + 1):
        end = len(text) if i == threads else text.find("\n", len(text) * i // threads)
        end = len(text) if end < 0 else end
        slices.append(text[begin:end])
        begin = end
    t_batch, _ = best_of(args.repeats, lambda: tok._model.encode_ordinary_batch(slices, num_threads=threads))
    ml4 = json.loads(subprocess.run([args.bench, args.tekken, args.text, str(args.repeats)], check=True,
                                    capture_output=True, text=True).stdout)
    fnv = 1469598103934665603
    for i in ids:
        fnv = ((fnv ^ i) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".strip(),
        "text_mb": round(mb, 2), "text_sha256": hashlib.sha256(data).hexdigest()[:16],
        "tokens_ml4": ml4["tokens"], "tokens_mistral_common": len(ids), "same_ids": ml4["ids_fnv"] == f"{fnv:016x}",
        "ml4_encode_mb_s": ml4["encode_mb_s"], "mistral_common_encode_mb_s": round(mb / t_mc, 2),
        "tiktoken_encode_ordinary_mb_s": round(mb / t_tt, 2),
        "ml4_parallel_mb_s": ml4["encode_parallel_mb_s"], "tiktoken_batch_mb_s": round(mb / t_batch, 2),
        "threads": threads, "ml4_decode_mb_s": ml4["decode_mb_s"], "ml4_load_s": ml4["load_s"],
        "versions": {"mistral_common": mistral_common.__version__, "tiktoken": tiktoken.__version__,
                     "python": sys.version.split()[0]},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
