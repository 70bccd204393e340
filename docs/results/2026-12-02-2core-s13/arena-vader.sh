#!/usr/bin/env bash
# This 2-core machine (session 13): 4 ranks, all_reduce 128 KiB-8 MiB (factor 2), three
# alternating rounds of the rings above 128 KiB (DIST_ARENA_MAX_KB=128), the arena up to 8 MiB
# (DIST_ARENA_MAX_KB=8192), DIST_DIRECT=0 in both, and Open MPI's vader. From the repository
# root, after `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-arena-vader.txt}"
for i in 1 2 3; do
  for v in rings arena vader; do
    echo "== $v round $i" >> "$f"
    case $v in
      rings) DIST_DIRECT=0 DIST_ARENA_MAX_KB=128 cargo xtask perf --op all_reduce -n 4 -b 128K -e 8M -f 2 --check ;;
      arena) DIST_DIRECT=0 DIST_ARENA_MAX_KB=8192 cargo xtask perf --op all_reduce -n 4 -b 128K -e 8M -f 2 --check ;;
      vader) BTL=vader,self benches/peers/run-openmpi.sh -n 4 -b 128K -e 8M -f 2 ;;
    esac 2>&1 | grep -v '^\[' >> "$f"
  done
done
