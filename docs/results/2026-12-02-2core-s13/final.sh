#!/usr/bin/env bash
# This 2-core machine (written in session 12, run in session 13 on commit bf6f62e's code): all_reduce, 4 ranks, 8 B-32 MiB
# (factor 2), three alternating rounds of 578d457's dist-perf (the code before issue 12's split,
# built in a worktree of its own, its binary in OLD_DIR), this build's defaults (direct reads:
# 4 ranks on 2 cores) this build with DIST_DIRECT=0, and with DIST_SHM=0 (loopback TCP). From the repository root, after
# `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-final4.txt}" old="${OLD_DIR:-/tmp/oldbin}"
for i in 1 2 3; do
  for v in old direct copies tcp; do
    echo "== $v round $i" >> "$f"
    case $v in
      old) DIST_BUNDLE_DIR="$old" cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
      direct) cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
      copies) DIST_DIRECT=0 cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
      tcp) DIST_SHM=0 cargo xtask perf --op all_reduce -n 4 -b 8 -e 32M -f 2 --check ;;
    esac 2>&1 | grep -v '^\[' >> "$f"
  done
done
