#!/usr/bin/env bash
# DSpark speculative decoding on the CPU (issue 13; results in docs/BENCHMARKS.md "Speculative
# decoding"): `ml4 bench serve` against `ml4 serve --model assets/ml4-small`, without drafts
# (the peer: the same engine and runner decoding one token per step) and with
# --speculative-config, both draft methods, temperature 0 and 1, at concurrency 1, 8 and 32.
#
#   bench/spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]
#
# One server per configuration (fresh counters, so the acceptance figures are that run's);
# random prompts of 128 tokens, 128 output tokens (ignore_eos), 2 warm-up requests. Writes
# OUT_DIR/<config>_t<T>_c<C>.json (bench serve's JSON, with its spec_decode block) and
# OUT_DIR/summary.md, the table for the docs.
set -euo pipefail
build=$(cd "${1:?usage: spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]}" && pwd)
out=${2:?usage: spec_decode_cpu.sh BUILD_DIR OUT_DIR [NUM_SPEC ...]}
shift 2
specs=("${@:-7}")
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out" && out=$(cd "$out" && pwd)
ml4="$build/ml4"
model="$root/assets/ml4-small"
port=$((18300 + RANDOM % 500))

configs=("plain|")
for n in "${specs[@]}"; do
  configs+=("greedy$n|{\"method\":\"dspark\",\"num_speculative_tokens\":$n,\"draft_sample_method\":\"greedy\"}")
  configs+=("prob$n|{\"method\":\"dspark\",\"num_speculative_tokens\":$n,\"draft_sample_method\":\"probabilistic\"}")
done

for entry in "${configs[@]}"; do
  name=${entry%%|*}
  spec=${entry#*|}
  for t in 0 1; do
    args=(serve --model "$model" --port "$port" --max-num-seqs 32 --max-num-batched-tokens 2048 --seed 0)
    [ -n "$spec" ] && args+=(--speculative-config "$spec")
    "$ml4" "${args[@]}" >"$out/server_${name}_t$t.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
    for c in 1 8 32; do
      case $c in 1) n=8 ;; 8) n=32 ;; 32) n=64 ;; esac
      "$ml4" bench serve --port "$port" --no-progress --max-concurrency "$c" --num-prompts "$n" --input-len 128 \
        --output-len 128 --num-warmups 2 --seed $((100 + c)) --temperature "$t" \
        --result-file "$out/${name}_t${t}_c$c.json" >"$out/${name}_t${t}_c$c.txt"
      echo "$name t=$t c=$c: $(grep -E 'Output token throughput|Mean TPOT|Acceptance length' "$out/${name}_t${t}_c$c.txt" | tr -s ' ' | paste -sd ';')"
    done
    kill "$pid" && wait "$pid" || true
  done
done

python3 - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "*_t*_c*.json"))):
    name = os.path.basename(f)[:-5]
    cfg, t, c = name.rsplit("_", 2)
    r = json.load(open(f))
    s = r.get("spec_decode")
    pos = " ".join(f"{p / s['num_drafts']:.2f}" for p in s["accepted_per_pos"]) if s else "-"
    rows.append((cfg, int(t[1:]), int(c[1:]), r["completed"], r["failed"], r["tpot_ms"]["mean"], r["tpot_ms"]["median"],
                 r["output_throughput"], f"{s['acceptance_length']:.2f}" if s else "-",
                 f"{100 * s['acceptance_rate']:.1f}" if s else "-", pos))
rows.sort(key=lambda x: (x[1], x[2], x[0]))
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("| T | c | config | ok / failed | TPOT ms mean / median | output tok/s | acceptance length | acceptance % | per-position acceptance |\n")
    f.write("|---|---|---|---|---|---|---|---|---|\n")
    for cfg, t, c, ok, bad, tm, tmed, thr, al, ar, pos in rows:
        f.write(f"| {t} | {c} | {cfg} | {ok} / {bad} | {tm:.2f} / {tmed:.2f} | {thr:.1f} | {al} | {ar} | {pos} |\n")
print(open(os.path.join(out, "summary.md")).read())
EOF
