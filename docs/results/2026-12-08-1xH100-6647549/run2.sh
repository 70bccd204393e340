#!/usr/bin/env bash
# On the lent 16-core host: all_reduce 8 B-32 MiB at 16, 8, 4 ranks, bundle/fin (main) at its
# default small spin and at DIST_SMALL_SPIN_US=10 and 50, beside bundle/base (729f658) and vader,
# three alternating rounds; then the GPU cases (bundle/gpu/run.sh) in the time left.
set -u
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/.."
t0=$(date +%s)
bin=/tmp/dist-mpi-allreduce
mpicc -O2 -o $bin benches/peers/mpi_allreduce.c || exit 1
alt=benches/peers/alternate.sh
for n in 16 8 4; do
  perf() { echo "$2 timeout 100 $1 perf --op all_reduce -n $n -b 8 -e 32M -f 4 --check"; }
  vader="timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n --mca btl vader,self $bin -b 8 -e 32M -f 4"
  ROUNDS=3 $alt "$OUT/final$n.txt" "fin=$(perf bundle/fin/run '')" "s10=$(perf bundle/fin/run DIST_SMALL_SPIN_US=10)" \
    "s50=$(perf bundle/fin/run DIST_SMALL_SPIN_US=50)" "base=$(perf bundle/base/run '')" "vader=$vader" > /dev/null
  python3 bundle/tab.py "$OUT/final$n.txt" vader
  grep -h -B0 barrier "$OUT/final$n.txt" | tr '\n' ' '; echo
  grep -c ' [1-9][0-9]* arena\| [1-9][0-9]*$' "$OUT/final$n.txt" | sed 's/^/lines with wrong elements (approx): /'
done
left=$(( 570 - ($(date +%s) - t0) ))
echo "== GPU, $left s left"
timeout $left bash bundle/gpu/run.sh 2>&1 | tail -80
