#!/usr/bin/env python3
"""Per-kernel time of one profiled decode step, from ncu's CSV (issue 19's profile).

Made on the device by
  ML4_BENCH_NCU_STEP=1 ncu --profile-from-start off --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --print-units base --log-file step.csv \
      ml4 bench step --preset ml4-slice-4 --batch 1 --ctx 8192 --kv-gib 4
(one eager step between cudaProfilerStart / Stop; --cache-control none keeps the caches warm as
in a graph replay). Prints the kernels grouped by name, largest total first; with a second
CSV, both side by side (before / after).

  python3 bench/ncu_kernel_table.py step.csv [other.csv]
"""
import collections
import csv
import re
import sys


def load(path):
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    rows = []
    for d in csv.DictReader(lines):
        if d.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = d["Kernel Name"].replace("(anonymous namespace)::", "")
        name = re.sub(r"\(.*$", "", name)  # the parameter list
        name = re.sub(r"<float, 128.*", "", name)  # cuBLAS's long template arguments
        # Namespaces off (ncu spells the anonymous one "<unnamed>::" or "unnamed>::" by run).
        name = re.sub(r"^(void )?([\w<>]+::)*", "", name)
        rows.append((name, float(d["Metric Value"].replace(",", "")) / 1e3))
    return rows


def grouped(rows):
    g = collections.defaultdict(lambda: [0, 0.0])
    for name, us in rows:
        g[name][0] += 1
        g[name][1] += us
    return g


def main():
    runs = [load(p) for p in sys.argv[1:3]]
    groups = [grouped(r) for r in runs]
    for path, r in zip(sys.argv[1:3], runs):
        print(f"{path}: {len(r)} kernels, {sum(us for _, us in r):.1f} us")
    names = sorted(set().union(*groups), key=lambda k: -max(g.get(k, [0, 0.0])[1] for g in groups))
    for k in names:
        cells = "".join(f" {g.get(k, [0, 0.0])[0]:4d} x {g.get(k, [0, 0.0])[1]:8.1f} us" for g in groups)
        print(f"{k[:48]:48s}{cells}")


if __name__ == "__main__":
    main()
