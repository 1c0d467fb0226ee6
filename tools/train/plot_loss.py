#!/usr/bin/env python3
"""Plots the training curves of a run into docs/ml4-small-loss.png.

    python3 tools/train/plot_loss.py [--run tools/train/runs/run3] [--out docs/ml4-small-loss.png]

Reads RUN/train_log.jsonl (train.py's target phase, its periodic probes and the first drafter
phase) and, if present, RUN/drafter_train_log.jsonl (a drafter-only run resumed from the first
one, train.py --target-from). Panels: (1) the target's training cross-entropy (all tokens and
text-only) and the probes' validation NLL (mean of the eight groups' first 1,024 tokens) over
training tokens, the dense warm-up / sparse / 4k / QAT stretches shaded; (2) passkey: the
training loss on the six answer tokens and the probes' retrieval accuracy at 1k and 4k; (3) the
indexer's KL to the attention distribution; (4) the drafter's distillation loss over its steps.
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows_of(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=os.path.join(here, "runs", "run3"))
    ap.add_argument("--out", default=os.path.join(here, "..", "..", "docs", "ml4-small-loss.png"))
    a = ap.parse_args()
    rows = rows_of(os.path.join(a.run, "train_log.jsonl"))
    tr = [r for r in rows if r.get("phase") == "target"]
    ev = [r for r in rows if r.get("phase") == "eval"]
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.4))
    M = 1e6

    def shade(x):
        first = {}
        for r in tr:
            key = "dense" if not r["sparse"] else ("qat" if r["qat"] else ("4k" if r.get("seq", 0) > 1024 else "sparse"))
            first.setdefault(key, r["tokens"] / M)
        end = tr[-1]["tokens"] / M
        bounds = sorted(first.items(), key=lambda kv: kv[1])
        colors = {"dense": "#e8e8ff", "sparse": "#ffffff", "4k": "#fff2dd", "qat": "#ffe0e0"}
        for i, (k, s) in enumerate(bounds):
            e = bounds[i + 1][1] if i + 1 < len(bounds) else end
            x.axvspan(s, e, color=colors[k], alpha=0.8, lw=0, label=f"{k}" if k != "sparse" else None)

    shade(ax[0])
    ax[0].plot([r["tokens"] / M for r in tr], [r["ce"] for r in tr], ".-", ms=2, lw=0.8, label="train CE (weighted, all)")
    ax[0].plot([r["tokens"] / M for r in tr], [r["text_ce"] for r in tr], ".-", ms=2, lw=0.8, label="train CE, text sequences")
    ax[0].plot([r["tokens"] / M for r in ev], [r["val_mean"] for r in ev], "o-", ms=3, label="validation NLL (probe)")
    ax[0].set(xlabel="training tokens (M)", ylabel="nats/token", title="ml4-small target", ylim=(2, 9.5))
    shade(ax[1])
    ax[1].plot([r["tokens"] / M for r in tr], [r["passkey_answer_ce"] for r in tr], ".-", ms=2, lw=0.8,
               label="answer CE (train)")
    axb = ax[1].twinx()
    for L, st in ((1024, "o-"), (4096, "s-")):
        pts = [(r["tokens"] / M, r[f"passkey_{L}"]) for r in ev if f"passkey_{L}" in r]
        if pts:
            axb.plot(*zip(*pts), st, ms=3, color="C2" if L == 1024 else "C3", label=f"probe accuracy {L}")
    axb.set(ylabel="retrieval accuracy (16 probes)", ylim=(-0.02, 1.02))
    axb.legend(fontsize=7, loc="center right")
    ax[1].set(xlabel="training tokens (M)", ylabel="nats/token", title="passkey (25% of sequences)")
    shade(ax[2])
    ax[2].plot([r["tokens"] / M for r in tr], [r["kl"] for r in tr], ".-", ms=2, lw=0.8, color="C4")
    ax[2].set(xlabel="training tokens (M)", ylabel="KL(attention || indexer), per owner",
              title="DSA indexer (every causal key)")
    off = 0
    for name, path in (("run3 (40 s)", "train_log.jsonl"), ("run3 drafter (160 s, resumed; slot-weighted)", "drafter_train_log.jsonl")):
        dr = [r for r in rows_of(os.path.join(a.run, path)) if r.get("phase") == "drafter"]
        if dr:
            ax[3].plot([off + r["step"] for r in dr], [r["loss"] for r in dr], ".-", label=name)
            off += dr[-1]["step"]
    ax[3].set(xlabel="drafter step", ylabel="soft cross-entropy to the target", title="DSpark drafter (block 8)")
    for x in ax:
        x.grid(alpha=0.3)
        x.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=80)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
