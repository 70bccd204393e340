#!/usr/bin/env bash
# On the GPU host's CPUs. `cpu.sh shape`: issue 12's check, 578d457's dist-perf beside this
# bundle's (shared memory, and DIST_SHM=0), 4 ranks 8 B-32 MiB, three alternating rounds.
# `cpu.sh N LO HI [KB]`: dist (shared memory; DIST_ARENA_MAX_KB=KB if given) beside Gloo, N ranks.
# `cpu.sh tcp N LO HI`: dist over loopback TCP beside Gloo.
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
what="${1:-shape}"
if [ "$what" = shape ]; then
  for i in 1 2 3; do
    for v in old new new-tcp; do
      dir="$root/bundle-s7"; [ "$v" = old ] && dir="$root/gpu-s7/old"
      shm=1; [ "$v" = new-tcp ] && shm=0
      echo "== $v round $i" >> "$OUT/s7-shape.txt"
      DIST_SHM=$shm DIST_BUNDLE_DIR="$dir" timeout 100 bundle-s7/xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check 2>&1 | grep -v '^\[' >> "$OUT/s7-shape.txt"
    done
  done
  tail -20 "$OUT/s7-shape.txt"
elif [ "$what" = tcp ]; then
  n="$2" lo="$3" hi="$4"
  DIST_SHM=0 ROUNDS=3 RANKS=$n B=$lo E=$hi timeout 280 benches/peers/compare-gloo.sh bundle-s7 > "$OUT/s7-gloo$n-tcp.txt" 2>&1
  echo "exit $?" >> "$OUT/s7-gloo$n-tcp.txt"
  tail -n 10 "$OUT/s7-gloo$n-tcp.txt"
else
  n="$what" lo="$2" hi="$3" kb="${4:-}"
  tag="shm"; [ -n "$kb" ] && tag="arena$kb"
  if [ -n "$kb" ]; then export DIST_ARENA_MAX_KB=$kb; fi
  ROUNDS=3 RANKS=$n B=$lo E=$hi timeout 280 benches/peers/compare-gloo.sh bundle-s7 > "$OUT/s7-gloo$n-$tag.txt" 2>&1
  echo "exit $?" >> "$OUT/s7-gloo$n-$tag.txt"
  tail -n 12 "$OUT/s7-gloo$n-$tag.txt"
fi
