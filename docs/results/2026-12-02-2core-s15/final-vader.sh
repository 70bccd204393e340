#!/usr/bin/env bash
# This 2-core machine (session 15), the final code: issue 15's sizes, 4 ranks, five alternating
# rounds of dist's defaults and Open MPI's vader, all_reduce, one size a run. From the
# repository root, after `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-final-vader.txt}"
for i in 1 2 3 4 5; do
  for v in dist vader; do
    echo "== $v round $i" >> "$f"
    for s in 8 1M 32M; do
      case $v in
        dist) cargo xtask perf --op all_reduce -n 4 -b $s -e $s --check ;;
        vader) BTL=vader,self benches/peers/run-openmpi.sh -n 4 -b $s -e $s ;;
      esac 2>&1 | grep -v '^\[' | grep -v '^#' >> "$f"
    done
  done
done
