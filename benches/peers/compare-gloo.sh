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
    cargo build --release --quiet -p dist-multirank --bin dist-perf
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
python3 - "$out" "$rounds" "$ranks" <<'PY'
import re, statistics, sys
d, rounds, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(prefix):
    rows, head = {}, ""
    for i in range(1, rounds + 1):
        for line in open(f"{d}/{prefix}.{i}"):
            f = line.split()
            if line.startswith("# dist perf"):
                head = line
            if len(f) >= 9 and f[0].isdigit():
                rows.setdefault(int(f[0]), []).append((float(f[5]), float(f[7]), f[8]))
    return rows, head
(dist, head), (gloo, _) = load("dist"), load("gloo")
m = re.search(r"ring pieces of (\d+) KiB, (\d+) lane", head)
piece, lanes = (int(m.group(1)), int(m.group(2))) if m else (256, 1)
def algo(b):
    if b <= 64 * 1024:
        return "recursive doubling"
    rings = "two rings (opposite directions)" if lanes >= 2 and b >= (1 << 20) and ranks >= 3 else "one ring"
    return f"{rings} RS+AG, {piece} KiB pieces"
print()
print("| bytes | dist µs | Gloo µs | time ratio (Gloo/dist) | dist busbw GB/s | Gloo busbw GB/s | busbw ratio (dist/Gloo) | dist verified | dist algorithm |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for b in sorted(set(dist) & set(gloo)):
    dt = statistics.median(x[0] for x in dist[b]); gt = statistics.median(x[0] for x in gloo[b])
    db = statistics.median(x[1] for x in dist[b]); gb = statistics.median(x[1] for x in gloo[b])
    wrong = sum(int(x[2]) for x in dist[b] if x[2].isdigit())
    ratio = f"{db/gb:.2f}" if gb > 0 else "–"
    print(f"| {b} | {dt:.1f} | {gt:.1f} | {gt/dt:.2f} | {db:.3f} | {gb:.3f} | {ratio} | {'yes' if wrong == 0 else f'{wrong} wrong'} | {algo(b)} |")
PY
