#!/usr/bin/env bash
# Packs CUDA binaries built here for the GPU machine (FIELD-NOTES.md "The GPU machine, as
# probed"): copies each binary into .device-carry/bin and the non-system shared libraries
# that ldd lists (fmt, spdlog, pcre2, gtest, ...) into .device-carry/lib. Left out: glibc
# pieces, libstdc++/libgcc (the GPU image's are newer than this Debian 12's) and anything
# CUDA (the GPU machine brings its own driver and toolkit; cuBLASLt 13 there).
# Also copies scripts/gpu_run.sh. Name .device-carry in the run tool's `carry`.
#
# usage: scripts/gpu_pack.sh BUILD_DIR [binary names...]
#   ML4_CARRY=.device-carry-NAME picks another carry folder (one per engineer; all ignored)
#   default binaries: ml4_cuda_tests and every *_bench built from bench/*_bench.cu
set -euo pipefail
build=${1:?usage: gpu_pack.sh BUILD_DIR [binaries...]}
shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/${ML4_CARRY:-.device-carry}"
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  bins=(ml4_cuda_tests)
  for f in "$root"/bench/*_bench.cu; do
    [ -e "$f" ] && bins+=("$(basename "${f%.cu}")")
  done
fi
for b in "${bins[@]}"; do
  src="$build/$b"
  if [ ! -x "$src" ]; then
    echo "gpu_pack: $src not built, skipped" >&2
    continue
  fi
  cp "$src" "$dest/bin/"
  strip --strip-debug "$dest/bin/$b" 2>/dev/null || true
  ldd "$src" | awk '/=> \// {print $3}' | while read -r lib; do
    base=$(basename "$lib")
    case "$base" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++*|libgcc_s*) continue ;;
      libcuda*|libcublas*|libcudart*|libnvrtc*|libnvJitLink*|libcusparse*|libcufft*|libcurand*) continue ;;
      libnccl*) continue ;;  # 218 MB; the GPU machine has the same NCCL 2.28.9 in PyTorch's site-packages
    esac
    [ -e "$dest/lib/$base" ] || cp -L "$lib" "$dest/lib/$base"
  done
done
cp "$root/scripts/gpu_run.sh" "$dest/"
du -sh "$dest"
ls "$dest/bin" "$dest/lib"
