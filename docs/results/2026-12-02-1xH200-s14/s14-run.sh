#!/usr/bin/env bash
# On the lent GPU host (session 14), from the bundle of this session's code (bundle/s14):
#   s14-run.sh info          the host, its ptrace policy, the GPU suite (needs 2 GPUs)
#   s14-run.sh cmp N LO HI   all_reduce, N ranks, LO..HI (factor 4), three alternating rounds
#                            of: the defaults; the arena's slots at every size split over the
#                            default threads (DIST_DIRECT=0 DIST_ARENA_MAX_KB=1048576); the
#                            same on one thread (DIST_ARENA_THREADS=1, the code before);
#                            direct reads at every size (DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256);
#                            loopback TCP (DIST_SHM=0); PyTorch's Gloo
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
B=${B:-bundle/s14}
case "$1" in
info)
  { date -u; head -3 $B/MANIFEST; nproc; lscpu | grep -E "Model name|Socket|NUMA node\(s\)|L3";
    echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"; nvidia-smi -L; } > "$OUT/s14-info.txt" 2>&1
  timeout 200 $B/run test-multirank --backend nccl --timeout 60 > "$OUT/s14-gpu-suite.txt" 2>&1
  echo "exit $?" >> "$OUT/s14-gpu-suite.txt"
  cat "$OUT/s14-info.txt"; grep -E "^test result|passed|skipped" "$OUT/s14-gpu-suite.txt" | tail -3
  ;;
cmp)
  n="$2" lo="$3" hi="$4" f="$OUT/s14-cmp$n.txt"
  perf() { timeout 150 $B/run perf --op all_reduce -n $n -b $lo -e $hi -f 4 --check; }
  for i in 1 2 3; do
    for v in ${VARIANTS:-defaults arena arena1 direct tcp gloo}; do
      echo "== $v round $i" >> "$f"
      case $v in
        defaults) perf ;;
        arena) DIST_DIRECT=0 DIST_ARENA_MAX_KB=1048576 perf ;;
        arena1) DIST_DIRECT=0 DIST_ARENA_MAX_KB=1048576 DIST_ARENA_THREADS=1 perf ;;
        direct) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 perf ;;
        tcp) DIST_SHM=0 perf ;;
        gloo) timeout 150 python3 $B/torch_allreduce.py --backend gloo -n $n -b $lo -e $hi -f 4 ;;
      esac 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >> "$f"
    done
  done
  grep -c "^==" "$f"
  ;;
esac
# Added (slim bundles of builds of the same code with one constant changed: bundle/slot2 and
# bundle/slot4, dist-tcp's ARENA_SLOT 2 and 4 MiB instead of 1; bundle/p128, dist-core's
# ARENA_PART_MIN 128 KiB instead of 64):
#   s14-run.sh slots N       all_reduce, N ranks, 256 KiB-16 MiB (factor 2), three alternating
#                            rounds of the arena at every size split over the default threads
#                            with each build, and direct reads at every size (bundle/s14)
if [ "$1" = slots ]; then
  n="$2" f="$OUT/s14-slots$2.txt"
  perf() { timeout 150 bundle/$1/run perf --op all_reduce -n $n -b 256K -e 16M -f 2 --check; }
  for i in 1 2 3; do
    for v in s14 slot2 slot4 p128 direct; do
      echo "== $v round $i" >> "$f"
      case $v in
        direct) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 perf s14 ;;
        *) DIST_DIRECT=0 DIST_ARENA_MAX_KB=1048576 perf $v ;;
      esac 2>&1 | grep -v -e '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
#   s14-run.sh one-thread N  all_reduce, N ranks, 256 KiB-64 MiB (factor 4), three alternating
#                            rounds of the defaults with DIST_ARENA_THREADS=1 (the arena at
#                            every size from 8 ranks with a core each), bundle/s14 beside
#                            bundle/slot4
if [ "$1" = one-thread ]; then
  n="$2" f="$OUT/s14-one-thread$2.txt"
  for i in 1 2 3; do
    for v in s14 slot4; do
      echo "== $v round $i" >> "$f"
      DIST_ARENA_THREADS=1 timeout 150 bundle/$v/run perf --op all_reduce -n $n -b 256K -e 64M -f 4 --check 2>&1 | grep -v -e '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
# Added last (bundle/s14b: the session's final code, 4 MiB slots, its new defaults):
#   s14-run.sh final N V..   all_reduce, N ranks, 256 KiB-64 MiB (factor 4), three alternating
#                            rounds of the variants V (as in cmp; `defaults` is the final code's)
if [ "$1" = final ]; then
  n="$2"; shift 2; f="$OUT/s14-final$n.txt"
  perf() { timeout 150 bundle/s14b/run perf --op all_reduce -n $n -b 256K -e 64M -f 4 --check; }
  for i in 1 2 3; do
    for v in "$@"; do
      echo "== $v round $i" >> "$f"
      case $v in
        defaults) perf ;;
        arena) DIST_DIRECT=0 DIST_ARENA_MAX_KB=1048576 perf ;;
        direct) DIST_DIRECT=1 DIST_DIRECT_MIN_KB=256 perf ;;
        tcp) DIST_SHM=0 perf ;;
        gloo) timeout 150 python3 bundle/s14b/torch_allreduce.py --backend gloo -n $n -b 256K -e 64M -f 4 ;;
      esac 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
#   s14-run.sh small N       all_reduce, N ranks, 128 KiB-2 MiB (factor 2), three alternating
#                            rounds of the final code's defaults and DIST_ARENA_THREADS=1
if [ "$1" = small ]; then
  n="$2" f="$OUT/s14-small$2.txt"
  for i in 1 2 3; do
    for v in defaults one; do
      echo "== $v round $i" >> "$f"
      case $v in
        defaults) timeout 150 bundle/s14b/run perf --op all_reduce -n $n -b 128K -e 2M -f 2 --check ;;
        one) DIST_ARENA_THREADS=1 timeout 150 bundle/s14b/run perf --op all_reduce -n $n -b 128K -e 2M -f 2 --check ;;
      esac 2>&1 | grep -v -e '^\[' >> "$f"
    done
  done
  grep -c "^==" "$f"
fi
