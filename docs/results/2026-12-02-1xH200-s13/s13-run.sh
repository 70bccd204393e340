#!/usr/bin/env bash
# On the lent GPU host (session 13), from the bundle of this session's code (bundle/s13):
#   s13-run.sh info          the host, its ptrace policy, the GPU suite (needs 2 GPUs)
#   s13-run.sh cma           one core's copy rates: memmove against process_vm_readv
#   s13-run.sh cmp N LO HI   all_reduce, N ranks, LO..HI (factor 4), three alternating rounds
#                            of: direct reads split over the default threads (DIST_DIRECT=1),
#                            direct reads on one thread (DIST_DIRECT_THREADS=1), the arena's
#                            copies or the rings (DIST_DIRECT=0), loopback TCP (DIST_SHM=0),
#                            and PyTorch's Gloo
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
B=bundle/s13
case "$1" in
info)
  { date -u; head -3 $B/MANIFEST; nproc; lscpu | grep -E "Model name|Socket|NUMA node\(s\)|L3";
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"; nvidia-smi -L; } > "$OUT/s13-info.txt" 2>&1
  timeout 200 $B/run test-multirank --backend nccl --timeout 60 > "$OUT/s13-gpu-suite.txt" 2>&1
  echo "exit $?" >> "$OUT/s13-gpu-suite.txt"
  cat "$OUT/s13-info.txt"; grep -E "^test result|passed|skipped" "$OUT/s13-gpu-suite.txt" | tail -3
  ;;
cma)
  python3 docs/results/2026-12-01-1xH200-s12/cma_copy.py > "$OUT/s13-cma-copy.txt" 2>&1
  cat "$OUT/s13-cma-copy.txt"
  ;;
cmp)
  n="$2" lo="$3" hi="$4" f="$OUT/s13-cmp$n.txt"
  for i in 1 2 3; do
    for v in split one copies tcp gloo; do
      echo "== $v round $i" >> "$f"
      case $v in
        split) DIST_DIRECT=1 timeout 120 $B/run perf --op all_reduce -n $n -b $lo -e $hi -f 4 --check ;;
        one) DIST_DIRECT=1 DIST_DIRECT_THREADS=1 timeout 120 $B/run perf --op all_reduce -n $n -b $lo -e $hi -f 4 --check ;;
        copies) DIST_DIRECT=0 timeout 120 $B/run perf --op all_reduce -n $n -b $lo -e $hi -f 4 --check ;;
        tcp) DIST_SHM=0 timeout 120 $B/run perf --op all_reduce -n $n -b $lo -e $hi -f 4 --check ;;
        gloo) timeout 150 python3 $B/torch_allreduce.py --backend gloo -n $n -b $lo -e $hi -f 4 ;;
      esac 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >> "$f"
    done
  done
  grep -c "^==" "$f"
  ;;
esac
# Added after review (bundle/s13b, the probe over 2 MiB):
#   s13-run.sh probe         cma_copy.py at 2 MiB; which direct reads each rank proposes with the
#                            defaults (the init's debug line) at 4, 8 and 16 ranks; one round of
#                            the defaults at 1–64 MiB beside DIST_DIRECT=0
if [ "$1" = probe ]; then
  B=bundle/s13b f="$OUT/s13-probe.txt"
  python3 docs/results/2026-12-01-1xH200-s12/cma_copy.py 2097152 > "$f" 2>&1
  for n in 4 8 16; do
    echo "== proposals $n" >> "$f"
    RUST_LOG=dist_tcp=debug timeout 60 $B/run perf --op all_reduce -n $n -b 8 -e 8 2>&1 | grep -o "direct=.*" | sort | uniq -c >> "$f"
    for v in defaults copies; do
      echo "== $v $n" >> "$f"
      case $v in
        defaults) timeout 120 $B/run perf --op all_reduce -n $n -b 1M -e 64M -f 4 --check ;;
        copies) DIST_DIRECT=0 timeout 120 $B/run perf --op all_reduce -n $n -b 1M -e 64M -f 4 --check ;;
      esac 2>&1 | grep -v -e '^\[' >> "$f"
    done
  done
  cat "$f"
fi
# Added last (bundle/slim-s13b: PART_MIN 256 KiB, the code; bundle/slim-s13c: the same built
# with PART_MIN 64 KiB):
#   s13-run.sh parts N       all_reduce, N ranks, 256 KiB-4 MiB (factor 2), three alternating
#                            rounds of direct reads from 256 KiB split in parts of at least
#                            256 KiB, the same with 64 KiB, and DIST_DIRECT=0
if [ "$1" = parts ]; then
  n="$2" f="$OUT/s13-parts$2.txt"
  for i in 1 2 3; do
    for v in p256 p64 copies; do
      echo "== $v round $i" >> "$f"
      case $v in
        p256) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 timeout 120 bundle/slim-s13b/run perf --op all_reduce -n $n -b 256K -e 4M -f 2 --check ;;
        p64) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 timeout 120 bundle/slim-s13c/run perf --op all_reduce -n $n -b 256K -e 4M -f 2 --check ;;
        copies) DIST_DIRECT=0 timeout 120 bundle/slim-s13b/run perf --op all_reduce -n $n -b 256K -e 4M -f 2 --check ;;
      esac 2>&1 | grep -v -e '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
