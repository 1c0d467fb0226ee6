#!/usr/bin/env bash
# Runs on the GPU machine (via the run tool) over a tree carrying .device-carry (see
# gpu_pack.sh): the GPU tests first, then the benchmarks, each logged under $OUT.
# Prints a short summary last (the run tool returns the tail of the output).
#
# usage: bash scripts/gpu_run.sh [gtest filter] [bench names...]
#   filter default '*'; benches default: every .device-carry/bin/*_bench.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The carry folder is the one this copy of the script lies in (gpu_pack.sh puts it there).
carry=$(cd "$(dirname "$0")" && pwd)
[ -d "$carry/bin" ] || carry="$root/.device-carry"
out=${OUT:-/tmp/ml4-out}
mkdir -p "$out"
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
# NCCL (parallel/cuda/): PyTorch's site-packages/nvidia/nccl/lib there (FIELD-NOTES.md).
nccl_lib=$(python3 -c 'import site, glob; print(next(iter(glob.glob(site.getsitepackages()[0] + "/nvidia/nccl/lib")), ""))' 2>/dev/null)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_lib"
# Goldens and test models are read from this tree, not the build machine's path.
export ML4_SOURCE_DIR="$root"
filter=${1:-*}
shift || true
benches=("$@")
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  ls /usr/local/cuda*/lib64/libcublasLt.so* 2>/dev/null | head -3
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
summary=()
if [ -x "$carry/bin/ml4_cuda_tests" ]; then
  ldd "$carry/bin/ml4_cuda_tests" | grep "not found" && echo "gpu_run: missing libraries above"
  # Whole-model runner tests run in their own process: a crash there cannot hide the
  # kernel tests' results.
  # ML4_GTEST_EXCLUDE: more negative patterns (':'-separated), e.g. a new kernel's test that
  # faulted when run alone and would take the rest of this process with it.
  timeout 300 "$carry/bin/ml4_cuda_tests" --gtest_filter="$filter:-CudaRunner.*:CudaGolden.*${ML4_GTEST_EXCLUDE:+:$ML4_GTEST_EXCLUDE}" \
    --gtest_color=no > "$out/tests.log" 2>&1
  rc=$?
  timeout 240 "$carry/bin/ml4_cuda_tests" --gtest_filter="CudaRunner.*:CudaGolden.*" --gtest_color=no >> "$out/tests.log" 2>&1
  rc2=$?
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |rel_err|mismatch|speedup|Failure|error|^[a-z_]+ .*bound" "$out/tests.log" | tail -120
  summary+=("ml4_cuda_tests rc=$rc runner rc=$rc2 ($(grep -c '^\[       OK' "$out/tests.log") ok, $(grep -c '^\[  FAILED  \]' "$out/tests.log") failed lines)")
fi
if [ ${#benches[@]} -eq 0 ]; then
  for b in "$carry"/bin/*_bench; do [ -x "$b" ] && benches+=("$(basename "$b")"); done
fi
# Ceilings first: later harnesses take the measured copy bandwidth (GB/s) as argv[1].
hbm=""
ordered=()
for b in "${benches[@]}"; do [ "$b" = gpu_ceilings_bench ] && ordered+=("$b"); done
for b in "${benches[@]}"; do [ "$b" != gpu_ceilings_bench ] && ordered+=("$b"); done
for b in "${ordered[@]}"; do
  [ "$b" = none ] && continue
  [ -x "$carry/bin/$b" ] || { summary+=("$b missing"); continue; }
  timeout 240 "$carry/bin/$b" $hbm > "$out/$b.log" 2>&1
  rc=$?
  summary+=("$b rc=$rc")
  if [ "$b" = gpu_ceilings_bench ]; then
    hbm=$(awk '/CEILING hbm_copy/ {print $3}' "$out/$b.log")
  fi
  tail -60 "$out/$b.log"
done
echo "==== summary"
printf '%s\n' "${summary[@]}"
