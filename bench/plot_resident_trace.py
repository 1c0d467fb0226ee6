#!/usr/bin/env python3
# docs/resident-ffn-trace-h100.png: where the resident FFN kernel's time goes, layer by layer
# (issue 19). Input: the RESIDENT_TRACE lines of
#   ML4_RESIDENT_TRACE=1 ML4_LATENCY_DECODE=1 ML4_BENCH_NCU_STEP=B ml4 bench step --preset ml4-slice-4 \
#       --batch B --ctx 8192 --kv-gib 4
# (us from the first block's start; each point min..max over the kernel's blocks).
#   python3 bench/plot_resident_trace.py bench/data/resident-trace-h100/trace_b{1,4}.log docs/resident-ffn-trace-h100.png
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The points in order, and what runs between a point and the next one present (a dense layer
# has no routing, phase 2 or barrier 3: its phase 3 runs from barrier 2 to the end).
ORDER = ["start", "norm", "bar1", "phase1", "bar2", "routed", "phase2", "bar3", "end"]
WHAT = {"start": ("norm (block t)", "#999999"), "norm": ("barrier", "#dddddd"),
        "bar1": ("phase 1: router + shared/dense gate-up", "#4c72b0"), "phase1": ("barrier", "#dddddd"),
        "bar2": ("routing copied", "#999999"), "routed": ("phase 2: routed gate-up", "#55a868"),
        "phase2": ("barrier", "#dddddd"), "bar3": ("phase 3: down + combine", "#c44e52")}
PHASE3 = WHAT["bar3"]


def load(path):
    batch, layers = None, []
    for line in open(path):
        m = re.match(r"NCUSTEP .*batch=(\d+)", line)
        if m:
            batch = int(m.group(1))
        if line.startswith("RESIDENT_TRACE"):
            pts = {k: (float(a), float(b)) for k, a, b in re.findall(r"(\w+)=([\d.]+)\.\.([\d.]+)", line)}
            layers.append(pts)
    return batch, layers


def main():
    *logs, out = sys.argv[1:]
    fig, axes = plt.subplots(len(logs), 1, figsize=(10, 2.2 * len(logs)), squeeze=False)
    for ax, path in zip(axes[:, 0], logs):
        batch, layers = load(path)
        seen = set()
        for row, pts in enumerate(layers):
            present = [k for k in ORDER if k in pts]
            for k, nxt in zip(present, present[1:]):
                label, color = PHASE3 if nxt == "end" else WHAT[k]
                x0, x1 = pts[k][1], pts[nxt][1]
                ax.barh(row, x1 - x0, left=x0, color=color, edgecolor="white",
                        label=None if label in seen else label)
                seen.add(label)
            # the spread of every point over the blocks
            for k, (lo, hi) in pts.items():
                if k != "router":
                    ax.plot([lo, hi], [row + 0.42, row + 0.42], color="black", lw=1)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels([f"layer {i}" + (" (dense)" if "routed" not in p else "") for i, p in enumerate(layers)])
        ax.invert_yaxis()
        ax.set_xlabel("us from the kernel's first block start (black: min..max of each point over the blocks)")
        ax.set_title(f"ml4-slice-4 decode, batch {batch}: the resident FFN kernel per layer (H100)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
