#!/usr/bin/env bash
# One H200 call for everything the CPU machine cannot check (the device budget is ~30 minutes a
# session, so the checks share one call; the newest first, so that a cut-off call still brings
# back what matters most):
#   0. MoE prefill as grouped GEMMs (issue 18): gpu_moe_bench (loop vs grouped GEMMs vs
#      cuBLASLt dense) and the ml4-slice-4 step bench's PREFILL lines, both MoE paths; decode
#      steps with NVFP4 / MXFP4 routed experts;
#   D. the decode step (issue 19): ml4-slice-4 at batch 1 / 2 / 4, ml4-tiny, one step's
#      per-kernel times under ncu (bench/ncu_kernel_table.py), ten graphed steps' timeline
#      under the CUPTI tracer (bench/step_timeline.py);
#   1. the GPU tests added since the last run (FILTER_NEW), then DSpark on the H200:
#      bench/spec_decode_cpu.sh against `ml4 serve --device cuda` on assets/ml4-small (one round);
#   2. `ml4 perplexity --device cuda` on ml4-small (the CPU figure to match is in docs/ML4-SMALL.md);
#   3. scripts/gpu_pd_check.sh run (P/D over UCX on the GPU);
#   4. every other GPU test (scripts/gpu_run.sh; FILTER_ALL, positive gtest patterns, default
#      '*': e.g. the suites but a crashing new one, so that it does not hide the rest).
#
#   on the CPU machine, after a CUDA build:  [ML4_VAL_TEXT=val_novels.txt] [ML4_PACK_SLIM=1] scripts/gpu_check_all.sh pack BUILD_DIR
#   on the GPU machine (carry .device-carry-x):
#     tar xJf .device-carry-x/carry.tar.xz && [SECTIONS="tests spec ..."] bash .device-carry-pd/gpu_check_all.sh run
set -uo pipefail
mode=${1:?usage: gpu_check_all.sh pack BUILD_DIR | run}
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$mode" = pack ]; then
  build=${2:?usage: gpu_check_all.sh pack BUILD_DIR}
  # Build what is carried first: packing copies from BUILD_DIR, and a stale binary there once
  # went to the device without the session's new tests (2026-12-07).
  cmake --build "$build" --target ml4 ml4_cuda_tests hisparse_gather_bench spec_step_bench gpu_moe_bench \
    attention_bench kv_transfer_bench ml4_cupti_trace gpu_gemm_bench gpu_sampling_bench || exit 1
  "$root/scripts/gpu_pd_check.sh" pack "$build" || exit 1
  dest="$root/.device-carry-pd"
  cp "$build/ml4_cuda_tests" "$build/hisparse_gather_bench" "$build/spec_step_bench" "$build/gpu_moe_bench" \
    "$build/attention_bench" "$build/gpu_gemm_bench" "$build/gpu_sampling_bench" "$dest/bin/"
  # The CUPTI tracer and its CUPTI (bench/step_timeline.py; the device has no Nsight Systems).
  if [ -e "$build/libml4_cupti_trace.so" ]; then
    cp "$build/libml4_cupti_trace.so" "$dest/lib/"
    cp -L "$(ldd "$build/libml4_cupti_trace.so" | awk '/libcupti/ {print $3}')" "$dest/lib/"
  fi
  ldd "$build/ml4_cuda_tests" | awk '/=> \// {print $3}' | while read -r lib; do
    base=$(basename "$lib")
    case "$base" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++*|libgcc_s*|libcu*|libnccl*|libnv*|libuc[pstm]*) continue ;;
    esac
    [ -e "$dest/lib/$base" ] || cp -L "$lib" "$dest/lib/$base"
  done
  strip --strip-unneeded "$dest"/bin/* "$dest"/lib/*.so* "$dest"/ucx/lib/*.so* "$dest"/ucx/lib/ucx/*.so* 2>/dev/null || true
  cp "$root/scripts/gpu_run.sh" "$root/scripts/gpu_check_all.sh" "$dest/"
  # The perplexity texts (tools/train/prepare_data.py's val_<group>.txt): ML4_VAL_DIR (all
  # groups) or ML4_VAL_TEXT (novels only), when given.
  [ -n "${ML4_VAL_TEXT:-}" ] && cp "$ML4_VAL_TEXT" "$dest/val_novels.txt"
  [ -n "${ML4_VAL_DIR:-}" ] && cp "$ML4_VAL_DIR"/val_*.txt "$dest/"
  du -sh "$dest"
  # The run tool carries at most 64 MiB with the working tree: ship the folder xz-packed.
  rm -rf "$root/.device-carry-x" && mkdir -p "$root/.device-carry-x"
  # ML4_PACK_SLIM=1 leaves out the benches that only the moegemm, spec-step, attention and pd
  # sections run (25 -> 15 MB packed), so that the training data (.device-carry-train, ~17 MB)
  # fits beside it in one call.
  slim=()
  [ "${ML4_PACK_SLIM:-0}" = 1 ] && slim=(--exclude=attention_bench --exclude=gpu_moe_bench --exclude=spec_step_bench
                                         --exclude=kv_transfer_bench)
  tar cJf "$root/.device-carry-x/carry.tar.xz" "${slim[@]}" -C "$root" .device-carry-pd
  du -sh "$root/.device-carry-x"
  echo 'run tool: carry [".device-carry-x"], command: tar xJf .device-carry-x/carry.tar.xz && bash .device-carry-pd/gpu_check_all.sh run'
  exit 0
fi

carry=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/ml4-all-out}
mkdir -p "$out"
nccl_lib=$(python3 -c 'import site, glob; print(next(iter(glob.glob(site.getsitepackages()[0] + "/nvidia/nccl/lib")), ""))' 2>/dev/null)
export LD_LIBRARY_PATH="$carry/ucx/lib:$carry/lib:${LD_LIBRARY_PATH:-}${nccl_lib:+:$nccl_lib}"
export UCX_MODULE_DIR="$carry/ucx/lib/ucx"
export ML4_SOURCE_DIR="$root"
t0=$(date +%s)
stamp() { echo "==== [$(( $(date +%s) - t0 )) s] $*"; }
# SECTIONS picks parts (default all but train): tests decode moegemm spec specstep hisparse perplexity pd all;
# timeline (in decode too) alone runs the decode step's CUPTI timeline; step the decode step's
# figures and fusion A/B lines only (not in the default); gapcause the graph's first idle gap
# under each stream setting (not in the default); gemv the decode GEMV's variants under ncu (not in
# the default); sampling the sampler's kernels under ncu and its bench (not in the default); binab
# every carried bin/ml4-<variant> build against bin/ml4 (not in the default);
# train (not in the default: it needs the corpus carried, see below) retrains the DSpark drafter
sections=" ${SECTIONS:-tests decode moegemm spec specstep hisparse perplexity pd all} "
on() { [[ "$sections" == *" $1 "* ]]; }

# The suites of the kernels the last session changed (twenty-eighth: the exact mode's GEMV and
# router rules, the GEMV defaults pdl_prefetch_bytes 0 and bf16_stream 2), first. A suite that
# faults can be left out of the whole run with ML4_GTEST_EXCLUDE=Suite.* so that it does not take
# the rest with it. The pending call (the suites under the new compiled defaults, the GEMV bench's
# back-to-back lines with PDL and without its prefetch, the step against the old two settings,
# ml4-tiny too, then everything; ~4 min of wall time; on an H200 add ML4_GEMV_MMA_MIN_M=1):
#   AB_TINY=1 SECTIONS="tests gemv binab all" AB_ENVS="ML4_NONE=1 ML4_GEMV_PDL_PREFETCH=-1
#   ML4_GEMV_BF16_STREAM=1"
new=${FILTER_NEW:-CudaGemv.*:CudaMoe.*:CudaRunner.*}
on tests && stamp "1a. new GPU tests: $new" && timeout 240 "$carry/bin/ml4_cuda_tests" --gtest_filter="$new" --gtest_color=no > "$out/new_tests.log" 2>&1
on tests && grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[       OK|rel|Failure" "$out/new_tests.log" | tail -40

if on decode; then
  # Issue 19: the decode step at batch 1 / 2 / 4 (8k and 60k context) against its roofline, the
  # latency path beside the standard one (LATENCY lines), the launch-bound ml4-tiny step, one
  # batch-1 step's per-kernel times under ncu on both paths (warm caches;
  # bench/ncu_kernel_table.py groups them), and the resident FFN kernel's phase trace.
  stamp "D. decode step, per-kernel profile"
  timeout 150 "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1,2,4 --ctx 8192,61440 --no-extras \
    > "$out/decode_step.log" 2>&1; echo "rc=$?"
  grep -E "^COPY|^STEP |^STEPSPLIT|^LATENCY|FUSED|SHAREDLANE|rror" "$out/decode_step.log" | cut -c1-220
  timeout 60 "$carry/bin/ml4" bench step --preset ml4-tiny --batch 1,2,4 --ctx 1024 --kv-gib 1 --no-extras \
    > "$out/decode_step_tiny.log" 2>&1; echo "rc=$?"
  grep -E "^STEP |^LATENCY|rror" "$out/decode_step_tiny.log" | cut -c1-220
  if command -v ncu > /dev/null; then  # the standard step, then the latency path's (ML4_LATENCY_DECODE=1)
    for lat in 0 1; do
      ML4_LATENCY_DECODE=$lat ML4_BENCH_NCU_STEP=1 timeout 200 ncu --profile-from-start off --clock-control none \
        --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
        --log-file "$out/ncu_decode_b1_lat$lat.csv" \
        "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1 --ctx 8192 --kv-gib 4 > "$out/ncu_decode_b1_lat$lat.log" 2>&1
      echo "ncu latency=$lat rc=$?"
      grep NCUSTEP "$out/ncu_decode_b1_lat$lat.log"
    done
    python3 "$root/bench/ncu_kernel_table.py" "$out/ncu_decode_b1_lat0.csv" "$out/ncu_decode_b1_lat1.csv" | head -40
  fi
  # The resident FFN kernel's phases, per layer (min..max over its blocks, us from the first start).
  for b in 1 4; do
    ML4_RESIDENT_TRACE=1 ML4_LATENCY_DECODE=1 ML4_BENCH_NCU_STEP=$b timeout 100 "$carry/bin/ml4" bench step \
      --preset ml4-slice-4 --batch $b --ctx 8192 --kv-gib 4 > "$out/resident_trace_b$b.log" 2>&1
    echo "resident trace batch=$b rc=$?"
    grep -E "NCUSTEP|RESIDENT_TRACE|rror" "$out/resident_trace_b$b.log" | cut -c1-330
  done
fi

if on step; then
  # The decode step alone (issue 19): batch 1 / 2 / 4 at 8k and the fusion A/B lines (FUSED*),
  # ~15 s; `decode` runs the longer profile around it.
  stamp "D1. decode step"
  timeout 150 "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1,2,4,8 --ctx 8192 --no-extras \
    > "$out/step.log" 2>&1; echo "rc=$?"
  grep -E "^STEP |^STEPSPLIT|^HOSTSPLIT|^FUSED|^PDL1|^SHAREDLANE|^MAPPEDIO|rror" "$out/step.log" | cut -c1-200
fi

if on gemv; then
  # The decode GEMV at M = 1 on this card (gpu_gemm_bench gemv: every variant, single launch and
  # 20 back to back), then its stream kernels under ncu.
  stamp "G. the decode GEMV's variants"
  timeout 150 "$carry/bin/gpu_gemm_bench" "${ML4_COPY_GBPS:-3000}" gemv > "$out/gemm_gemv.log" 2>&1; echo "rc=$?"
  # back to back: every FP8 stream variant at M = 1; at M = 2 and 4 the default, the tensor cores, mma
  grep -E "^copy|(fp8|bf16) +(st-|gemv-tc).*back-to-back" "$out/gemm_gemv.log" |
    awk '/^copy/ || $2 == 1 || ($2 <= 4 && /st-mma|st-c1-r4|gemv-tc/)' | cut -c1-150
  if command -v ncu > /dev/null; then  # wo at M = 1: BF16, FP8 4 rows a block, FP8 4 rows a warp, FP8 mma
    timeout 120 ncu --clock-control none --cache-control none -k regex:'gemv_(stream|mma)' --section WarpStateStats \
      --section SpeedOfLight --section Occupancy --section SchedulerStats \
      "$carry/bin/gpu_gemm_bench" 3000 profile > "$out/ncu_gemv.txt" 2>&1
    echo "ncu gemv rc=$?"
    grep -E "gemv_stream_kernel|gemv_mma_kernel|Duration|Elapsed Cycles|SM Active Cycles|DRAM Throughput|Achieved Occupancy|Registers Per|Stall Long|Stall Wait|Warp Cycles Per Issued|Issued Warp|No Eligible" "$out/ncu_gemv.txt" | head -90
  fi
fi

if on sampling; then
  # The sampler's kernels one by one under ncu (gpu_sampling_bench profile: per config greedy, T=1,
  # top-k 50, top-p 0.9, k+p+min-p, top-p 0.99 at B = 1, 8, 64, in that order), then its bench.
  stamp "S. the sampler's kernels"
  if command -v ncu > /dev/null; then
    timeout 120 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
      --log-file "$out/ncu_sampling.csv" "$carry/bin/gpu_sampling_bench" 3000 profile > "$out/sampling_profile.log" 2>&1
    echo "ncu sampling rc=$?"
    python3 - "$out/ncu_sampling.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))]
for r in rows[:40]:
    print(f"{r['Kernel Name'][:60]:60s} {float(r['Metric Value'].replace(',', '')) / 1e3:8.2f} us")
PY
    # the final kernel of top-k + top-p + min-p at B = 1 (the 5th call): why so slow
    timeout 120 ncu --clock-control none --cache-control none -k regex:final_kernel --launch-skip 4 --launch-count 1 \
      --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
      "$carry/bin/gpu_sampling_bench" 3000 profile > "$out/ncu_final.txt" 2>&1
    echo "ncu final rc=$?"
    grep -E "Duration|Registers|Shared Memory Config|Achieved Occupancy|Stall|Issued Warp|No Eligible|Active Warps|Eligible Warps|Warp Cycles" "$out/ncu_final.txt" | head -40
  fi
  timeout 100 "$carry/bin/gpu_sampling_bench" 3000 > "$out/sampling.log" 2>&1; echo "sampling rc=$?"
  grep -E " 1 " "$out/sampling.log" | cut -c1-160
fi

if on binab; then
  # Two builds of ml4 against each other (a compile-time switch): every bin/ml4-<variant> carried
  # beside bin/ml4, alternating, twice; step figures at batch 1 / 2 / 4.
  stamp "D4. builds against each other"
  # AB_ENVS="ML4_NONE=1 ML4_GEMV_WARP_ROWS=1": bin/ml4 under each setting instead (A=1,B=2: both).
  for i in 1 2; do
    if [ -n "${AB_ENVS:-}" ]; then
      for e in $AB_ENVS; do
        echo "== $e run $i"
        env ${e//,/ } timeout 100 "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1,2,4 --ctx 8192 --no-extras 2>&1 | grep -E "^STEP |^STEPSPLIT|^HOSTSPLIT|rror" | cut -c1-200
        # AB_TINY=1: the launch-bound ml4-tiny step (bf16 weights) under each setting too
        [ "${AB_TINY:-0}" = 1 ] && env ${e//,/ } timeout 60 "$carry/bin/ml4" bench step --preset ml4-tiny --batch 1,2,4 \
          --ctx 1024 --kv-gib 1 --no-extras 2>&1 | grep -E "^STEP |rror" | cut -c1-200
      done
      continue
    fi
    for b in "$carry"/bin/ml4-* "$carry/bin/ml4"; do
      echo "== $(basename "$b") run $i"
      timeout 100 "$b" bench step --preset ml4-slice-4 --batch 1,2,4 --ctx 8192 --no-extras 2>&1 | grep -E "^STEP |^STEPSPLIT|^PDL1|rror" | cut -c1-200
    done
  done
fi

if on gapcause; then
  # The ~9 us idle after the embedding (the graph's first kernel) at every batch (twenty-third
  # session, not explained): one traced batch-1 step per setting, the first kernels and the largest
  # gaps. If the gap follows a setting, that is its cause (stream priorities, PDL, the lane).
  stamp "D3. the gap after the embedding"
  for cfg in ${GAP_CFGS:-ML4_NONE=1 ML4_STREAM_PRIORITY=0 ML4_PDL=0 ML4_SHARED_EXPERT_LANE=0}; do
    echo "== $cfg"
    env $cfg ML4_BENCH_TRACE_STEP=1 ML4_CUPTI_OUT="$out/gap.csv" timeout 100 env LD_PRELOAD="$carry/lib/libml4_cupti_trace.so" \
      "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1 --ctx 8192 --kv-gib 4 2>&1 | grep TRACESTEP
    python3 "$root/bench/step_timeline.py" "$out/gap.csv" --csv "$out/gap_step.csv" --top 4 | grep -E "^median|us  " | head -6
    head -4 "$out/gap_step.csv"
  done
  rm -f "$out/gap.csv" "$out/gap_step.csv"
fi

if on decode || on timeline; then
  # Issue 19's lost time per kernel boundary: ten graphed steps under the CUPTI tracer (the
  # machine has no Nsight Systems), each step's span / busy / idle time and its gaps
  # (bench/step_timeline.py), the median step's activities as CSV for bench/plot_step_timeline.py.
  stamp "D2. decode step timeline (CUPTI)"
  for b in 1 4; do
    # LD_PRELOAD through env, after timeout: only ml4 loads the tracer (before the twenty-first
    # session timeout loaded it too and, exiting last, overwrote ml4's trace with an empty one).
    ML4_BENCH_TRACE_STEP=$b ML4_CUPTI_OUT="$out/cupti_b$b.csv" \
      timeout 150 env LD_PRELOAD="$carry/lib/libml4_cupti_trace.so" "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch $b --ctx 8192 --kv-gib 4 \
      > "$out/timeline_b$b.log" 2>&1
    echo "timeline batch=$b rc=$?"
    grep -E "TRACESTEP|rror" "$out/timeline_b$b.log"
    python3 "$root/bench/step_timeline.py" "$out/cupti_b$b.csv" --top 30 --csv "$out/step_b$b.csv" \
      > "$out/step_timeline_b$b.txt" 2>&1 && head -16 "$out/step_timeline_b$b.txt" && sed -n '/^between graph/,$p' "$out/step_timeline_b$b.txt" | head -60
    xz -T4 -f "$out/cupti_b$b.csv"  # every activity of the process: large, kept packed
  done
fi

if on moegemm; then
  stamp "0. MoE prefill: grouped GEMMs vs the expert loop"
  timeout 240 "$carry/bin/gpu_moe_bench" 4253 > "$out/moe_bench.log" 2>&1; echo "rc=$?"
  grep -E "prefill|grouped GEMM T|overlap|rror" "$out/moe_bench.log" | cut -c1-400
  timeout 300 "$carry/bin/ml4" bench step --preset ml4-slice-4 > "$out/step_bench.log" 2>&1; echo "rc=$?"
  grep -E "STEP batch=1 |FUSEDROUTER|FUSEDINDEXER|rror" "$out/step_bench.log" | cut -c1-300
  # Prefill at 4k / 8k / 32k with a small KV pool (an 80 GB card holds 8k only so; moe=...
  # grouped_gemm_overlap is CudaRunnerOptions::moe_gemm_overlap).
  timeout 300 "$carry/bin/ml4" bench step --preset ml4-slice-4 --batch 1 --ctx 1024 --kv-gib 4 > "$out/prefill_bench.log" 2>&1
  echo "rc=$?"
  grep -E "PREFILL |PREFILL_CHUNKED|rror" "$out/prefill_bench.log" | cut -c1-300
  # The sparse MLA prefill kernel's two schedules and the indexer's prefill scores (one token a
  # block, four, wgmma) on their own (attention_bench section 0).
  ML4_ATTN_BENCH=prefill timeout 120 "$carry/bin/attention_bench" > "$out/attn_prefill.log" 2>&1; echo "rc=$?"
  grep -E "ATTN (sparse_mla_prefill|indexer_prefill)" "$out/attn_prefill.log" | cut -c1-300
  for f in nvfp4 mxfp4 fp8-to-mxfp4; do  # decode steps with FP4 routed experts (issue 18) vs the FP8 rows above;
                                        # fp8-to-mxfp4 also times the on-device re-quantization (REQUANT line)
    timeout 200 "$carry/bin/ml4" bench step --preset ml4-slice-4 --experts $f --no-extras --ctx 8192 \
      > "$out/step_bench_$f.log" 2>&1; echo "$f rc=$?"
    grep -E "MODEL|REQUANT|STEP |FP4PARTS|rror" "$out/step_bench_$f.log" | cut -c1-300
  done
fi

if on spec; then
stamp "1b. DSpark on the H200 (ml4-small): 7 drafts and 3 (per-position acceptance falls below 0.2 after the third)"
ML4_SPEC_ROUNDS=1 ML4_SPEC_SERVE_ARGS="--device cuda --kv-cache-memory-bytes 2147483648" \
  timeout 300 bash "$root/bench/spec_decode_cpu.sh" "$carry/bin" "$out/spec" 7 3 > "$out/spec.log" 2>&1
echo "rc=$?"
cat "$out/spec/summary.md" 2>/dev/null || tail -30 "$out/spec.log"
for f in "$out"/spec/server_*.log; do grep -iE "error|graph" "$f" | head -3; done
# Random requests verified on the device (CudaRunnerOptions::device_verification) at T = 1, the
# same grid: against the T = 1 rows above (host verification).
if [ "${ML4_SPEC_DEVICE_VERIFY:-1}" = 1 ]; then
  stamp "1b'. DSpark, T = 1, verification on the device"
  ML4_DEVICE_VERIFY=1 ML4_SPEC_ROUNDS=1 ML4_SPEC_TEMPS=1 ML4_SPEC_SERVE_ARGS="--device cuda --kv-cache-memory-bytes 2147483648" \
    timeout 200 bash "$root/bench/spec_decode_cpu.sh" "$carry/bin" "$out/spec_dv" 7 > "$out/spec_dv.log" 2>&1
  echo "rc=$?"
  cat "$out/spec_dv/summary.md" 2>/dev/null || tail -30 "$out/spec_dv.log"
  for f in "$out"/spec_dv/server_*.log; do grep -iE "error|device verification" "$f" | head -3; done
  rm -rf "$out/spec_dv"
  # Top-p (and top-k) requests: their drafts' q and their verification on the device too
  # (draft_rows / verify_rows with the kept-prefix cut, tenth session); ML4_DEVICE_VERIFY=0 is
  # the host verification they had before, the peer in the same call.
  for dv in 1 0; do
    stamp "1b''. DSpark, T = 1, top-p 0.9 top-k 50, verification on the device: $dv"
    ML4_DEVICE_VERIFY=$dv ML4_SPEC_ROUNDS=1 ML4_SPEC_TEMPS=1 ML4_SPEC_BENCH_ARGS="--top-p 0.9 --top-k 50" \
      ML4_SPEC_SERVE_ARGS="--device cuda --kv-cache-memory-bytes 2147483648" \
      timeout 200 bash "$root/bench/spec_decode_cpu.sh" "$carry/bin" "$out/spec_tp$dv" 3 > "$out/spec_tp$dv.log" 2>&1
    echo "rc=$?"
    cat "$out/spec_tp$dv/summary.md" 2>/dev/null || tail -30 "$out/spec_tp$dv.log"
    rm -rf "$out/spec_tp$dv"
  done
fi
tar czf "$out/spec.tar.gz" -C "$out" spec && rm -rf "$out/spec"  # the run tool brings back few files
fi

if on specstep; then
  stamp "1d. DSpark step pieces (ml4-small): plain decode, verify, draft"
  timeout 120 "$carry/bin/spec_step_bench" --model "$root/assets/ml4-small" > "$out/spec_step.log" 2>&1; echo "rc=$?"
  grep -E "SPEC_STEP|graph|rror" "$out/spec_step.log" | cut -c1-300
  # Full width (issue 13): ml4-slice-4's synthetic weights with a synthetic drafter (3 bf16
  # layers, block 16), fp8_ds_mla KV.
  timeout 180 "$carry/bin/spec_step_bench" --preset ml4-slice-4 > "$out/spec_step_slice4.log" 2>&1; echo "rc=$?"
  grep -E "SPEC_|rror" "$out/spec_step_slice4.log" | cut -c1-300
fi

if on hisparse; then
  stamp "1c. HiSparse: gather bandwidth, decode-step overhead (ml4-slice-4), needle"
  [ "${ML4_HISPARSE_BENCH:-1}" = 1 ] && timeout 120 "$carry/bin/hisparse_gather_bench" 8 > "$out/hisparse_gather.log" 2>&1; echo "rc=$?"
  grep -E "GATHER|pool" "$out/hisparse_gather.log"
  [ "${ML4_HISPARSE_BENCH:-1}" = 1 ] && timeout 400 "$carry/bin/ml4" bench step --preset ml4-slice-4 --hisparse-slots 4096 --batch 1,16 \
    --ctx ${ML4_HISPARSE_CTX:-61440,250000} --kv-gib 30 > "$out/hisparse_step.log" 2>&1; echo "rc=$?"
  grep -E "HISPARSE|rror" "$out/hisparse_step.log" | cut -c1-400
  # Needle in a haystack through the engine, with and without HiSparse (ml4-small).
  timeout 400 python3 "$root/bench/hisparse_needle.py" --ml4 "$carry/bin/ml4" --model "$root/assets/ml4-small" \
    --filler "$carry/val_novels.txt" --device cuda --lengths ${ML4_NEEDLE_LENGTHS:-1024 4096 16384 30000} \
    --n ${ML4_NEEDLE_N:-3} > "$out/hisparse_needle.log" 2>&1; echo "rc=$?"
  grep -E "NEEDLE|DIFFER|failed" "$out/hisparse_needle.log" | cut -c1-300
fi

if on perplexity; then
  stamp "2. perplexity on the GPU, every validation group carried"
  for f in "$carry"/val_*.txt; do
    g=$(basename "$f" .txt)
    timeout 120 "$carry/bin/ml4" perplexity --model "$root/assets/ml4-small" --file "$f" --ctx 4096 \
      --chunks 2 --kv-cache-dtype bf16 --device cuda > "$out/perplexity_$g.log" 2>&1
    echo "$g: $(grep -iE "nll|perplexity" "$out/perplexity_$g.log" | tail -2 | tr '\n' ' ')"
  done
fi

if on pd; then
  for dt in ${ML4_PD_KV_DTYPES:-fp8_ds_mla bf16}; do
    stamp "3. P/D on the GPU, kv $dt"
    # Equal outputs need split-invariant numerics on the GPU (docs/BENCHMARKS.md, P/D): on by
    # default here; ML4_PD_INVARIANT= (empty) runs the production numerics.
    ML4_PD_INVARIANT=${ML4_PD_INVARIANT-1} ML4_PD_KV_DTYPE=$dt OUT="$out/pd_$dt" timeout 240 \
      bash "$carry/gpu_pd_check.sh" run > "$out/pd_$dt.log" 2>&1
    grep -E "PASS|FAIL|NOTE|GB/s|try|ERROR|error" "$out/pd_$dt.log" | cut -c1-300 | head -30
  done
  tar czf "$out/pd.tar.gz" -C "$out" $(cd "$out" && ls -d pd_*/) && rm -rf "$out"/pd_*/
fi

if on train; then
  # The DSpark drafter on the target's own continuations (issue 13, docs/ML4-SMALL.md section 6):
  # carry [".device-carry-x", ".device-carry-train"] with prepare_data.py's output copied to
  # .device-carry-train/data. Writes OUT/train (consolidated.safetensors with the new drafter,
  # results.json with acceptance on held-out corpus and generated rows, stdout.log).
  # ML4_DRAFTER_LAYERS=N grows the shipped one-layer drafter to N draft layers (ML4 has 3).
  # ML4_DRAFTER_GEN_SECONDS=S first has the target continue corpus prompts on this GPU for S
  # seconds (gen_drafter_data.py through `ml4 serve --device cuda`, greedy and T = 1) and adds
  # those rows to the drafter's on-policy data (rows of 256 + 512 tokens, as the CPU-made files:
  # train.py refuses drafter data files of different row lengths).
  mkdir -p "$out/train"
  drafter_data=${ML4_DRAFTER_DATA:-$root/tools/train/runs/drafter_data/ml4-small-cpu.tok.xz,$root/tools/train/runs/drafter_data/ml4-small-cpu-seed1.tok.xz,$root/tools/train/runs/drafter_data/ml4-small-cpu-seed2.tok.xz}
  if [ "${ML4_DRAFTER_GEN_SECONDS:-0}" -gt 0 ]; then
    stamp "T0. on-policy rows from ml4 serve --device cuda (${ML4_DRAFTER_GEN_SECONDS} s)"
    timeout $(( ML4_DRAFTER_GEN_SECONDS + 120 )) python3 "$root/tools/train/gen_drafter_data.py" \
      --data "$root/.device-carry-train/data" --out "$out/train/gen-cuda.tok.xz" --ml4 "$carry/bin/ml4" \
      --model "$root/assets/ml4-small" --serve-arg=--device --serve-arg=cuda --n-seqs 32768 --prompt-len 256 \
      --gen-len 512 --concurrency "${ML4_DRAFTER_GEN_CONCURRENCY:-128}" --seed 3 \
      --max-seconds "$ML4_DRAFTER_GEN_SECONDS" > "$out/train/gen.log" 2>&1
    echo "gen rc=$?"; tail -4 "$out/train/gen.log" | cut -c1-300
    [ -s "$out/train/gen-cuda.tok.xz" ] && drafter_data="$drafter_data,$out/train/gen-cuda.tok.xz"
  fi
  stamp "T. DSpark drafter retraining (${ML4_DRAFTER_SECONDS:-300} s)"
  timeout $(( ${ML4_DRAFTER_SECONDS:-300} + 150 )) python3 "$root/tools/train/train.py" \
    --data "$root/.device-carry-train/data" --tekken "$root/assets/ml4-small/tekken.json" --out "$out/train" \
    --target-from "$root/assets/ml4-small/consolidated.safetensors" --drafter-from-target \
    --target-seconds 0 --skip-target-eval --drafter-seconds "${ML4_DRAFTER_SECONDS:-300}" \
    --drafter-layers "${ML4_DRAFTER_LAYERS:-0}" \
    --drafter-data "$drafter_data" \
    --drafter-data-frac "${ML4_DRAFTER_DATA_FRAC:-0.6}" --passkey-lengths \
    --deadline $(( ${ML4_DRAFTER_SECONDS:-300} + 100 )) > "$out/train/stdout.log" 2>&1
  echo "rc=$?"
  grep -iE "acceptance|drafter step|rror" "$out/train/stdout.log" | tail -25 | cut -c1-300
  rm -f "$out"/train/ckpt.*.pt  # f32 checkpoints: too large to bring back, the export suffices
  # ML4_DRAFTER_SPEC=1: the exported model (a whole model folder) through the engine at c1 on the
  # held-out prompts, 3 drafts, T = 0 and 1, beside the shipped drafter in the same call.
  if [ "${ML4_DRAFTER_SPEC:-0}" = 1 ] && [ -s "$out/train/consolidated.safetensors" ]; then
    # The export holds no tokenizer (the twenty-first session's first try served byte tokens).
    cp "$root/assets/ml4-small/tekken.json" "$out/train/"
    for m in trained shipped; do
      stamp "T2. DSpark through ml4 serve --device cuda, $m drafter"
      dir="$out/train"; [ $m = shipped ] && dir="$root/assets/ml4-small"
      ML4_SPEC_MODEL="$dir" ML4_SPEC_ROUNDS=1 ML4_SPEC_CONCURRENCY=1 \
        ML4_SPEC_DATASET="$root/bench/data/ml4-small-val-prompts.jsonl" \
        ML4_SPEC_SERVE_ARGS="--device cuda --kv-cache-memory-bytes 2147483648" \
        timeout 150 bash "$root/bench/spec_decode_cpu.sh" "$carry/bin" "$out/spec_$m" 3 > "$out/spec_$m.log" 2>&1
      echo "rc=$?"
      cat "$out/spec_$m/summary.md" 2>/dev/null || tail -20 "$out/spec_$m.log"
    done
    tar czf "$out/spec_train.tar.gz" -C "$out" spec_trained spec_shipped && rm -rf "$out"/spec_trained "$out"/spec_shipped
  fi
fi

on all && stamp "4. the GPU tests" && OUT="$out/all" timeout 300 bash "$carry/gpu_run.sh" "${FILTER_ALL:-*}" none > "$out/all.log" 2>&1
on all && tail -25 "$out/all.log"
stamp done
