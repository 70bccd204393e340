#!/usr/bin/env bash
# all_reduce 8 B, 4 ranks, five alternating rounds of builds of one commit (091f6d8's code;
# slim bundles: bundle/v1 as committed; v2 a wait that looks at the clock only every 16th look;
# v3 with YIELD 0, so that a wait gives its core away only for its spin, 50 us unless the host
# is crowded, before it sleeps on the futex; v4 YIELD 0 only for a piece every rank reduces
# whole, the split pieces' waits as v1's) and Open MPI's vader. VARIANTS chooses them (default
# v1 v2 v3 vader). PIN=1 binds everything to cores 0 and 1 (`taskset -c 0,1`, with
# `--bind-to none --mca mpi_yield_when_idle 1` for Open MPI, which cannot see that it is
# oversubscribed there). From the repository root.
set -u
f="${1:-wait-8b.txt}" bin=/tmp/dist-mpi-allreduce
mpicc -O2 -o $bin benches/peers/mpi_allreduce.c
pin=(); mpi=()
if [ "${PIN:-0}" = 1 ]; then pin=(taskset -c 0,1); mpi=(--bind-to none --mca mpi_yield_when_idle 1); fi
for i in 1 2 3 4 5; do
  for v in ${VARIANTS:-v1 v2 v3 vader}; do
    echo "== $v round $i" >> "$f"
    case $v in
      vader) "${pin[@]}" timeout 60 mpirun --allow-run-as-root --oversubscribe "${mpi[@]}" -np 4 \
               --mca btl vader,self $bin -b 8 -e 8 ;;
      *) "${pin[@]}" timeout 60 bundle/$v/run perf --op all_reduce -n 4 -b 8 -e 8 --check ;;
    esac 2>&1 | grep -v -e '^\[' -e '^#' >> "$f"
  done
done
grep -c "^==" "$f"
