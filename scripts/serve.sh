#!/usr/bin/env bash
# Serves the default model. Until the server lands this generates from it instead.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MODEL=${ML4_DEFAULT_MODEL:-models/ml4-tiny}
if [ ! -f "$MODEL/params.json" ]; then
  "$BUILD/ml4" make-model --preset ml4-tiny --seed 0 --out "$MODEL"
fi
exec "$BUILD/ml4" generate --model "$MODEL" --prompt "Hello" --max-tokens 32 "$@"
