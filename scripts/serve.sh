#!/usr/bin/env bash
# Serves the default model, ml4-small (the trained model shipped in assets/ml4-small: see its
# README.md), with the OpenAI-compatible server on 127.0.0.1:8000. Extra arguments go to
# `ml4 serve` (e.g. --port 9000). ML4_DEFAULT_MODEL=DIR serves another model directory (its
# folder name becomes the served model name); ML4_DEFAULT_MODEL=ml4-tiny builds the random
# ml4-tiny preset into models/ml4-tiny on first use, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MODEL=${ML4_DEFAULT_MODEL:-assets/ml4-small}
if [ "$MODEL" = ml4-tiny ]; then
  MODEL=models/ml4-tiny
  if [ ! -f "$MODEL/params.json" ]; then
    "$BUILD/ml4" make-model --preset ml4-tiny --seed 0 --out "$MODEL"
  fi
fi
if [ ! -f "$MODEL/params.json" ]; then
  echo "serve.sh: $MODEL has no params.json" >&2
  exit 1
fi
exec "$BUILD/ml4" serve --model "$MODEL" --served-model-name "$(basename "$MODEL")" "$@"
