#!/usr/bin/env bash
# moekit's main job: set up, measure this machine's ceilings, run every benchmark suite.
#   scripts/run-benchmarks.sh [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release
./build/tools/moekit/moekit "$@" info
./build/tools/moekit/moekit "$@" peak
./build/tools/moekit/moekit "$@" bench all
