#!/usr/bin/env python3
"""Checks the training model against the float64 reference on an exported checkpoint.

    python3 tools/train/check_reference.py --model DIR [--lengths 40 300] [--seed 0]

Loads DIR (params.json + consolidated.safetensors, FP8 blocks decoded) twice: into
tools/reference/ml4_model.py's Ml4Reference (transformers modules, float64, no cache or
indexer emulation) and into tools/train/ml4_small.py's Ml4Small (the model that was trained),
cast to float64, and compares the logits of random token sequences, one longer than the
indexer top-k so that the sparse selection bites. Both run the same maths in float64 (the
reference's rotary cos/sin are f32 as transformers computes them, as are the trainer's), so
the relative L2 difference must sit at float64 rounding far below 1e-6 unless the two
definitions differ; the indexer top-k sets must be identical.
Exit status 0 when they agree.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "reference"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="*", default=[40, 300])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-9)
    a = ap.parse_args()
    from export import dequantized_state, load_into
    from ml4_model import Ml4Reference
    from ml4_small import Ml4Small

    with open(os.path.join(a.model, "params.json")) as f:
        p = json.load(f)
    ref = Ml4Reference(a.model, bf16_cache=False, fp8_indexer=False)
    m = Ml4Small(p)
    load_into(m, None, dequantized_state(os.path.join(a.model, "consolidated.safetensors")))
    m = m.to(torch.float64).eval()
    g = torch.Generator().manual_seed(a.seed)
    worst = 0.0
    ok = True
    for n in a.lengths:
        tokens = torch.randint(0, p["vocab_size"], (n,), generator=g)
        lr = ref.logits(tokens.tolist())
        rec = {}
        with torch.no_grad():
            lm = m(tokens[None], sparse=True, record=rec)["logits"][0]
        rel = float((lm - lr).norm() / lr.norm())
        worst = max(worst, rel)
        topk = p.get("indexer", {}).get("topk", 0)
        diff_rows = 0
        for l, idx in rec.items():
            sel_ref, _ = ref.record[l]
            for t in range(n):
                k = min(topk, t + 1)
                if set(idx[0, t, :k].tolist()) != set(sel_ref[t, :k].tolist()):
                    diff_rows += 1
        print(f"length {n}: rel L2 {rel:.3e}, max abs {float((lm - lr).abs().max()):.3e}, "
              f"top-k rows differing {diff_rows}, argmax rows differing {int((lm.argmax(-1) != lr.argmax(-1)).sum())}")
        ok &= rel < a.tol and diff_rows == 0
    print("OK" if ok else "MISMATCH", f"(worst rel L2 {worst:.3e}, bound {a.tol:g})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
