#!/usr/bin/env bash
# On the GPU host (the runs of 2026-12-01 at 8753701), from the bundle of these runs' code:
#   run.sh suite        the whole GPU suite (every nccl_/hybrid_ case)
#   run.sh gloo N LO HI dist (its defaults: shared memory, the host arena) beside Gloo, N ranks
#   run.sh tcp N LO HI  dist over loopback TCP (DIST_SHM=0) beside Gloo
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
B=bundle
case "$1" in
suite)
  { date -u; head -3 $B/MANIFEST; nproc; nvidia-smi -L; } > "$OUT/info.txt" 2>&1
  timeout 420 $B/run test-multirank --backend nccl --timeout 100 > "$OUT/gpu-suite.txt" 2>&1
  echo "exit $?" >> "$OUT/gpu-suite.txt"
  grep -E "^test result|FAILED|failed|passed" "$OUT/gpu-suite.txt" | tail -8
  ;;
gloo)
  n="$2" lo="$3" hi="$4"
  ROUNDS=3 RANKS=$n B=$lo E=$hi timeout 280 benches/peers/compare-gloo.sh $B > "$OUT/gloo$n-shm.txt" 2>&1
  echo "exit $?" >> "$OUT/gloo$n-shm.txt"
  tail -n 12 "$OUT/gloo$n-shm.txt"
  ;;
tcp)
  n="$2" lo="$3" hi="$4"
  DIST_SHM=0 ROUNDS=3 RANKS=$n B=$lo E=$hi timeout 280 benches/peers/compare-gloo.sh $B > "$OUT/gloo$n-tcp.txt" 2>&1
  echo "exit $?" >> "$OUT/gloo$n-tcp.txt"
  tail -n 10 "$OUT/gloo$n-tcp.txt"
  ;;
ab)
  # The arena's own-share skip (8753701) beside the code before it (e896b52's dist-perf),
  # alternating, three rounds, N ranks, LO..HI.
  n="$2" lo="$3" hi="$4"
  for i in 1 2 3; do
    for v in old new; do
      dir="$root/$B"; [ "$v" = old ] && dir="$root/gpu/old"
      echo "== $v round $i" >> "$OUT/ab$n.txt"
      DIST_BUNDLE_DIR="$dir" timeout 100 $B/xtask perf --backend tcp --op all_reduce -n $n -b $lo -e $hi -f 4 --check 2>&1 | grep -v '^\[' >> "$OUT/ab$n.txt"
    done
  done
  tail -n 8 "$OUT/ab$n.txt"
  ;;
shape)
  # The split's check on this host: 578d457's dist-perf beside this bundle's (its defaults, and
  # DIST_SHM=0), 4 ranks, 8 B-32 MiB, three alternating rounds.
  for i in 1 2 3; do
    for v in old new new-tcp; do
      dir="$root/$B"; [ "$v" = old ] && dir="$root/gpu-prev/old"
      shm=1; [ "$v" = new-tcp ] && shm=0
      echo "== $v round $i" >> "$OUT/shape.txt"
      DIST_SHM=$shm DIST_BUNDLE_DIR="$dir" timeout 100 $B/xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check 2>&1 | grep -v '^\[' >> "$OUT/shape.txt"
    done
  done
  tail -n 5 "$OUT/shape.txt"
  ;;
knobs)
  # The TCP path at 8-32 MiB, 4 ranks: 578d457 beside this bundle with its defaults and with one
  # knob changed at a time, three alternating rounds.
  for i in 1 2 3; do
    for v in old def par0 piece512 piece2048 spin200; do
      dir="$root/$B"; [ "$v" = old ] && dir="$root/gpu-prev/old"
      env=(DIST_SHM=0)
      case $v in par0) env+=(DIST_TCP_PARALLEL=0);; piece512) env+=(DIST_RING_PIECE_KB=512);;
        piece2048) env+=(DIST_RING_PIECE_KB=2048);; spin200) env+=(DIST_SPIN_US=200);; spin)
  # The TCP path, 4 ranks, 8 B-32 MiB: 578d457 beside this bundle with DIST_SPIN_US unset
  # (50), 200 and 500, three alternating rounds.
  for i in 1 2 3; do
    for v in old def spin200 spin500; do
      dir="$root/$B"; [ "$v" = old ] && dir="$root/gpu-prev/old"
      env=(DIST_SHM=0)
      case $v in spin200) env+=(DIST_SPIN_US=200);; spin500) env+=(DIST_SPIN_US=500);; esac
      echo "== $v round $i" >> "$OUT/spin.txt"
      env "${env[@]}" DIST_BUNDLE_DIR="$dir" timeout 100 $B/xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check 2>&1 | grep -v '^\[' >> "$OUT/spin.txt"
    done
  done
  tail -n 3 "$OUT/spin.txt"
  ;;
esac
      echo "== $v round $i" >> "$OUT/knobs.txt"
      env "${env[@]}" DIST_BUNDLE_DIR="$dir" timeout 100 $B/xtask perf --op all_reduce -n 4 -b 8M -e 32M -f 2 --check 2>&1 | grep -v '^\[' >> "$OUT/knobs.txt"
    done
  done
  tail -n 5 "$OUT/knobs.txt"
  ;;
spin)
  # The TCP path, 4 ranks, 8 B-32 MiB: 578d457 beside this bundle with DIST_SPIN_US unset
  # (50), 200 and 500, three alternating rounds.
  for i in 1 2 3; do
    for v in old def spin200 spin500; do
      dir="$root/$B"; [ "$v" = old ] && dir="$root/gpu-prev/old"
      env=(DIST_SHM=0)
      case $v in spin200) env+=(DIST_SPIN_US=200);; spin500) env+=(DIST_SPIN_US=500);; esac
      echo "== $v round $i" >> "$OUT/spin.txt"
      env "${env[@]}" DIST_BUNDLE_DIR="$dir" timeout 100 $B/xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check 2>&1 | grep -v '^\[' >> "$OUT/spin.txt"
    done
  done
  tail -n 3 "$OUT/spin.txt"
  ;;
esac
