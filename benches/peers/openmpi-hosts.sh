#!/usr/bin/env bash
# Open MPI's MPI_Allreduce across dist-run's simulated hosts: run as the one rank of
# `dist-run -n 1 --hosts H [--rate R] [--delay-ms MS] -- benches/peers/openmpi-hosts.sh H P ARGS`,
# it starts mpirun in host 0's namespace with P ranks in each of the H hosts' namespaces (one
# app context per host, each rank under `ip netns exec`), ARGS passed to mpi_allreduce.c (-b, -e,
# -f, --iters). Open MPI's TCP transport only (`btl tcp,self` on eth0): its shared memory
# would join every rank of the machine, across the simulated hosts. PMIx, through which the
# ranks reach mpirun, listens on host 0's eth0 (its default, loopback, is not reachable from
# the other namespaces), so its few messages cross the capped links too.
# Needs Debian's openmpi-bin and libopenmpi-dev.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
h="$1" p="$2"
shift 2
prefix="${DIST_TEST_NETNS:?run under dist-run --hosts}"
prefix="${prefix%h0}"
prog="${TMPDIR:-/tmp}/dist-mpi-allreduce-hosts"
mpicc -O2 -o "$prog" "$here/mpi_allreduce.c"
contexts=()
for i in $(seq 0 $((h - 1))); do
    [ "$i" -gt 0 ] && contexts+=(":")
    contexts+=(-np "$p" ip netns exec "${prefix}h$i" "$prog" "$@")
done
export PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=eth0
exec mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self \
    --mca btl_tcp_if_include eth0 "${contexts[@]}"
