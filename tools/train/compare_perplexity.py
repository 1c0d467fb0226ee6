#!/usr/bin/env python3
"""`ml4 perplexity` per validation group against train.py's PyTorch evaluation.

    python3 tools/train/compare_perplexity.py --ml4 build/ml4 --model assets/ml4-small \
        --data build-h12/data --results tools/train/runs/run3/results.json [--device cpu] [--ctx 4096 --chunks 2]

Runs `ml4 perplexity --json --kv-cache-dtype bf16` on each val_<group>.txt (the file train.py
scored) and prints a markdown table: tokens, mean NLL and perplexity from both, their
difference, bits per byte. Exit status 1 when a group's token count differs (the two sides
did not score the same tokens) or the mean NLLs differ by more than --tol (nats/token).
"""

import argparse
import json
import os
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ml4", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--key", default="val_topk", help="results.json entry to compare with")
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--out", default="", help="also write the rows as JSON here")
    a = ap.parse_args()
    ref = json.load(open(a.results))[a.key]
    rows, ok = [], True
    print(f"| group | tokens | PyTorch NLL | ml4 {a.device} NLL | difference | PyTorch ppl | ml4 ppl | ml4 bits/byte | ml4 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for g in sorted(ref):
        cmd = [a.ml4, "perplexity", "--model", a.model, "--file", os.path.join(a.data, f"val_{g}.txt"), "--ctx",
               str(a.ctx), "--chunks", str(a.chunks), "--kv-cache-dtype", a.kv_cache_dtype, "--device", a.device,
               "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {g} | ml4 failed: {out.stderr.strip()[-200:]} |")
            ok = False
            continue
        m = json.loads(out.stdout.strip().splitlines()[-1])
        r = ref[g]
        d = m["mean_nll"] - r["mean_nll"]
        ok &= m["tokens"] == r["tokens"] and abs(d) <= a.tol
        rows.append({"group": g, "ml4": m, "pytorch": r, "nll_difference": d})
        print(f"| {g} | {m['tokens']} | {r['mean_nll']:.6f} | {m['mean_nll']:.6f} | {d:+.2e} | {r['ppl']:.3f} | "
              f"{m['ppl']:.3f} | {m['bits_per_byte']:.4f} | {m['seconds']:.1f} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
