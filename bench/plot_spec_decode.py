#!/usr/bin/env python3
# The TPOT bars of docs/dspark-tpot.png from two summary.md tables of bench/spec_decode_cpu.sh
# (CPU run, H200 run):  python3 bench/plot_spec_decode.py CPU_SUMMARY H200_SUMMARY OUT.png
import re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
def load(path):
    rows = {}
    for line in open(path):
        if not line.startswith("| ") or line.startswith("| T "): continue
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        t, conc, cfg = int(c[0]), int(c[1]), c[2]
        tpot = float(c[4].split()[0])
        rows[(t, conc, cfg)] = tpot
    return rows
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for ax, (name, path) in zip(axes, [("CPU (2 cores)", sys.argv[1]), ("H200", sys.argv[2])]):
    r = load(path)
    labels, x = [], 0
    for t in (0, 1):
        for conc in (1, 8, 32):
            for i, (cfg, col) in enumerate([("plain", "#888888"), ("greedy7", "#1f77b4"), ("prob7", "#ff7f0e")]):
                v = r.get((t, conc, cfg))
                if v is None: continue
                ax.bar(x + i * 0.27, v, 0.27, color=col, label=cfg if (t, conc) == (0, 1) else None)
            labels.append((x + 0.27, f"T={t}\nc{conc}"))
            x += 1
    ax.set_xticks([p for p, _ in labels]); ax.set_xticklabels([l for _, l in labels])
    ax.set_yscale("log"); ax.set_ylabel("mean TPOT, ms (log)"); ax.set_title(f"ml4-small, DSpark vs plain decoding: {name}")
    ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=110)
