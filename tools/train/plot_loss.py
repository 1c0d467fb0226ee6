#!/usr/bin/env python3
"""Plots the training curves of tools/train/runs/*/train_log.jsonl into docs/ml4-small-loss.png.

    python3 tools/train/plot_loss.py [--runs tools/train/runs/run1 tools/train/runs/run2] [--out docs/ml4-small-loss.png]

Runs are concatenated in the order given (a resumed run continues the token axis of the one
before). Left: target training cross-entropy (nats/token) over training tokens, the dense
warm-up, sparse and QAT stretches marked; middle: the indexer's KL to the attention
distribution; right: the drafter's distillation loss over its steps.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=[os.path.join(here, "runs", r) for r in ("run1", "run2")])
    ap.add_argument("--out", default=os.path.join(here, "..", "..", "docs", "ml4-small-loss.png"))
    a = ap.parse_args()
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    off = 0
    for i, run in enumerate(a.runs):
        rows = [json.loads(l) for l in open(os.path.join(run, "train_log.jsonl"))]
        tr = [r for r in rows if r.get("phase") == "target"]
        name = os.path.basename(run.rstrip("/"))
        for mode, style in (("dense", "o-"), ("sparse", ".-"), ("qat", "s-")):
            sel = [r for r in tr if (mode == "qat" and r["qat"]) or (mode == "sparse" and r["sparse"] and not r["qat"])
                   or (mode == "dense" and not r["sparse"])]
            if sel:
                x = [(off + r["tokens"]) / 1e6 for r in sel]
                ax[0].plot(x, [r["ce"] for r in sel], style, ms=3, label=f"{name} {mode}")
                ax[1].plot(x, [r["kl"] for r in sel], style, ms=3, label=f"{name} {mode}")
        dr = [r for r in rows if r.get("phase") == "drafter"]
        if dr:
            ax[2].plot([r["step"] for r in dr], [r["loss"] for r in dr], ".-", label=f"{name}")
        done = [r for r in rows if r.get("phase") == "target_done"]
        if done:
            off += done[-1]["tokens"]
    ax[0].set(xlabel="training tokens (M)", ylabel="cross-entropy (nats/token)", title="ml4-small target")
    ax[1].set(xlabel="training tokens (M)", ylabel="KL(attention || indexer), per owner layer", title="DSA indexer")
    ax[2].set(xlabel="drafter step", ylabel="soft cross-entropy to the target", title="DSpark drafter (block 8)")
    for x in ax:
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=90)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
