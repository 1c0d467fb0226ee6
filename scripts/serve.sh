#!/usr/bin/env bash
# Serves the default model (ml4-tiny, seed 0, built on first use) with the OpenAI-compatible
# server on 127.0.0.1:8000. Extra arguments go to `ml4 serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MODEL=${ML4_DEFAULT_MODEL:-models/ml4-tiny}
if [ ! -f "$MODEL/params.json" ]; then
  "$BUILD/ml4" make-model --preset ml4-tiny --seed 0 --out "$MODEL"
fi
exec "$BUILD/ml4" serve --model "$MODEL" --served-model-name ml4-tiny "$@"
