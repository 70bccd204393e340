#!/usr/bin/env bash
# On the lent GPU host (session 16), from two bundles: bundle/s16 (direct reads pass their
# results through the arena's slots) and a slim bundle/old (e0a2915, the results read from the
# owners' buffers; only run, xtask, dist-perf, MANIFEST and torch_allreduce.py).
#   s16-run.sh info          the host
#   s16-run.sh cmp N         all_reduce, N ranks, 1-64 MiB (factor 4), three alternating rounds
#                            (ROUNDS) of the variants in VARIANTS (default: new newd old oldd
#                            gloo): new and old are each bundle's defaults, newd and oldd the
#                            same with direct reads from 1 MiB (DIST_DIRECT=1
#                            DIST_DIRECT_MIN_KB=1024), tcp loopback TCP (DIST_SHM=0 of
#                            bundle/s16), gloo PyTorch's Gloo; c512 and c512d as new and newd
#                            from a slim bundle/c512 (the same code, reading 512 KiB at a time
#                            for the reduction instead of 128 KiB)
set -u
# The bundle of the new code: s16, or s16b (the same with direct reads from 16 MiB where
# each rank has a core).
NEW=${NEW:-s16}
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
case "$1" in
info)
  { date -u; head -3 bundle/$NEW/MANIFEST; cat bundle/old/MANIFEST; nproc;
    lscpu | grep -E "Model name|Socket|NUMA node\(s\)|L3";
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"; } > "$OUT/s16-info.txt" 2>&1
  cat "$OUT/s16-info.txt"
  ;;
cmp)
  n="$2" f="$OUT/s16-cmp$2.txt"
  perf() { timeout 200 bundle/$1/run perf --op all_reduce -n $n -b 1M -e 64M -f 4 --check; }
  direct() { DIST_DIRECT=1 DIST_DIRECT_MIN_KB=1024 perf "$1"; }
  for i in $(seq 1 ${ROUNDS:-3}); do
    for v in ${VARIANTS:-new newd old oldd gloo}; do
      echo "== $v round $i $(date -u +%T)" >> "$f"
      case $v in
        new) perf $NEW ;;
        old) perf old ;;
        newd) direct $NEW ;;
        oldd) direct old ;;
        c512) perf c512 ;;
        c512d) direct c512 ;;
        tcp) DIST_SHM=0 perf $NEW ;;
        gloo) timeout 200 python3 bundle/$NEW/torch_allreduce.py --backend gloo -n $n -b 1M -e 64M -f 4 ;;
      esac 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >> "$f"
    done
  done
  grep -c "^==" "$f"
  ;;
esac
# Added after a review (a core a rank on fewer than 8 ranks, where the arena's limit is 1 MiB
# and the rings ran above it before direct reads took 16 MiB and up):
#   s16-run.sh cores N C     all_reduce, N ranks bound to cores 0..C-1 (`taskset`: each rank's
#                            affinity mask says C cores), 4-64 MiB, three alternating rounds of
#                            $NEW's and bundle/old's defaults
if [ "$1" = cores ]; then
  n="$2" c="$3" f="$OUT/s16-cores$2-$3.txt"
  for i in 1 2 3; do
    for v in $NEW old; do
      echo "== $v round $i $(date -u +%T)" >> "$f"
      taskset -c 0-$((c - 1)) timeout 200 bundle/$v/run perf --op all_reduce -n $n -b 4M -e 64M -f 4 --check 2>&1 \
        | grep -v -e '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
#   s16-run.sh pinned        the host as a 2-core Xeon (session 15's `pinned-vader 1`): 4 ranks
#                            under `taskset -c 0,1`, five alternating rounds (ROUNDS) of $NEW's
#                            defaults, $NEW with direct reads from 256 KiB (`newd`:
#                            DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256) and Open MPI's vader
#                            (`--bind-to none --mca mpi_yield_when_idle 1`), 8 B, 256 KiB-2 MiB
#                            (factor 2) and 32 MiB
if [ "$1" = pinned ]; then
  f="$OUT/s16-pinned.txt" bin=/tmp/dist-mpi-allreduce
  mpicc -O2 -o $bin benches/peers/mpi_allreduce.c
  mpirun --version | head -1 >> "$f"
  one() {
    case $1 in
      new) taskset -c 0,1 timeout 120 bundle/$NEW/run perf --op all_reduce -n 4 -b $2 -e $3 -f 2 --check ;;
      newd) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 taskset -c 0,1 timeout 120 \
              bundle/$NEW/run perf --op all_reduce -n 4 -b $2 -e $3 -f 2 --check ;;
      vader) taskset -c 0,1 timeout 60 mpirun --allow-run-as-root --oversubscribe --bind-to none \
               --mca mpi_yield_when_idle 1 -np 4 --mca btl vader,self $bin -b $2 -e $3 -f 2 ;;
    esac 2>&1 | grep -v -e '^\[' -e '^#'
  }
  for i in $(seq 1 ${ROUNDS:-5}); do
    for v in new newd vader; do
      echo "== $v round $i $(date -u +%T)" >> "$f"
      { one $v 8 8; one $v 256K 2M; one $v 32M 32M; } >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
#   s16-run.sh overlap       issue 14's bucketed all_reduce overlapped with compute
#                            (`bench-overlap -n 4`: 4 ranks, 4 buckets of 4 MiB), three
#                            alternating runs of bundle/$NEW (async calls split over threads
#                            started for each step) and bundle/before (the commit before: async
#                            calls on one thread; slim: run, xtask, dist-overlap-bench)
if [ "$1" = overlap ]; then
  f="$OUT/s16-overlap.txt"
  for i in 1 2 3; do
    for v in $NEW before; do
      echo "== $v run $i $(date -u +%T)" >> "$f"
      timeout 120 bundle/$v/run bench-overlap -n 4 2>&1 | grep -v '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
