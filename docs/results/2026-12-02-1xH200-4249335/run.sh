#!/usr/bin/env bash
# On the lent GPU host (the runs of 2026-12-02 afternoon (4249335)), from bundles made here (git-ignored, in `carry`):
# bundle/$NEW (NEW=new by default: direct reads pass their results through the arena's
# slots; b4249335 the same with direct reads from 16 MiB where each rank has a core; bd3ca466 and
# b7a89dd6 later commits, see README.md) and slim ones (run, xtask, MANIFEST and the binaries the
# mode runs): bundle/old (e0a2915, the results read from the owners' buffers), bundle/c512,
# bundle/before. Every mode but `info` runs alternating rounds through
# benches/peers/alternate.sh (ROUNDS); benches/peers/medians.py FILE gives the medians.
#   run.sh info          the host
#   run.sh cmp N         all_reduce, N ranks, 1-64 MiB (factor 4), three rounds of the
#                            variants in VARIANTS (default: new newd old oldd gloo): new and old
#                            each bundle's defaults, newd and oldd the same with direct reads
#                            from 1 MiB (DIST_DIRECT=1 DIST_DIRECT_MIN_KB=1024), tcp loopback TCP
#                            (DIST_SHM=0 of bundle/$NEW), gloo PyTorch's Gloo; c512 and c512d as
#                            new and newd from bundle/c512 (reading 512 KiB at a time for the
#                            reduction instead of 128 KiB)
#   run.sh cores N C     all_reduce, N ranks bound to cores 0..C-1 (`taskset`: each rank's
#                            affinity mask says C cores), 4-64 MiB, three rounds of $NEW's and
#                            bundle/old's defaults (added after a review: a core a rank on fewer
#                            than 8 ranks, where the rings ran above 1 MiB before)
#   run.sh pinned        the host as a 2-core Xeon: 4 ranks under `taskset -c 0,1`, five
#                            rounds of $NEW's defaults, `newd` ($NEW with DIST_DIRECT=1
#                            DIST_DIRECT_MIN_KB=256) and Open MPI's vader (`--bind-to none
#                            --mca mpi_yield_when_idle 1`), 8 B, 256 KiB-2 MiB (factor 2), 32 MiB
#   run.sh overlap       the overlap bench (`bench-overlap -n 4`), three rounds of
#                            bundle/$NEW and bundle/before
set -u
NEW=${NEW:-new}
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
alternate=benches/peers/alternate.sh
case "$1" in
info)
  { date -u; head -3 bundle/$NEW/MANIFEST; cat bundle/old/MANIFEST; nproc;
    lscpu | grep -E "Model name|Socket|NUMA node\(s\)|L3";
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"; } > "$OUT/info.txt" 2>&1
  cat "$OUT/info.txt"
  ;;
cmp)
  n="$2"
  perf() { echo "timeout 200 bundle/$1/run perf --op all_reduce -n $n -b 1M -e 64M -f 4 --check"; }
  d="DIST_DIRECT=1 DIST_DIRECT_MIN_KB=1024"
  declare -A cmd=(
    [new]="$(perf $NEW)" [old]="$(perf old)" [c512]="$(perf c512)"
    [newd]="$d $(perf $NEW)" [oldd]="$d $(perf old)" [c512d]="$d $(perf c512)"
    [tcp]="DIST_SHM=0 $(perf $NEW)"
    [gloo]="timeout 200 python3 bundle/$NEW/torch_allreduce.py --backend gloo -n $n -b 1M -e 64M -f 4"
  )
  variants=()
  for v in ${VARIANTS:-new newd old oldd gloo}; do variants+=("$v=${cmd[$v]}"); done
  $alternate "$OUT/cmp$n.txt" "${variants[@]}"
  ;;
cores)
  n="$2" c="$3"
  perf() { echo "taskset -c 0-$((c - 1)) timeout 200 bundle/$1/run perf --op all_reduce -n $n -b 4M -e 64M -f 4 --check"; }
  $alternate "$OUT/cores$n-$c.txt" "$NEW=$(perf $NEW)" "old=$(perf old)"
  ;;
pinned)
  bin=/tmp/dist-mpi-allreduce
  mpicc -O2 -o $bin benches/peers/mpi_allreduce.c
  mpirun --version | head -1 >> "$OUT/pinned.txt"
  sizes() { echo "$1 -b 8 -e 8 -f 2; $1 -b 256K -e 2M -f 2; $1 -b 32M -e 32M -f 2"; }
  dist="taskset -c 0,1 timeout 120 bundle/$NEW/run perf --op all_reduce -n 4 --check"
  vader="taskset -c 0,1 timeout 60 mpirun --allow-run-as-root --oversubscribe --bind-to none \
--mca mpi_yield_when_idle 1 -np 4 --mca btl vader,self $bin"
  ROUNDS=${ROUNDS:-5} $alternate "$OUT/pinned.txt" "new=$(sizes "$dist")" \
    "newd=$(sizes "DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 $dist")" "vader=$(sizes "$vader")"
  ;;
overlap)
  run() { echo "timeout 120 bundle/$1/run bench-overlap -n 4"; }
  $alternate "$OUT/overlap.txt" "$NEW=$(run $NEW)" "before=$(run before)"
  ;;
esac
