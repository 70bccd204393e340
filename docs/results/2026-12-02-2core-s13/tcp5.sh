#!/usr/bin/env bash
# This 2-core machine (session 13): issue 12's sizes over loopback TCP alone, five alternating
# rounds of 578d457's dist-perf (OLD_DIR, as final.sh) and this build's with DIST_SHM=0,
# all_reduce, 4 ranks, one size a run. From the repository root, after
# `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-tcp5.txt}" old="${OLD_DIR:-/tmp/oldbin}"
for i in 1 2 3 4 5; do
  for v in old tcp; do
    echo "== $v round $i" >> "$f"
    for s in 8 64K 1M 32M; do
      case $v in
        old) DIST_BUNDLE_DIR="$old" cargo xtask perf --op all_reduce -n 4 -b $s -e $s --check ;;
        tcp) DIST_SHM=0 cargo xtask perf --op all_reduce -n 4 -b $s -e $s --check ;;
      esac 2>&1 | grep -v '^\[' | grep -v '^#' >> "$f"
    done
  done
done
