#!/usr/bin/env bash
# Regenerates every golden under tests/golden/{mistral4-tiny,dsv32-tiny,ml4-tiny} in one run.
#
#   tools/reference/make_goldens.sh [ML4_BINARY]      (default: build/ml4)
#
# Environment: PYTHON (default python3), GOLDEN_OUT (default tests/golden; another
# directory to check that a regeneration reproduces the committed files).
#
# Needs python3 with torch 2.11 and transformers 5.17 (and safetensors, numpy): the GPU
# machine has them; `pip install torch==2.11.0 transformers==5.17.0` works anywhere (the
# references run in float64 on the CPU; a GPU is not needed). Writes the checkpoints with
# `ml4 make-model` into a temporary directory, runs tools/reference/make_goldens.py and
# leaves the goldens in tests/golden/. CI only reads them (tests/runtime/golden_test.cpp).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
ml4="${1:-$root/build/ml4}"
seed=1234   # keep in sync with SEED in make_goldens.py
py="${PYTHON:-python3}"
models="$(mktemp -d)"
trap 'rm -rf "$models"' EXIT
# The HF presets in both layouts (transformers reads hf/); ml4-tiny has no HF form.
for preset in mistral4-tiny dsv32-tiny ml4-tiny; do
  layout=both
  [ "$preset" = ml4-tiny ] && layout=native
  "$ml4" make-model --preset "$preset" --seed "$seed" --layout "$layout" --dtype bf16 --out "$models/$preset" >/dev/null
done
cd "$root"
"$py" tools/reference/make_goldens.py --models "$models" --out "${GOLDEN_OUT:-tests/golden}" \
  --command "tools/reference/make_goldens.sh $(basename "$ml4")"
