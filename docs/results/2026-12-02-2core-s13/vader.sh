#!/usr/bin/env bash
# This 2-core machine (session 13): all_reduce, 4 ranks, 8 B-32 MiB (factor 2), three
# alternating rounds of dist's defaults (direct reads where ranks outnumber cores), dist with
# DIST_DIRECT=0 (the shared-memory rings above the arena's 128 KiB), and Open MPI's vader.
# From the repository root, after `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-vader4.txt}"
for i in 1 2 3; do
  for v in direct copies vader; do
    echo "== $v round $i" >> "$f"
    case $v in
      direct) cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
      copies) DIST_DIRECT=0 cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
      vader) BTL=vader,self benches/peers/run-openmpi.sh -n 4 -b 8 -e 32M -f 2 ;;
    esac 2>&1 | grep -v '^\[' >> "$f"
  done
done
