#!/usr/bin/env python3
"""Golden of the DSpark drafter forward (MODEL.md section 5) on the shipped ml4-small.

    python3 tools/reference/make_drafter_golden.py [--model assets/ml4-small] [--out DIR]

The drafter is the one ml4-small's drafter was trained as (tools/train/ml4_small.py
DSparkDrafter, loaded from the exported checkpoint by tools/train/export.py), run in float64
over the target's hidden states (Ml4Small, float64, with ml4's indexer FP8 and bf16 latent cache
emulated, so that its sparse selections match the engine's). For each case (a prompt of n random
tokens, the anchor token at position n): the greedy drafts of one block and, for every slot, the
drafter's distribution softmax(base + markov bias) along that greedy chain. Written as
DIR/golden.safetensors + DIR/manifest.json; tests/runtime/drafter_golden_test.cpp checks the CPU
runner's ModelRunner::draft() against it.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "ml4-small"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "golden", "ml4-small-drafter"))
    ap.add_argument("--lengths", type=int, nargs="*", default=[24, 300])
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    from export import dequantized_state, load_into
    from ml4_small import DSparkDrafter, Ml4Small

    with open(os.path.join(a.model, "params.json")) as f:
        p = json.load(f)
    m = Ml4Small(p)
    d = DSparkDrafter(p)
    load_into(m, d, dequantized_state(os.path.join(a.model, "consolidated.safetensors")))
    m = m.to(torch.float64).eval()
    d = d.to(torch.float64).eval()
    d.markov.cell.float()  # the GRU runs in f32, as trained (DSparkDrafter.draft)
    g = torch.Generator().manual_seed(a.seed)
    tensors = {}
    cases = []
    for ci, n in enumerate(a.lengths):
        tokens = torch.randint(0, p["vocab_size"], (n + 1,), generator=g)
        with torch.no_grad():
            out = m(tokens[None, :n], sparse=True, hidden_layers=tuple(d.target_layers), fp8_indexer=True,
                    bf16_latent=True)
            ctx = d.context(out["hidden"])
            anchors = torch.tensor([[n]])
            slot0 = tokens[None, n:n + 1]
            toks, q = d.draft(m, ctx, anchors, slot0, greedy=True)
        tensors[f"case{ci}.prompt"] = tokens[:n].to(torch.int32).contiguous()
        tensors[f"case{ci}.anchor"] = tokens[n:n + 1].to(torch.int32).contiguous()
        tensors[f"case{ci}.drafts"] = toks[0, 0].to(torch.int32).contiguous()
        tensors[f"case{ci}.probs"] = q[0, 0].to(torch.float32).contiguous()  # [B-1, V]
        top2 = q[0, 0].topk(2, -1).values
        cases.append({"n": n, "anchor_pos": n, "min_top2_margin": float((top2[:, 0] - top2[:, 1]).min())})
    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "golden.safetensors"))
    h = hashlib.sha256(open(os.path.join(a.model, "consolidated.safetensors"), "rb").read()).hexdigest()
    manifest = {"model": os.path.relpath(a.model, ROOT), "model_sha256": h, "seed": a.seed, "cases": cases,
                "command": "python3 tools/reference/make_drafter_golden.py",
                "versions": {"torch": torch.__version__},
                "numerics": "float64; target with ml4's FP8 indexer and bf16 latent cache emulated; drafter context "
                            "and block K/V not rounded (ml4 stores them in bf16: the test's bound covers it)"}
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps(cases))


if __name__ == "__main__":
    main()
