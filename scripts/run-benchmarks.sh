#!/usr/bin/env bash
# moekit's main job: set up, measure this machine's ceilings, run every benchmark suite.
#   scripts/run-benchmarks.sh [--json] [--quick]
# (full run: about 25 minutes on 2 cores; --quick: small shapes, about a minute)
set -euo pipefail
cd "$(dirname "$0")/.."
global=() bench=()
for arg in "$@"; do
  case "$arg" in
    --json) global+=(--json) ;;
    --quick) bench+=(--quick) ;;
    *) echo "usage: scripts/run-benchmarks.sh [--json] [--quick]" >&2; exit 2 ;;
  esac
done
scripts/setup.sh release
./build/tools/moekit/moekit "${global[@]}" info
./build/tools/moekit/moekit "${global[@]}" peak
./build/tools/moekit/moekit "${global[@]}" bench all "${bench[@]}"
