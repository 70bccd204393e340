#!/usr/bin/env bash
# dist-nccl's one-GPU cases and the CUDA-graph tables, from release binaries, on a host with a
# GPU, torch's NCCL and no Rust toolchain. Made where cargo is:
#   cargo test --release -p dist-nccl --test gpu --no-run   # prints target/release/deps/gpu-HASH
#   cargo build --release -p dist-nccl --examples
#   mkdir -p target/gbundle && cp target/release/deps/gpu-HASH target/gbundle/gpu \
#     && cp target/release/examples/graph_step target/release/examples/graph_perf target/gbundle/
# then, there: benches/gpu-graph-run.sh target/gbundle [OUT]. Optional in the folder:
# hybrid_gpu (dist-hybrid's one-GPU cases: `cargo test --release -p dist-hybrid --test gpu
# --no-run`); gpu_without_watchdog_fix (the gpu binary built with another watchdog.rs), whose case
# graph_captured_right_after_eager_calls is run and expected to fail; MANIFEST (copied into
# machine.txt). PERF_ARGS (default "64 200"): graph_perf's calls a graph and replays.
set -uo pipefail
dir="$(cd "${1:?usage: gpu-graph-run.sh DIR [OUT]}" && pwd)"
out="${2:-${OUT:-./gpu-graph-out}}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
nccl=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$nccl" ] && [ -f "$nccl" ]; then export DIST_NCCL_LIBRARY="$nccl"; fi
{
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    echo "DIST_NCCL_LIBRARY=${DIST_NCCL_LIBRARY:-<system>}"; cat "$dir/MANIFEST" 2>/dev/null
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
status=0
echo "== gpu --test-threads 1"
timeout 240 "$dir/gpu" --test-threads 1 > "$out/gpu-tests.txt" 2>&1 || status=1
tail -40 "$out/gpu-tests.txt"
if [ -x "$dir/gpu_without_watchdog_fix" ]; then
    echo "== gpu_without_watchdog_fix graph_captured_right_after_eager_calls (must fail)"
    timeout 120 "$dir/gpu_without_watchdog_fix" --test-threads 1 \
        graph_captured_right_after_eager_calls > "$out/gpu-without-watchdog-fix.txt" 2>&1
    echo "exit $?" >> "$out/gpu-without-watchdog-fix.txt"
    tail -15 "$out/gpu-without-watchdog-fix.txt"
fi
if [ -x "$dir/hybrid_gpu" ]; then
    echo "== hybrid_gpu --test-threads 1"
    timeout 240 "$dir/hybrid_gpu" --test-threads 1 > "$out/hybrid-gpu-tests.txt" 2>&1 || status=1
    tail -30 "$out/hybrid-gpu-tests.txt"
fi
echo "== graph_step"
timeout 120 "$dir/graph_step" > "$out/graph_step.txt" 2>&1 || status=1
cat "$out/graph_step.txt"
echo "== graph_perf ${PERF_ARGS:-64 200}"
# shellcheck disable=SC2086
timeout 240 "$dir/graph_perf" ${PERF_ARGS:-64 200} > "$out/graph_perf.txt" 2>&1 || status=1
cat "$out/graph_perf.txt"
exit $status
