#!/usr/bin/env bash
# DSpark speculative decoding on the CPU (issue 13; results in docs/BENCHMARKS.md "Speculative
# decoding"): `ml4 bench serve` against `ml4 serve --model assets/ml4-small`, without drafts
# (the peer: the same engine and runner decoding one token per step) and with
# --speculative-config, both draft methods, temperature 0 and 1, at concurrency 1, 8 and 32.
#
#   bench/spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]      (default NUM_SPEC: 7)
#
# One server per configuration, all started first; then ROUNDS rounds (ML4_SPEC_ROUNDS, default
# 2) run every (temperature, concurrency, configuration) in turn, so that the configurations
# compared in a row saw the same background load (the machine is shared). Random prompts of 128
# tokens, 128 output tokens (ignore_eos), 2 warm-up requests per run; the acceptance figures
# are /metrics deltas over each run's measured requests. Writes
# OUT_DIR/<config>_t<T>_c<C>_r<R>.json (bench serve's JSON, with its spec_decode block) and
# OUT_DIR/summary.md (per row the median over rounds and the range).
# ML4_SPEC_SERVE_ARGS adds serve flags (on the H200: "--device cuda --kv-cache-memory-bytes N",
# one budget per server since all of them share the card); BUILD_DIR is any folder holding ml4.
# ML4_SPEC_DATASET: a bench serve JSONL of text prompts instead of random tokens (e.g.
# bench/data/ml4-small-val-prompts.jsonl: held-out corpus text, bench/make_text_prompts.py);
# ML4_SPEC_CONCURRENCY (default "1 8 32") and ML4_SPEC_TEMPS (default "0 1") narrow the grid;
# ML4_SPEC_BENCH_ARGS adds bench serve flags to every run (e.g. "--top-p 0.9"); ML4_SPEC_MODEL
# serves another model folder (e.g. ml4-small with a retrained drafter).
set -euo pipefail
build=$(cd "${1:?usage: spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]}" && pwd)
out=${2:?usage: spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]}
shift 2
specs=("${@:-7}")
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
ml4="$build/ml4"
model=${ML4_SPEC_MODEL:-$root/assets/ml4-small}
rounds=${ML4_SPEC_ROUNDS:-2}

configs=("plain|")
for n in "${specs[@]}"; do
  # At temperature 0 both draft methods draft greedily: the greedy/prob rows of T = 0 are the
  # same code, a measure of the noise. ML4_SPEC_GREEDY=first: greedy drafts for the first
  # NUM_SPEC only.
  [ "${ML4_SPEC_GREEDY:-all}" = first ] && [ "$n" != "${specs[0]}" ] || \
  configs+=("greedy$n|{\"method\":\"dspark\",\"num_speculative_tokens\":$n,\"draft_sample_method\":\"greedy\"}")
  configs+=("prob$n|{\"method\":\"dspark\",\"num_speculative_tokens\":$n,\"draft_sample_method\":\"probabilistic\"}")
done

dataset_args=(--input-len 128)
read -r -a bench_extra <<< "${ML4_SPEC_BENCH_ARGS:-}"
[ -n "${ML4_SPEC_DATASET:-}" ] && dataset_args=(--dataset "$(cd "$(dirname "$ML4_SPEC_DATASET")" && pwd)/$(basename "$ML4_SPEC_DATASET")")

declare -A ports
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
base=$((18300 + RANDOM % 500))
for i in "${!configs[@]}"; do
  entry=${configs[$i]}
  name=${entry%%|*}
  spec=${entry#*|}
  port=$((base + i))
  ports[$name]=$port
  args=(serve --model "$model" --port "$port" --max-num-seqs 32 --max-num-batched-tokens 2048 --seed 0)
  [ -n "$spec" ] && args+=(--speculative-config "$spec")
  read -r -a extra <<< "${ML4_SPEC_SERVE_ARGS:-}"
  args+=("${extra[@]}")
  "$ml4" "${args[@]}" >"$out/server_${name}.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
done

for r in $(seq "$rounds"); do
  for t in ${ML4_SPEC_TEMPS:-0 1}; do
    for c in ${ML4_SPEC_CONCURRENCY:-1 8 32}; do
      case $c in 1) n=8 ;; 8) n=32 ;; 32) n=64 ;; esac
      for entry in "${configs[@]}"; do
        name=${entry%%|*}
        f="$out/${name}_t${t}_c${c}_r$r"
        curl -sf "http://127.0.0.1:${ports[$name]}/metrics" > "$f.before" || true
        "$ml4" bench serve --port "${ports[$name]}" --no-progress --max-concurrency "$c" --num-prompts "$n" \
          "${dataset_args[@]}" "${bench_extra[@]}" --output-len 128 --num-warmups 2 --seed $((100 + c)) --temperature "$t" \
          --result-file "$f.json" >"$f.txt"
        curl -sf "http://127.0.0.1:${ports[$name]}/metrics" > "$f.after" || true
        echo "round $r $name t=$t c=$c load $(cut -d' ' -f1 /proc/loadavg): $(grep -E 'Output token throughput|Mean TPOT|Acceptance length' "$f.txt" | tr -s ' ' | paste -sd ';')"
      done
    done
  done
done

python3 - "$out" <<'PYEOF'
import collections, glob, json, os, statistics, sys
out = sys.argv[1]
runs = collections.defaultdict(list)
def engine_counters(path):  # ml4:engine_* counters of a /metrics page
    got = {}
    for line in open(path) if os.path.exists(path) else []:
        if line.startswith("ml4:engine_"):
            name, value = line.split()[:2]
            got[name.split("{")[0]] = got.get(name.split("{")[0], 0.0) + float(value)
    return got
for f in sorted(glob.glob(os.path.join(out, "*_t*_c*_r*.json"))):
    cfg, t, c, _ = os.path.basename(f)[:-5].rsplit("_", 3)
    r = json.load(open(f))
    a, b = engine_counters(f[:-5] + ".before"), engine_counters(f[:-5] + ".after")
    r["engine"] = {k: b[k] - a.get(k, 0.0) for k in b}  # includes the run's 2 warm-ups
    runs[(cfg, int(t[1:]), int(c[1:]))].append(r)
rows = []
for (cfg, t, c), rs in runs.items():
    tp = [r["tpot_ms"]["mean"] for r in rs]
    th = [r["output_throughput"] for r in rs]
    s = rs[0].get("spec_decode")
    if s:  # acceptance pooled over rounds
        drafts = sum(r["spec_decode"]["num_drafts"] for r in rs)
        dt = sum(r["spec_decode"]["draft_tokens"] for r in rs)
        acc = sum(r["spec_decode"]["accepted_tokens"] for r in rs)
        per = [sum(r["spec_decode"]["accepted_per_pos"][j] for r in rs) / drafts for j in range(len(s["accepted_per_pos"]))]
        spec = (f"{1 + acc / drafts:.2f}", f"{100 * acc / dt:.1f}", " ".join(f"{x:.2f}" for x in per))
    else:
        spec = ("-", "-", "-")
    ok = sum(r["completed"] for r in rs)
    bad = sum(r["failed"] for r in rs)
    e = rs[0].get("engine", {})
    steps = e.get("ml4:engine_steps_total", 0.0)
    per = lambda k: f"{1e3 * e.get(k, 0.0) / steps:.3f}" if steps else "-"
    split = (per("ml4:engine_step_seconds_total"), per("ml4:engine_forward_seconds_total"), per("ml4:engine_draft_seconds_total"))
    rows.append((t, c, cfg, ok, bad, statistics.median(tp), min(tp), max(tp), statistics.median(th), min(th), max(th)) + spec + split)
rows.sort()
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("| T | c | config | ok / failed | TPOT ms mean: median (range) | output tok/s: median (range) | acceptance length | acceptance % | per-position acceptance | ms per engine step: all / target forward / drafter |\n")
    f.write("|---|---|---|---|---|---|---|---|---|---|\n")
    for t, c, cfg, ok, bad, tp, tp0, tp1, th, th0, th1, al, ar, pos, st, fw, dr in rows:
        f.write(f"| {t} | {c} | {cfg} | {ok} / {bad} | {tp:.2f} ({tp0:.2f}-{tp1:.2f}) | {th:.1f} ({th0:.1f}-{th1:.1f}) | {al} | {ar} | {pos} | {st} / {fw} / {dr} |\n")
print(open(os.path.join(out, "summary.md")).read())
PYEOF
