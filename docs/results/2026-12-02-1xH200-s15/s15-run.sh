#!/usr/bin/env bash
# On the lent GPU host (session 15), from two bundles of this session's code: bundle/new
# (2f51060 and on: a rank's arena slot takes only the shares its peers reduce) and a slim
# bundle/old (33c91ac: every rank copies its whole input; only run, xtask, dist-perf,
# MANIFEST and torch_allreduce.py).
#   s15-run.sh info          the host
#   s15-run.sh cmp N         all_reduce, N ranks, 256 KiB-64 MiB (factor 4), three alternating
#                            rounds of the variants in VARIANTS (default: new old tcp gloo):
#                            new and old are each bundle's defaults, tcp is loopback TCP
#                            (DIST_SHM=0, bundle/new), gloo PyTorch's Gloo
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
case "$1" in
info)
  { date -u; head -3 bundle/new/MANIFEST; head -3 bundle/old/MANIFEST; nproc;
    lscpu | grep -E "Model name|Socket|NUMA node\(s\)|L3";
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"; } > "$OUT/s15-info.txt" 2>&1
  cat "$OUT/s15-info.txt"
  ;;
cmp)
  n="$2" f="$OUT/s15-cmp$2.txt"
  perf() { timeout 200 bundle/$1/run perf --op all_reduce -n $n -b 256K -e 64M -f 4 --check; }
  for i in 1 2 3; do
    for v in ${VARIANTS:-new old tcp gloo}; do
      echo "== $v round $i" >> "$f"
      case $v in
        new|old) perf $v ;;
        tcp) DIST_SHM=0 perf new ;;
        gloo) timeout 200 python3 bundle/new/torch_allreduce.py --backend gloo -n $n -b 256K -e 64M -f 4 ;;
      esac 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >> "$f"
    done
  done
  grep -c "^==" "$f"
  ;;
esac
# Added (the host as a 2-core Xeon, as session 14's CI-class machine was):
#   s15-run.sh probe         what the host has of Open MPI, its C library and system
#   s15-run.sh pinned        all_reduce, 4 ranks bound to cores 0 and 1 (`taskset -c 0,1`: each
#                            rank's affinity mask then says 2 cores, so the defaults are those of
#                            a 2-core host), 8 B, 1 MiB and 32 MiB, five alternating rounds of
#                            bundle/new and bundle/old
if [ "$1" = probe ]; then
  { which mpirun mpicc taskset; ldd --version | head -1; grep -E "^(NAME|VERSION)=" /etc/os-release;
    ls /usr/lib/x86_64-linux-gnu/ | grep -ci mpi; } > "$OUT/s15-probe.txt" 2>&1
  cat "$OUT/s15-probe.txt"
fi
if [ "$1" = pinned ]; then
  f="$OUT/s15-pinned.txt"
  for i in 1 2 3 4 5; do
    for v in new old; do
      echo "== $v round $i" >> "$f"
      for s in 8 1M 32M; do
        taskset -c 0,1 timeout 120 bundle/$v/run perf --op all_reduce -n 4 -b $s -e $s --check 2>&1 \
          | grep -v -e '^\[' -e '^#' >> "$f"
      done
    done
  done
  grep -c "^==" "$f"
fi
#   s15-run.sh pinned-vader [YIELD]
#                            as pinned, alternating rounds (ROUNDS, default 5) of bundle/new and
#                            Open MPI's vader (the host's Open MPI, `--bind-to none` so that the
#                            ranks keep the two cores taskset gives them). Open MPI sees 16 cores
#                            and so does not know it is oversubscribed: its ranks spin without
#                            giving the core away (the first run, `s15-pinned-vader-spinning.txt`,
#                            8 B in 4,000-5,000 us). YIELD=1 adds `--mca mpi_yield_when_idle 1`,
#                            what it sets itself where it counts more ranks than cores.
if [ "$1" = pinned-vader ]; then
  f="$OUT/s15-pinned-vader.txt" bin=/tmp/dist-mpi-allreduce
  yield=(); [ "${2:-}" = 1 ] && yield=(--mca mpi_yield_when_idle 1)
  mpicc -O2 -o $bin benches/peers/mpi_allreduce.c
  mpirun --version | head -1 >> "$f"
  for i in $(seq 1 ${ROUNDS:-5}); do
    for v in new vader; do
      echo "== $v round $i" >> "$f"
      for s in 8 1M 32M; do
        case $v in
          new) taskset -c 0,1 timeout 120 bundle/new/run perf --op all_reduce -n 4 -b $s -e $s --check ;;
          vader) taskset -c 0,1 timeout 60 mpirun --allow-run-as-root --oversubscribe --bind-to none \
                   "${yield[@]}" -np 4 --mca btl vader,self $bin -b $s -e $s ;;
        esac 2>&1 | grep -v -e '^\[' -e '^#' >> "$f"
      done
    done
  done
  grep -c "^==" "$f"
fi
