#!/usr/bin/env bash
# On a lent GPU host: dist-nccl's and dist-hybrid's GPU cases (release binaries) with torch's NCCL,
# and shrink_after_a_timeout on a build without the kept-handle fix (must fail).
set -u
export NCCL_NVLS_ENABLE=0
d="$(cd "$(dirname "$0")" && pwd)"
nccl=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$nccl" ] && [ -f "$nccl" ]; then export DIST_NCCL_LIBRARY="$nccl"; fi
{ date -u; nvidia-smi -L; echo "DIST_NCCL_LIBRARY=${DIST_NCCL_LIBRARY:-<system>}"; python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'; } > "$OUT/gpu-machine.txt" 2>&1
cat "$OUT/gpu-machine.txt"
echo "== dist-nccl gpu"
timeout 200 "$d/gpu" --test-threads 1 > "$OUT/gpu-nccl.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-nccl.txt"
grep -E '^test |skipped|result|exit|panicked|FAILED' "$OUT/gpu-nccl.txt" | head -60
echo "== without the kept-handle fix: shrink_after_a_timeout (must fail)"
timeout 60 "$d/gpu_nofix" --test-threads 1 shrink_after_a_timeout > "$OUT/gpu-nofix.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-nofix.txt"
tail -8 "$OUT/gpu-nofix.txt"
echo "== dist-hybrid gpu"
timeout 150 "$d/hybrid" --test-threads 1 > "$OUT/gpu-hybrid.txt" 2>&1; echo "exit $?" >> "$OUT/gpu-hybrid.txt"
grep -E '^test |skipped|result|exit|panicked|FAILED' "$OUT/gpu-hybrid.txt" | head -40
