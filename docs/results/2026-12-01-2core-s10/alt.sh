#!/bin/bash
# Alternating 1,024-rank runs: base (521ffe0) and new (d75cce1), three rounds each.
cd /work/main
for round in 1 2 3; do
  for build in base poll2; do
    while [ "$(ss -tan state time-wait | wc -l)" -gt 50 ]; do sleep 5; done
    echo "=== round $round build $build $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    ./target/debug/xtask scale -n 1024 --program /tmp/scale-$build 2>&1 | tail -14
  done
done
