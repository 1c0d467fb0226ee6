#!/usr/bin/env python3
"""Where a graphed decode step's time goes between kernels (issue 19's "lost time per kernel
boundary"), from bench/cupti_trace.cpp's CSV (the device machine has no Nsight Systems).

Made on the device by
  ML4_BENCH_TRACE_STEP=1 ML4_CUPTI_OUT=trace.csv LD_PRELOAD=libml4_cupti_trace.so \
      ml4 bench step --preset ml4-slice-4 --batch 1 --ctx 8192 --kv-gib 4
  python3 bench/step_timeline.py trace.csv [--csv one_step.csv]
(scripts/gpu_check_all.sh's timeline section does both.)

The step bench runs ten graphed steps between cudaProfilerStart / Stop. For each step (the GPU
work between one step's first and last activity; steps are told apart by the host's
cudaGraphLaunch calls) it measures:
  span    first start to last end on the GPU;
  busy    the union of the kernels', copies' and memsets' intervals (any stream);
  idle    span - busy: time in which nothing runs on the card, summed over the gaps;
  period  from one step's first GPU start to the next's: span + the host's part.
and prints the median step's kernels grouped by name, its largest gaps with the kernels on
either side, the gap count (the boundaries at which the card went idle), and the step split
three ways: weights streaming (a weight GEMV / GEMM running, --weights), other work only, idle,
with the longest stretches without a weight kernel and what ran in them. --csv writes that
step's activities (start and end in us from the step's start, stream, name) for
bench/plot_step_timeline.py.
"""
import argparse
import collections
import re
import statistics


def short(name):
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*$", "", name)
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"^(void )?([\w]+::)*", "", name)
    return name


def load(path):
    """bench/cupti_trace.cpp's CSV: the GPU activities of the runtime calls made between
    cudaProfilerStart and Stop, chosen by correlation id (the runtime calls' timestamps are the
    host's, the GPU's may be on another clock), and the graph launches among those calls."""
    import csv
    rows = list(csv.DictReader(open(path)))
    runtime = sorted((int(r["start_ns"]), int(r["end_ns"]), r["name"], int(r["correlation"])) for r in rows if r["kind"] == "R")
    starts = [s for s, e, n, c in runtime if n.startswith("cudaProfilerStart")]
    stops = [s for s, e, n, c in runtime if n.startswith("cudaProfilerStop")]
    lo = starts[-1] if starts else 0
    hi = stops[-1] if stops and (not starts or stops[-1] > lo) else float("inf")
    window = {c for s, e, n, c in runtime if lo <= s <= hi}
    acts = []
    for r in rows:
        if r["kind"] == "R" or int(r["correlation"]) not in window:
            continue
        acts.append((int(r["start_ns"]), int(r["end_ns"]), int(r["stream"]),
                     short(r["name"]) if r["kind"] == "K" else r["name"], int(r["correlation"])))
    launches = [(s, e, c) for s, e, n, c in runtime if n.startswith("cudaGraphLaunch") and lo <= s <= hi]
    acts.sort()
    calls = [(s, e, n, c) for s, e, n, c in runtime if lo <= s <= hi]
    return acts, launches, calls


def between_steps(acts, launches, calls, top):
    """What happens between two graphed steps: the host's runtime calls from one cudaGraphLaunch
    to the next (offsets from the first launch's start and durations, us, host clock), and the
    GPU's activities outside the graphs from one graph's last activity to the next one's first
    (offsets from that end, GPU clock): the sampling, the read-back, the metadata upload."""
    if len(launches) < 3:
        return
    graph_corr = {c for _, _, c in launches}
    by_corr = collections.defaultdict(list)
    for a in acts:
        by_corr[a[4]].append(a)
    i = len(launches) // 2
    (l0, _, c0), (l1, _, c1) = launches[i], launches[i + 1]
    print(f"\nbetween graph launches {i} and {i + 1}: host calls (us from launch {i}'s start; duration):")
    for s, e, n, c in calls:
        if l0 <= s <= l1:
            print(f"  {(s - l0) / 1e3:8.1f} {(e - s) / 1e3:7.1f}  {n[:60]}")
    if not by_corr.get(c0) or not by_corr.get(c1):
        return
    g_end = max(a[1] for a in by_corr[c0])
    g_next = min(a[0] for a in by_corr[c1])
    print(f"GPU between graph {i}'s end and graph {i + 1}'s start ({(g_next - g_end) / 1e3:.1f} us; us from the end; duration):")
    for s, e, st, n, c in acts:
        if c not in graph_corr and g_end <= s <= g_next:
            print(f"  {(s - g_end) / 1e3:8.1f} {(e - s) / 1e3:7.1f}  {n[:60]}")


def steps_of(acts, launches):
    """One step per graph launch: the kernels, copies and memsets of the graph (they carry the
    launch's correlation id). The step's input and result copies are the host's part (period -
    span below). Without graph launches, everything is one step."""
    if not launches:
        return [acts]
    by_corr = collections.defaultdict(list)
    for a in acts:
        by_corr[a[4]].append(a)
    return [by_corr[c] for s, e, c in launches if by_corr.get(c)]


def measure(step):
    span0 = min(a[0] for a in step)
    span1 = max(a[1] for a in step)
    busy, gaps = 0, []
    cur_s, cur_e, cur_name = None, None, None
    for s, e, st, n, c in sorted(step):
        if cur_e is None:
            cur_s, cur_e, cur_name = s, e, n
            continue
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_name, n))
            cur_s, cur_e, cur_name = s, e, n
        elif e > cur_e:
            cur_e, cur_name = e, n
    busy += cur_e - cur_s
    return span0, span1, busy, gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="bench/cupti_trace.cpp's CSV")
    ap.add_argument("--csv", help="write the median step's activities here")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--weights", default=r"gemv|gemm|Gemm|xmma|ffn_resident|absorb|apply_uv",
                    help="regex of the kernels that stream weights (reductions excluded)")
    args = ap.parse_args()
    acts, launches, calls = load(args.trace)
    if not acts:  # say what the file holds instead of failing on an empty step
        import csv
        kinds = collections.defaultdict(list)
        for r in csv.DictReader(open(args.trace)):
            kinds[r["kind"]].append((int(r["start_ns"]), r["name"]))
        print("no GPU activity between cudaProfilerStart and Stop; the file holds:")
        for k, v in sorted(kinds.items()):
            print(f"  kind {k}: {len(v)} rows, start {min(v)[0]} .. {max(v)[0]}")
        for k, v in kinds.items():
            if k == "R":
                for t, n in v:
                    if "Profiler" in n:
                        print(f"  {n} at {t}")
        raise SystemExit(1)
    steps = steps_of(acts, launches)
    rows = []
    for i, st in enumerate(steps):
        s0, s1, busy, gaps = measure(st)
        nxt = min(a[0] for a in steps[i + 1]) if i + 1 < len(steps) else None
        rows.append((s0, s1, busy, gaps, nxt, st))
    print(f"steps: {len(steps)} ({len(launches)} graph launches, {len(acts)} GPU activities)")
    spans = [(r[1] - r[0]) / 1e3 for r in rows]
    busys = [r[2] / 1e3 for r in rows]
    periods = [(r[4] - r[0]) / 1e3 for r in rows if r[4] is not None]
    print("step  span_us  busy_us  idle_us  gaps  idle_per_gap_us  activities  period_us")
    for i, (s0, s1, busy, gaps, nxt, st) in enumerate(rows):
        idle = (s1 - s0 - busy) / 1e3
        per = (nxt - s0) / 1e3 if nxt is not None else float("nan")
        print(f"{i:4d} {(s1 - s0) / 1e3:8.1f} {busy / 1e3:8.1f} {idle:8.1f} {len(gaps):5d} "
              f"{idle / max(len(gaps), 1):16.2f} {len(st):11d} {per:10.1f}")
    med_span = statistics.median(spans)
    print(f"median: span {med_span:.1f} us, busy {statistics.median(busys):.1f} us, idle "
          f"{statistics.median([a - b for a, b in zip(spans, busys)]):.1f} us"
          + (f", period {statistics.median(periods):.1f} us (host part {statistics.median(periods) - med_span:.1f})"
             if periods else ""))
    # The median step (by span) in detail.
    k = sorted(range(len(rows)), key=lambda i: (rows[i][1] - rows[i][0]))[len(rows) // 2]
    s0, s1, busy, gaps, nxt, st = rows[k]
    print(f"\nstep {k} by kernel name (us; 'sum' over the step's launches, concurrent ones counted each):")
    g = collections.defaultdict(lambda: [0, 0.0])
    for s, e, stream, n, c in st:
        g[n][0] += 1
        g[n][1] += (e - s) / 1e3
    total = sum(v[1] for v in g.values())
    print(f"{'kernel':48s} {'count':>5s} {'sum_us':>8s} {'mean_us':>8s}")
    for n, (cnt, us) in sorted(g.items(), key=lambda kv: -kv[1][1]):
        print(f"{n[:48]:48s} {cnt:5d} {us:8.1f} {us / cnt:8.2f}")
    print(f"{'(all)':48s} {len(st):5d} {total:8.1f}")
    hist = collections.Counter()
    for d, a, b in gaps:
        us = d / 1e3
        hist["<1" if us < 1 else "1-2" if us < 2 else "2-4" if us < 4 else "4-8" if us < 8 else ">=8"] += 1
    print(f"\nstep {k} gaps (card idle): {len(gaps)}, {sum(d for d, _, _ in gaps) / 1e3:.1f} us; by length (us): "
          + ", ".join(f"{b}: {hist[b]}" for b in ["<1", "1-2", "2-4", "4-8", ">=8"]))
    print(f"largest {args.top}:")
    for d, a, b in sorted(gaps, reverse=True)[:args.top]:
        print(f"  {d / 1e3:7.2f} us  {a[:40]:40s} -> {b[:40]}")
    # Three-way split of the median step: weights streaming (any weight kernel running), busy
    # with other work only, idle; and the longest stretches without a weight kernel, with what
    # ran in them (the serial small-kernel chains between the weight streams).
    wre = re.compile(args.weights)
    is_w = [bool(wre.search(n)) and "reduce" not in n for _, _, _, n, _ in st]
    wiv = sorted((s, e) for (s, e, _, _, _), w in zip(st, is_w) if w)
    merged = []
    for s, e in wiv:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    wbusy = sum(e - s for s, e in merged)
    span = s1 - s0
    print(f"\nstep {k}: weights streaming {wbusy / 1e3:.1f} us, other work only {(busy - wbusy) / 1e3:.1f} us, "
          f"idle {(span - busy) / 1e3:.1f} us (of {span / 1e3:.1f}; weight kernels /{args.weights}/)")
    holes, prev = [], s0
    for s, e in merged + [[s1, s1]]:
        if s > prev:
            holes.append((s - prev, prev, s))
        prev = max(prev, e)
    print(f"longest stretches without a weight kernel ({len(holes)}, {sum(h[0] for h in holes) / 1e3:.1f} us):")
    for d, a, b in sorted(holes, reverse=True)[:args.top]:
        inside = [n for s, e, _, n, _ in st if s < b and e > a]
        print(f"  {d / 1e3:7.2f} us at {(a - s0) / 1e3:7.1f}: {', '.join(x[:28] for x in inside[:8])}"
              + (" ..." if len(inside) > 8 else ""))
    between_steps(acts, launches, calls, args.top)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("start_us,end_us,stream,name\n")
            for s, e, stream, n, c in sorted(st):
                f.write(f"{(s - s0) / 1e3:.3f},{(e - s0) / 1e3:.3f},{stream},{n}\n")


if __name__ == "__main__":
    main()
