#!/usr/bin/env bash
# Set up, then run the full test suite: the Release build and the ASan+UBSan build.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release
ctest --test-dir build --output-on-failure -j "$(nproc)"
scripts/setup.sh asan
ctest --test-dir build-asan --output-on-failure -j "$(nproc)"
