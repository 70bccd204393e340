#!/usr/bin/env bash
# The whole GPU run, from a bundle (`cargo xtask bundle`), on a host with 2+ GPUs, torch and
# NCCL installed, no Rust toolchain: the NCCL multi-rank tests, dist-nccl's tables (with a
# bare ncclAllReduce loop in the same program), PyTorch's NCCL and Gloo tables, and dist's TCP
# table on the same CPUs. Writes every table to OUT (default ./gpu-out).
#   benches/gpu-run.sh BUNDLE_DIR [OUT]
set -uo pipefail
bundle="$(cd "${1:-bundle}" && pwd)"
out="${2:-${OUT:-./gpu-out}}"
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
n=$(( ngpu < 2 ? 2 : ngpu ))
# The NCCL PyTorch ships (2.28.9), so both sides run the same library.
torch_nccl=$(python3 -c 'import os, nvidia.nccl as m; print(os.path.join(list(m.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$torch_nccl" ] && [ -f "$torch_nccl" ]; then export DIST_NCCL_LIBRARY="$torch_nccl"; fi
{
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    echo "DIST_NCCL_LIBRARY=${DIST_NCCL_LIBRARY:-<system>}"; cat "$bundle/MANIFEST"
} > "$out/machine.txt" 2>&1
status=0
"$bundle/run" test-multirank --backend nccl -n "$n" 2>&1 | tee "$out/nccl-tests.log" | grep -E "^test |passed|failed|skipped" || true
grep -q " 0 failed" "$out/nccl-tests.log" || status=1
# The training example through the launcher and through torchrun (which runs binaries with
# --no-python).
"$bundle/run" run -n "$n" --example train > "$out/train.log" 2>&1 || status=1
echo "--- torchrun" >> "$out/train.log"
(cd "$bundle" && torchrun --no-python --nproc-per-node "$n" ./train) >> "$out/train.log" 2>&1 || status=1
# Every table goes into one file (the device tool brings back few files), each under a header.
tables="$out/tables.txt"
: > "$tables"
section() { echo; echo "## $*"; } >> "$tables"
for op in all_reduce all_gather sendrecv reduce_scatter broadcast; do
    extra=""; [ "$op" = all_reduce ] && extra="--bare"
    section "dist-nccl $op, $n GPUs: run perf --backend nccl --op $op -n $n -b 8 -e 1G -f 4 --check $extra"
    "$bundle/run" perf --backend nccl --op "$op" -n "$n" -b 8 -e 1G -f 4 --check $extra 2>&1 | grep -v "^\[" >> "$tables" || status=1
    if [ "$op" = all_reduce ]; then
        section "torch nccl all_reduce, $n GPUs: torch_allreduce.py --backend nccl -n $n -b 8 -e 1G -f 4"
        python3 "$bundle/torch_allreduce.py" --backend nccl -n "$n" -b 8 -e 1G -f 4 2>&1 | grep -v Warning | grep -v "return func" >> "$tables" || status=1
    fi
done
# CPU side: Gloo beside dist's TCP all_reduce, 4 ranks, on this host's CPUs.
section "dist tcp all_reduce, 4 CPU ranks: run perf --backend tcp --op all_reduce -n 4 -b 8 -e 64M -f 4 --check"
"$bundle/run" perf --backend tcp --op all_reduce -n 4 -b 8 -e 64M -f 4 --check 2>&1 | grep -v "^\[" >> "$tables" || status=1
section "torch gloo all_reduce, 4 CPU ranks: torch_allreduce.py --backend gloo -n 4 -b 8 -e 64M -f 4"
python3 "$bundle/torch_allreduce.py" --backend gloo -n 4 -b 8 -e 64M -f 4 2>&1 | grep -v Warning | grep -v "return func" >> "$tables" || status=1
exit $status
