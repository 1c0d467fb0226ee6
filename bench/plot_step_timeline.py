#!/usr/bin/env python3
"""One decode step's GPU timeline, a lane per stream, from bench/step_timeline.py --csv.

  python3 bench/plot_step_timeline.py one_step.csv out.png [--title T] [--other b.csv --title-other T2]

Kernels are coloured by kind (weight GEMVs, attention, indexer, MoE, norms and small row work,
sampling, copies); the card's idle gaps show as white columns through every lane. With --other,
two steps (before / after) one above the other on the same time axis.
"""
import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = [  # (label, colour, substrings of the kernel name)
    ("weight GEMV / GEMM", "#1f77b4", ("gemv", "gemm", "Gemm", "sm90_xmma", "cutlass", "splitK", "stream_rows")),
    ("MoE", "#ff7f0e", ("moe", "expert", "combine", "route")),
    ("attention", "#2ca02c", ("mla", "attention", "absorb", "q_path")),
    ("indexer / top-k", "#9467bd", ("indexer", "topk", "hadamard")),
    ("sampling", "#8c564b", ("sample", "argmax", "softmax", "draw")),
    ("copies", "#7f7f7f", ("memcpy", "memset")),
    ("norms, RoPE, cache writes, other", "#e377c2", ("",)),
]


def kind(name):
    for i, (_, _, keys) in enumerate(KINDS):
        if any(k in name for k in keys):
            return i
    return len(KINDS) - 1


def load(path):
    with open(path) as f:
        return [(float(r["start_us"]), float(r["end_us"]), int(r["stream"]), r["name"]) for r in csv.DictReader(f)]


def draw(ax, rows, title):
    streams = sorted({r[2] for r in rows}, key=lambda s: -sum(e - b for b, e, st, _ in rows if st == s))
    lane = {s: i for i, s in enumerate(streams)}
    for b, e, s, n in rows:
        ax.barh(lane[s], e - b, left=b, height=0.8, color=KINDS[kind(n)][1], edgecolor="none")
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" for s in streams])
    ax.invert_yaxis()
    span = max(e for _, e, _, _ in rows)
    ax.set_title(f"{title}: {span:.0f} us span, {len(rows)} activities")
    ax.set_xlim(0, span)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("png")
    ap.add_argument("--title", default="decode step")
    ap.add_argument("--other")
    ap.add_argument("--title-other", default="after")
    args = ap.parse_args()
    sets = [(load(args.csv), args.title)]
    if args.other:
        sets.append((load(args.other), args.title_other))
    span = max(max(e for _, e, _, _ in r) for r, _ in sets)
    fig, axes = plt.subplots(len(sets), 1, figsize=(16, 2.2 + 1.2 * len(sets) * 2), squeeze=False)
    for ax, (rows, title) in zip(axes[:, 0], sets):
        draw(ax, rows, title)
        ax.set_xlim(0, span)
    axes[-1, 0].set_xlabel("us from the step's first GPU activity")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c, _ in KINDS]
    fig.legend(handles, [k for k, _, _ in KINDS], loc="lower center", ncol=len(KINDS), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
