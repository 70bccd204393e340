#!/usr/bin/env bash
# Side by side: dist's TCP all_reduce (`perf --backend tcp`) and PyTorch's Gloo all_reduce
# (torch_allreduce.py --backend gloo), f32 sum in place, RANKS ranks (default 4) on this host's
# CPUs, sizes B to E (default 8 to 64M, factor 4), alternating ROUNDS times (default 3) so that
# both see the same machine; prints each side's median per size as a markdown table with the
# ratios. Needs python3 with torch. Runs from a checkout (cargo xtask perf) or, given a bundle
# directory (`cargo xtask bundle`), from the bundle with no Rust toolchain:
#   benches/peers/compare-gloo.sh [BUNDLE_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
rounds="${ROUNDS:-3}" ranks="${RANKS:-4}" lo="${B:-8}" hi="${E:-64M}"
if [ $# -gt 0 ]; then
    bundle="$(cd "$1" && pwd)"
    perf=("$bundle/run" perf) torch_script="$bundle/torch_allreduce.py"
else
    cd "$here/../.."
    cargo build --release --quiet -p dist-tools --bin dist-perf
    perf=(cargo xtask perf) torch_script="$here/torch_allreduce.py"
fi
out="$(mktemp -d)"
for i in $(seq "$rounds"); do
    "${perf[@]}" --backend tcp --op all_reduce -n "$ranks" -b "$lo" -e "$hi" -f 4 --check \
        2>&1 | grep -v '^\[' >"$out/dist.$i"
    python3 "$torch_script" --backend gloo -n "$ranks" -b "$lo" -e "$hi" -f 4 2>&1 \
        | grep -v -e Warning -e 'return func' >"$out/gloo.$i"
done
for i in $(seq "$rounds"); do echo "== dist round $i"; cat "$out/dist.$i"; echo "== gloo round $i"; cat "$out/gloo.$i"; done
python3 "$here/gloo_table.py" "$out" "$rounds" "$ranks"
