#!/usr/bin/env bash
# Fails when ptxas serializes a wgmma kernel. ptxas reports it only as an "info" (C7514: a
# non-wgmma instruction touches an in-flight accumulator, e.g. a group left in flight across a
# loop's back edge; C7515 / C7519 and the rest of C75xx: other reasons it inserts waits), which
# no -Werror turns into an error, and a serialized kernel still gives the right bits: the
# tests cannot see it, only the speed. ctest runs this over every source that issues wgmma.
#   scripts/check_wgmma.sh NVCC SOURCE_DIR
set -euo pipefail
nvcc=${1:?usage: check_wgmma.sh NVCC SOURCE_DIR}
src=${2:?usage: check_wgmma.sh NVCC SOURCE_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for f in $(grep -l "wgmma::" "$src"/src/ops/cuda/*.cu); do
  log="$tmp/$(basename "$f").log"
  "$nvcc" -DML4_WITH_CUDA=1 -I"$src/src" -I"$src/include" -gencode=arch=compute_90a,code=sm_90a \
    --expt-relaxed-constexpr -O3 -std=c++17 -x cu -c "$f" -o "$tmp/out.o" > "$log" 2>&1 || { cat "$log"; status=1; continue; }
  if grep -E "\(C75[0-9][0-9]\)" "$log"; then
    echo "FAIL: ptxas serializes wgmma in $(basename "$f")"
    status=1
  else
    echo "ok: $(basename "$f")"
  fi
done
exit $status
