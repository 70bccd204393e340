#!/bin/bash
# Session 9 on the lent host: 1,024 and 256 ranks of the scale example (no GPU used).
set -u
B=gpu-s9
export NCCL_NVLS_ENABLE=0
nproc; uptime; ulimit -n 65536 2>/dev/null; ulimit -n; cat /proc/sys/kernel/pid_max
for n in 256 1024 1024 1024; do
  echo "== scale -n $n ($(date -u +%H:%M:%S))"
  $B/xtask scale -n $n --program $B/scale 2>&1 | tail -14
  for s in $(seq 60); do tw=$(ss -s | grep -o 'timewait [0-9]*' | grep -o '[0-9]*'); [ "${tw:-0}" -lt 50 ] && break; sleep 1; done
done > $OUT/scale-16core.txt 2>&1
cat $OUT/scale-16core.txt | grep -E "^==|^total|^error|formation|barrier|all_reduce"
