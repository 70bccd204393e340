#!/usr/bin/env bash
# This 2-core machine (session 15): all_reduce, 4 ranks, 256 KiB-32 MiB (factor 2), five
# alternating rounds of the bundle of 33c91ac (`old`: every rank copies its whole input into
# its arena slot) and of 2f51060 (`new`: all but its own share, and two fewer cache copies a
# chunk in the share's reduction). Bundles made with `cargo xtask bundle --out bundle/NAME`
# (the old one from a worktree of 33c91ac with its own target directory).
set -u
f="${1:-copy-in.txt}"
for i in 1 2 3 4 5; do
  for v in old new; do
    echo "== $v round $i" >> "$f"
    bundle/$v/run perf --op all_reduce -n 4 -b 256K -e 32M -f 2 --check 2>&1 \
      | grep -v '^\[' | grep -v '^\$' | grep -v '^#' >> "$f"
  done
done
