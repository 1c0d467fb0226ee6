#!/usr/bin/env bash
# Installs the Debian packages the build and tests need. Idempotent: does nothing when
# every package is already there.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config nlohmann-json3-dev libpcre2-dev libcpp-httplib-dev
      libcli11-dev libfmt-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev)
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

# Python packages the server tests drive ml4 with (the real openai client, pytest).
if ! python3 -c "import openai, pytest" >/dev/null 2>&1; then
  echo "setup: installing openai and pytest"
  python3 -m pip install -q openai pytest || python3 -m pip install -q --break-system-packages openai pytest
fi
