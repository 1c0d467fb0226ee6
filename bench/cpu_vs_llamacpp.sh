#!/usr/bin/env bash
# ml4 against llama.cpp on the CPU, same weights, same machine, runs interleaved so both see
# the same background load (issue 22; results in docs/BENCHMARKS.md "CPU backend").
#
#   bench/cpu_vs_llamacpp.sh BUILD_DIR WORK_DIR [ROUNDS]
#
# BUILD_DIR: an ml4 build with ml4, cpu_model_bench and stream_bench. WORK_DIR (outside the
# repo; nothing of it is committed) receives:
#   llama.cpp/   the upstream tree from the llama-cpp-python sdist on PyPI (the only
#                download), built for this CPU: llama-bench, llama-quantize
#   venv/        Python for llama.cpp's converter: mistral-common, sentencepiece from PyPI,
#                torch/numpy from the system site-packages (pip-installed from PyPI if absent)
#   models/      mistral4-tiny and the ~2B Mistral-4-shaped model (make-model --layout merged),
#                their FP8 copies (ml4 quantize; -fp8h: the output head FP8 too), and GGUFs: bf16 (convert_hf_to_gguf.py
#                --mistral-format on our directory as written) and Q8_0 (llama-quantize)
# Then per round: stream_bench once, and for each model ml4 bf16, ml4 bf16 --dtype bfloat16,
# llama.cpp bf16, ml4 fp8, ml4 fp8 with an FP8 head (f32 and bfloat16 activations), llama.cpp
# Q8_0: pp64, pp512, tg64, tg128 at 2 threads. The bfloat16 runs (ml4's activations in bf16, as
# llama.cpp's bf16 path has them; Q8_0 rounds them to 8 bits) need AVX512_BF16 and are left out
# without it. All output goes to
# WORK_DIR/results-<date>.txt (ml4 lines start CPUBENCH, llama.cpp's are its markdown table).
set -euo pipefail
build=$(cd "${1:?usage: cpu_vs_llamacpp.sh BUILD_DIR WORK_DIR [ROUNDS]}" && pwd)
work=${2:?usage: cpu_vs_llamacpp.sh BUILD_DIR WORK_DIR [ROUNDS]}
rounds=${3:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$work" && work=$(cd "$work" && pwd)
case "$work/" in "$root"/*) echo "WORK_DIR must be outside the repository" >&2; exit 2 ;; esac
LLAMA_PY_VERSION=0.3.36   # carries llama.cpp 0c1e570 (FIELD-NOTES.md)
threads=2

# 1. llama.cpp from its public source (PyPI sdist), built beside the project.
llama="$work/llama.cpp"
if [ ! -x "$llama/build/bin/llama-bench" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$LLAMA_PY_VERSION"
  tar xzf "$tmp/llama_cpp_python-$LLAMA_PY_VERSION.tar.gz" -C "$tmp"
  rm -rf "$llama" && mv "$tmp/llama_cpp_python-$LLAMA_PY_VERSION/vendor/llama.cpp" "$llama" && rm -rf "$tmp"
  # The sdist's vendor/.git points into the wheel's repository, which is not there: without
  # removing it the generated build.ninja stays dirty forever.
  rm -f "$llama/.git"
  cmake -S "$llama" -B "$llama/build" -G Ninja -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DCMAKE_BUILD_TYPE=Release
  cmake --build "$llama/build" -j "$(nproc)" --target llama-bench llama-quantize
fi

# 2. The converter's Python.
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
"$venv/bin/python" -c "import mistral_common, sentencepiece" 2>/dev/null ||
  "$venv/bin/pip" install -q mistral-common sentencepiece
"$venv/bin/python" -c "import torch, numpy" 2>/dev/null || "$venv/bin/pip" install -q torch numpy

# 3. Models. The ~2B model: the first 8 ml4 layers at width 2048 with what llama.cpp cannot
# convert (indexer, KV sharing, NoPE/SSMax, LeRoPE, drafter) removed, 32 experts top-4 + 1
# shared of 896, no dense layer: 2.10B parameters, 1.14 GB of bf16 weights per decode token.
m="$work/models"
mkdir -p "$m"
make_models() {
  local name=$1; shift
  if [ ! -f "$m/$name/params.json" ]; then
    "$build/ml4" make-model "$@" --layout merged --out "$m/$name"
  fi
  if [ ! -f "$m/$name-fp8/params.json" ]; then
    "$build/ml4" quantize --to fp8 "$m/$name" "$m/$name-fp8"
  fi
  # The same with the output head FP8 as well (Q8_0 quantizes it too).
  if [ ! -f "$m/$name-fp8h/params.json" ]; then
    "$build/ml4" quantize --to fp8 --output-tensor-type fp8 "$m/$name" "$m/$name-fp8h"
  fi
  if [ ! -f "$m/$name-bf16.gguf" ]; then
    (cd "$llama" && "$venv/bin/python" convert_hf_to_gguf.py --mistral-format \
        --disable-mistral-community-chat-template "$m/$name" --outfile "$m/$name-bf16.gguf" --outtype bf16)
  fi
  if [ ! -f "$m/$name-q8_0.gguf" ]; then
    "$llama/build/bin/llama-quantize" "$m/$name-bf16.gguf" "$m/$name-q8_0.gguf" Q8_0 "$threads"
  fi
}
make_models mistral4-tiny --preset mistral4-tiny
make_models m4-2b --preset ml4-slice-8 --set "dim=2048,n_heads=16,q_lora_rank=512,hidden_dim=8192,indexer=null,kv_sharing=null,nope_layer_interval=null,ssmax=null,lerope=null,mtp=null,quantization=null,moe.num_experts=32,moe.expert_hidden_dim=896,moe.first_k_dense_replace=0"

# 4. Interleaved runs.
out="$work/results-$(date -u +%Y%m%dT%H%M%SZ).txt"
echo "# $(date -u) $(uname -n) $(nproc) cpus; ml4 $(git -C "$root" rev-parse --short HEAD); llama.cpp from llama-cpp-python $LLAMA_PY_VERSION" | tee "$out"
bf16x=()
if grep -q ' avx512_bf16' /proc/cpuinfo && grep -q ' avx512vbmi' /proc/cpuinfo; then bf16x=(bfloat16); fi
for r in $(seq 1 "$rounds"); do
  echo "## round $r, loadavg $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out"
  "$build/stream_bench" --mib 512 --reps 5 --threads 1,2 | grep -E "kernel=read" | tee -a "$out"
  for name in mistral4-tiny m4-2b; do
    for dt in auto "${bf16x[@]}"; do
      ML4_THREADS=$threads "$build/cpu_model_bench" --model "$m/$name" -p 64,512 -n 64,128 -r 3 --dtype "$dt" | tee -a "$out"
    done
    "$llama/build/bin/llama-bench" -m "$m/$name-bf16.gguf" -p 64,512 -n 64,128 -t "$threads" -r 3 2>/dev/null | tee -a "$out"
    ML4_THREADS=$threads "$build/cpu_model_bench" --model "$m/$name-fp8" -p 64,512 -n 64,128 -r 3 | tee -a "$out"
    for dt in auto "${bf16x[@]}"; do
      ML4_THREADS=$threads "$build/cpu_model_bench" --model "$m/$name-fp8h" -p 64,512 -n 64,128 -r 3 --dtype "$dt" | tee -a "$out"
    done
    "$llama/build/bin/llama-bench" -m "$m/$name-q8_0.gguf" -p 64,512 -n 64,128 -t "$threads" -r 3 2>/dev/null | tee -a "$out"
  done
done
echo "results: $out"
