#!/usr/bin/env bash
# On the lent 16-core host: the host's cache-line bound, then all_reduce 8 B-32 MiB at 4, 8, 16
# ranks: base (729f658), cur (1328166), new (ab3bbb9), vader, alternating rounds; then, with
# bundle/x (new + DISTX_HOST_PATH, measurement only), each host path forced at 8 and 16 ranks.
set -u
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/.."
bin=/tmp/dist-mpi-allreduce
mpicc -O2 -o $bin benches/peers/mpi_allreduce.c || exit 1
{ date -u; nproc; lscpu; numactl -H 2>&1; mpirun --version 2>&1 | head -1; cat /proc/cmdline; } > "$OUT/info.txt" 2>&1
{
  for cpus in 0,1 0,8 0,15 2,3; do bundle/cur/dist-cacheline --cpus $cpus --rounds 7; done
} > "$OUT/cacheline.txt" 2>&1
cat "$OUT/cacheline.txt" | grep -E 'between|median'
{
  for t in 4 8 16; do for b in 128K 2M 8M 32M; do bundle/new/dist-membw --threads $t --bytes $b --rounds 9; done; done
} > "$OUT/membw.txt" 2>&1
grep -A2 '16 threads, 8388608' "$OUT/membw.txt"
alt=benches/peers/alternate.sh
for n in 16 8; do
  x() { echo "$1 timeout 100 bundle/x/run perf --op all_reduce -n $n -b 8 -e 64K -f 4 --check"; }
  ROUNDS=${ROUNDS:-3} $alt "$OUT/spin$n.txt" "new=$(x '')" "s10=$(x DISTX_SMALL_SPIN_US=10)" \
    "nb=$(x DISTX_BACKOFF=0)" "s50nb=$(x 'DISTX_SMALL_SPIN_US=50 DISTX_BACKOFF=0')"
  echo "spin$n done $(date -u +%T)"
done
for n in ${RANKS:-16 8 4}; do
  perf() { echo "timeout 100 $1 perf --op all_reduce -n $n -b 8 -e 32M -f 4 --check"; }
  vader="timeout 100 mpirun --allow-run-as-root --oversubscribe -np $n --mca btl vader,self $bin -b 8 -e 32M -f 4"
  ROUNDS=${ROUNDS:-3} $alt "$OUT/n$n.txt" "base=$(perf bundle/base/run)" "cur=$(perf bundle/cur/run)" \
    "new=$(perf bundle/new/run)" "vader=$vader"
  echo "n$n done $(date -u +%T)"
done
for n in 16 8; do
  x() { echo "DISTX_HOST_PATH=$1 timeout 100 bundle/x/run perf --op all_reduce -n $n -b $2 -e $3 -f 2 --check"; }
  ROUNDS=${ROUNDS:-3} $alt "$OUT/forced$n.txt" "small=$(x small 8 4K)" "whole=$(x whole 1K 1M)" \
    "split=$(x split 1K 1M)"
  echo "forced$n done $(date -u +%T)"
done
