#!/usr/bin/env python3
# docs/fp4-decode-h100.png: ml4-slice-4 decode step (ctx 8192) with FP8, NVFP4 and MXFP4 routed
# experts, from the step bench's STEP / FP4PARTS lines (ml4 bench step --experts F --no-extras
# --ctx 8192; docs/BENCHMARKS.md "Sixth session"). Reads the three logs given.
#   python3 bench/plot_fp4_decode.py bench/data/fp4-decode-h100/step_{fp8,nvfp4,mxfp4}.log docs/fp4-decode-h100.png
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def step_ms(path):
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"STEP batch=(\d+) ctx=8192 ms=([\d.]+)", open(path).read())}


def parts(path):
    out = {}
    for m in re.finditer(r"FP4PARTS experts=\w+ batch=(\d+) ctx=8192 stream_ms=([\d.]+) parts1_ms=([\d.]+)",
                         open(path).read()):
        out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


fp8 = step_ms(sys.argv[1])
nv, mx = parts(sys.argv[2]), parts(sys.argv[3])
batches = sorted(b for b in nv if b in fp8 and b in mx)
series = [("FP8 experts", [fp8[b] for b in batches]),
          ("NVFP4, CUDA-core stream", [nv[b][0] for b in batches]),
          ("NVFP4, tensor cores (x bf16)", [nv[b][1] for b in batches]),
          ("MXFP4, CUDA-core stream", [mx[b][0] for b in batches]),
          ("MXFP4, tensor cores (x bf16)", [mx[b][1] for b in batches])]
fig, ax = plt.subplots(figsize=(8, 4))
w = 0.16
for k, (name, v) in enumerate(series):
    xs = [i + (k - 2) * w for i in range(len(batches))]
    ax.bar(xs, v, w, label=name)
    for x, y in zip(xs, v):
        ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=6)
ax.set_xticks(range(len(batches)))
ax.set_xticklabels([f"batch {b}" for b in batches])
ax.set_ylabel("decode step, ms (lower is better)")
ax.set_title("ml4-slice-4 decode step, ctx 8192, H100: routed experts FP8 vs FP4")
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(sys.argv[4], dpi=120)
