#!/usr/bin/env bash
# Builds and runs the Open MPI peer of `cargo xtask perf --op all_reduce` over TCP on loopback,
# or over shared memory with BTL=vader,self (Open MPI's shared-memory transport).
# Needs Debian's openmpi-bin and libopenmpi-dev (apt-get install openmpi-bin libopenmpi-dev).
# Usage: benches/peers/run-openmpi.sh [-n RANKS] [-b MIN] [-e MAX] [-f FACTOR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
n=4
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -n) n="$2"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
out="${TMPDIR:-/tmp}/dist-mpi-allreduce"
mpicc -O2 -o "$out" "$here/mpi_allreduce.c"
# --allow-run-as-root: CI and the GPU hosts run as root. --oversubscribe: more ranks than cores.
btl="${BTL:-tcp,self}"
mca=(--mca btl "$btl")
case "$btl" in *tcp*) mca+=(--mca btl_tcp_if_include lo) ;; esac
exec mpirun --allow-run-as-root --oversubscribe -np "$n" "${mca[@]}" \
    "$out" "${args[@]}"
