#!/usr/bin/env bash
# On the GPU host: the whole GPU suite from the bundle (every nccl_/hybrid_ case), then
# issue 12's side-by-side (cpu.sh shape).
set -u
export NCCL_NVLS_ENABLE=0
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
{ date -u; head -3 bundle-s7/MANIFEST; nproc; nvidia-smi -L; } > "$OUT/s7-info.txt" 2>&1
timeout 400 bundle-s7/run test-multirank --backend nccl --timeout 100 > "$OUT/s7-gpu-suite.txt" 2>&1
echo "exit $?" >> "$OUT/s7-gpu-suite.txt"
grep -E "^test result|FAILED|failed|passed" "$OUT/s7-gpu-suite.txt" | tail -8
