#!/usr/bin/env bash
# This 2-core machine (session 13): the arena's limit where ranks outnumber cores. all_reduce,
# N ranks (4 and 8), 128 KiB-2 MiB (factor 2), three alternating rounds of the rings above
# 128 KiB (DIST_ARENA_MAX_KB=128, the limit before) and the arena up to 2 MiB
# (DIST_ARENA_MAX_KB=2048); DIST_DIRECT=0 in both. From the repository root, after
# `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-arena-limit.txt}"
for n in 4 8; do
  for i in 1 2 3; do
    for v in rings arena; do
      echo "== $v$n round $i" >> "$f"
      case $v in
        rings) kb=128 ;;
        arena) kb=2048 ;;
      esac
      DIST_DIRECT=0 DIST_ARENA_MAX_KB=$kb cargo xtask perf --op all_reduce -n $n -b 128K -e 2M -f 2 --check 2>&1 | grep -v '^\[' >> "$f"
    done
  done
done
