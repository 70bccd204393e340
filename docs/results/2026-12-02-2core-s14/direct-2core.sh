#!/usr/bin/env bash
# This 2-core machine (session 14), where process_vm_readv copies at about 0.7 of memmove's
# rate (so the defaults read directly from 256 KiB where ranks outnumber cores): all_reduce,
# 4 ranks, 256 KiB-32 MiB (factor 2), three alternating rounds of the defaults and
# DIST_DIRECT=0 (the arena's copies to 1 MiB, the rings above). From the repository root,
# after `cargo build --release -p xtask -p dist-tools`.
set -u
f="${1:-direct-2core.txt}"
for i in 1 2 3; do
  for v in defaults copies; do
    echo "== $v round $i" >> "$f"
    case $v in
      defaults) cargo xtask perf --op all_reduce -n 4 -b 256K -e 32M -f 2 --check ;;
      copies) DIST_DIRECT=0 cargo xtask perf --op all_reduce -n 4 -b 256K -e 32M -f 2 --check ;;
    esac 2>&1 | grep -v '^\[' | grep -v '^\$' >> "$f"
  done
done
