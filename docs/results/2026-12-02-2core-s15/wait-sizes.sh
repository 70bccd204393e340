#!/usr/bin/env bash
# all_reduce 4 ranks, 8 B, 4 KiB, 64 KiB, 256 KiB and 1 MiB (the arena's sizes where ranks
# outnumber cores), ROUNDS (default 5) alternating rounds of bundle/v1 and bundle/v3 (see
# wait-8b.sh; or VARIANTS). PIN=1 binds the ranks to cores 0 and 1. From the repository root.
set -u
f="${1:-wait-sizes.txt}"
pin=(); [ "${PIN:-0}" = 1 ] && pin=(taskset -c 0,1)
for i in $(seq 1 ${ROUNDS:-5}); do
  for v in ${VARIANTS:-v1 v3}; do
    echo "== $v round $i" >> "$f"
    for s in 8 4K 64K 256K 1M; do
      "${pin[@]}" timeout 60 bundle/$v/run perf --op all_reduce -n 4 -b $s -e $s --check 2>&1 \
        | grep -v -e '^\[' -e '^#' >> "$f"
    done
  done
done
grep -c "^==" "$f"
