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
