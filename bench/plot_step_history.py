# The batch-1 decode step of ml4-slice-4 (8k context, graphs) across sessions, H100, against the
# card's copy roofline and the 1.15x target, and batch 2 where it was measured (figures from
# docs/BENCHMARKS.md / STATUS.md S17).
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
sessions = [12, 14, 19, 21, 22, 23, 24, 25, 26, 27, 28]
ms = [1.98, 1.90, 1.901, 1.92, 1.810, 1.782, 1.756, 1.730, 1.737, 1.739, 1.664]
sessions2 = [23, 24, 25, 26, 27, 28]
ms2 = [2.662, 2.604, 2.586, 2.305, 2.226, 2.181]
roof = 1.427
fig, ax = plt.subplots(figsize=(7, 4.2))
ax.plot(sessions, ms, "o-", label="batch-1 step (H100)")
ax.plot(sessions2, ms2, "s-", color="tab:green", label="batch-2 step (H100)")
ax.axhline(roof, color="k", lw=1, label="HBM copy roofline (1.427 ms)")
ax.axhline(roof * 1.15, color="r", ls="--", lw=1, label="issue 19 target 1.15x (1.64 ms)")
for s, m in zip(sessions, ms):
    ax.annotate(f"{m / roof:.2f}x", (s, m), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
ax.set_xlabel("session")
ax.set_ylabel("ms")
ax.set_ylim(1.3, 2.8)
ax.set_title("ml4-slice-4 decode step, ctx 8192 (H100)")
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
fig.savefig("docs/decode-step-history-h100.png", dpi=110)
