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
# Expert parallelism: 2 MPI ranks on this host, one copy/reduce thread each.
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
MOEKIT_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 2 \
  ./build/tools/moekit/moekit "${global[@]}" bench ep "${bench[@]}"
# The internode path: 2 simulated nodes of 2 ranks, the rail over TCP (oversubscribed here).
MOEKIT_NUM_THREADS=1 MOEKIT_EP_RANKS_PER_NODE=2 mpirun --oversubscribe --bind-to none --mca btl tcp,self \
  -x MOEKIT_EP_RANKS_PER_NODE -np 4 ./build/tools/moekit/moekit "${global[@]}" bench ep "${bench[@]}"
