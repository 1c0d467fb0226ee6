#!/usr/bin/env python3
"""Check of train.py --drafter-layers (export.grow_drafter): the shipped drafter loaded into a
drafter of more draft layers computes the same block logits, bit for bit, before any training
step (each added layer has zero output projections, so it adds exact zeros to the residual
stream); and the added layers do train (their output projections get non-zero gradients).

  python3 tools/train/check_grow_drafter.py [--model assets/ml4-small] [--layers 3] [--export DIR]

--export DIR writes the grown, untrained model there (the target's tensors verbatim, tekken.json
copied): served by ml4 with speculation it must draft exactly as the shipped model does.

Runs on the CPU in f32 in a few seconds (random token rows, fresh each run unless --seed).
Exit status 0 when both hold."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from export import dequantized_state, drafter_state, export, grow_drafter, load_into  # noqa: E402
from ml4_small import DSparkDrafter, Ml4Small  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "..", "assets", "ml4-small"))
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--export", default="", help="write the grown, untrained model to this directory")
    a = ap.parse_args()
    if a.seed is not None:
        torch.manual_seed(a.seed)
    p = json.load(open(os.path.join(a.model, "params.json")))
    state = dequantized_state(os.path.join(a.model, "consolidated.safetensors"))
    shipped_layers = p["mtp"]["n_layers"]
    assert a.layers > shipped_layers, f"--layers must exceed the file's {shipped_layers}"
    model = Ml4Small(p).eval()
    one = DSparkDrafter(p).eval()
    load_into(model, one, state)
    pg = json.loads(json.dumps(p))
    pg["mtp"]["n_layers"] = a.layers
    grown = DSparkDrafter(pg).eval()
    grow_drafter(grown, drafter_state(state))
    B, T, S = 2, 96, one.B - 1
    x = torch.randint(1, p["vocab_size"], (B, T))
    anchors = torch.randint(16, T - S, (B, 8))
    slot0 = torch.gather(x, 1, anchors)
    idx = anchors[:, :, None] + torch.arange(S)
    prev = torch.gather(x, 1, idx.view(B, -1)).view(B, -1, S)
    with torch.no_grad():
        out = model(x, sparse=True, hidden_layers=tuple(one.target_layers))
        ctx = one.context(out["hidden"])
        ref = one(model, ctx, anchors, slot0, prev)
        got = grown(model, grown.context(out["hidden"]), anchors, slot0, prev)
    same = torch.equal(ref, got)
    print(f"{shipped_layers} -> {a.layers} draft layers: block logits {list(ref.shape)} "
          f"{'bit-identical' if same else 'DIFFER, max |d| %.3g' % (ref - got).abs().max().item()}")
    lg = grown(model, grown.context({l: h.detach() for l, h in out["hidden"].items()}), anchors, slot0, prev)
    lg.float().logsumexp(-1).mean().backward()
    norms = [grown.layers[i].attention.wo.weight.grad.norm().item() for i in range(shipped_layers, a.layers)]
    trains = all(n > 0 for n in norms)
    print("added layers' wo gradient norms: " + ", ".join(f"{n:.3g}" for n in norms))
    if a.export:
        grown.zero_grad(set_to_none=True)
        export(model, grown, pg, os.path.join(a.model, "tekken.json"), a.export,
               target_file=os.path.join(a.model, "consolidated.safetensors"))
        print(f"wrote {a.export}")
    return 0 if same and trains else 1


if __name__ == "__main__":
    sys.exit(main())
