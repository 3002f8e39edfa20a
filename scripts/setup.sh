#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks, then configures and builds moekit.
#   scripts/setup.sh [release|asan]   (default release; build dirs: build/, build-asan/)
set -euo pipefail
cd "$(dirname "$0")/.."

flavour=${1:-release}
packages=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libfmt-dev libdnnl-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "moekit setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}"
fi

jobs=$(nproc)
case "$flavour" in
  release)
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_WERROR=ON
    cmake --build build -j "$jobs"
    ;;
  asan)
    # The CUDA runtime and ASan do not mix; the sanitizer build is CPU-only.
    cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEKIT_WERROR=ON \
      -DMOEKIT_SANITIZE=ON -DMOEKIT_CUDA=OFF
    cmake --build build-asan -j "$jobs"
    ;;
  *)
    echo "usage: scripts/setup.sh [release|asan]" >&2
    exit 2
    ;;
esac
