#!/usr/bin/env bash
# dist's all_reduce beside Open MPI's shared memory (vader) on this host: f32 sum in place,
# sizes B to E (default 8 to 32M) by factor F (default 4), for each rank count of RANKS
# (default: 4, 8, 16 and this host's core count; more ranks than cores run oversubscribed, as
# run-openmpi.sh does), ROUNDS alternating rounds (default 3: dist, then vader, then again) so that
# both see the machine as it is; every dist result checked. Prints, per size, vader's time over
# dist's (above 1: dist is faster) and the two medians in µs, a column per rank count, then
# the algorithm dist took per size. The raw rounds stay in OUT (default: a new temporary
# folder), one file per rank count, readable by benches/peers/medians.py.
#
#   benches/peers/compare-vader.sh
#   RANKS="4 8" ROUNDS=5 B=8 E=64K F=2 benches/peers/compare-vader.sh
#
# dist: `cargo xtask perf`, or DIST_PERF (say `bundle/run perf` on a host without a Rust
# toolchain: benches/peers/perf-bundle.sh makes the smallest such bundle). BASE_PERF, where
# set, is a second dist (another commit's bundle, `base/run perf`) run in the same rounds:
# then a second table, its time over dist's. Open MPI: mpirun with `--mca btl vader,self` and
# its default binding, running benches/peers/mpi_allreduce.c, built with mpicc unless MPI_BIN
# names a binary built already (one built against Open MPI 4.1.4 runs with 4.1.6). Extra mpirun
# arguments: MPIRUN_ARGS. Each command is stopped after LIMIT seconds (default 300).
#
# Last, for each dist and rank count, the sizes where a call took less time than the size before
# it (beyond 10 %): a choice of algorithm made at the wrong size.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
rounds="${ROUNDS:-3}"
lo="${B:-8}" hi="${E:-32M}" factor="${F:-4}"
cores="$(nproc)"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"

ranks=()
for n in ${RANKS:-4 8 16 $cores}; do
    case " ${ranks[*]-} " in *" $n "*) continue ;; esac
    ranks+=("$n")
done

dist="${DIST_PERF:-cargo xtask perf}"
if [ -z "${DIST_PERF:-}" ]; then
    cargo build --release --quiet -p dist-tools --bin dist-perf
fi
mpi="${MPI_BIN:-}"
if [ -z "$mpi" ]; then
    mpi="$out/mpi_allreduce"
    mpicc -O2 -o "$mpi" "$here/mpi_allreduce.c"
fi
sizes=(-b "$lo" -e "$hi" -f "$factor")

limit="${LIMIT:-300}"
for n in "${ranks[@]}"; do
    echo "# $n ranks: $rounds alternating rounds into $out/n$n.txt" >&2
    : >"$out/n$n.txt"
    variants=("dist=timeout $limit $dist --backend tcp --op all_reduce -n $n ${sizes[*]} --check")
    if [ -n "${BASE_PERF:-}" ]; then
        variants+=("base=timeout $limit $BASE_PERF --backend tcp --op all_reduce -n $n ${sizes[*]} --check")
    fi
    variants+=("vader=timeout $limit mpirun --allow-run-as-root --oversubscribe -np $n \
--mca btl vader,self ${MPIRUN_ARGS:-} $mpi ${sizes[*]}")
    ROUNDS="$rounds" "$here/alternate.sh" "$out/n$n.txt" "${variants[@]}" >/dev/null
done

echo "# all_reduce f32 sum in place, one host ($cores cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(date -u +%F) $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "# dist: $dist${BASE_PERF:+; base: $BASE_PERF}"
echo "# medians of $rounds alternating rounds; files in $out"
python3 - "$out" "${ranks[@]}" <<'PY'
import statistics, sys
sys.path.insert(0, "benches/peers")
from medians import read

out, ranks = sys.argv[1], [int(n) for n in sys.argv[2:]]
cols = {}
algos = {}
wrong = []
for n in ranks:
    path = f"{out}/n{n}.txt"
    times, _ = read(path)
    cols[n] = times
    # dist's rows: the wrong-element count (column 9) and the algorithm (the rest of the line).
    variant = None
    for line in open(path):
        if line.startswith("== "):
            variant = line.split()[1]
            continue
        f = line.split()
        if variant not in ("dist", "base") or len(f) < 9 or not (f[0].isdigit() and f[1].isdigit()):
            continue
        if f[8] not in ("0", "N/A"):
            wrong.append(f"{variant}, {n} ranks, {f[0]} B: {f[8]} wrong")
        if len(f) > 9 and variant == "dist":
            algos.setdefault(int(f[0]), {})[n] = " ".join(f[9:])

def us(t):
    return f"{t:.2f}" if t < 10 else f"{t:,.1f}"

def size(b):
    for unit, s in ((1 << 20, "MiB"), (1 << 10, "KiB")):
        if b >= unit and b % unit == 0:
            return f"{b // unit} {s}"
    return f"{b} B"

def table(other, label):
    print()
    print(f"{label}'s time ÷ dist's (above 1: dist is faster), then {label} µs vs dist µs:")
    print()
    print("| bytes | " + " | ".join(f"{n} ranks" for n in ranks) + " |")
    print("| ---: " * (len(ranks) + 1) + "|")
    for b in sorted(set().union(*(cols[n].keys() for n in ranks))):
        cells = []
        for n in ranks:
            t = cols[n].get(b, {})
            if t.get("dist") and t.get(other):
                d, v = statistics.median(t["dist"]), statistics.median(t[other])
                cells.append(f"{v / d:.2f} ({us(v)} vs {us(d)})")
            else:
                cells.append("–")
        print(f"| {size(b)} | " + " | ".join(cells) + " |")

table("vader", "vader")
has_base = any(t.get("base") for n in ranks for t in cols[n].values())
if has_base:
    table("base", "base")
if algos:
    print()
    print("dist's algorithm:")
    print()
    print("| bytes | " + " | ".join(f"{n} ranks" for n in ranks) + " |")
    print("| ---: " + "| --- " * len(ranks) + "|")
    for b in sorted(algos):
        print(f"| {size(b)} | " + " | ".join(algos[b].get(n, "–") for n in ranks) + " |")
print()
for v in ["dist"] + (["base"] if has_base else []):
    dips = []
    for n in ranks:
        last = None
        for b in sorted(cols[n]):
            t = cols[n][b].get(v)
            if not t:
                continue
            m = statistics.median(t)
            if last is not None and m < 0.9 * last[1]:
                dips.append(f"{n} ranks: {size(last[0])} {us(last[1])} µs, {size(b)} {us(m)} µs")
            last = (b, m)
    print(f"{v}: time falls as the size rises at: " + ("; ".join(dips) if dips else "none"))
if wrong:
    print()
    print("dist results WRONG: " + "; ".join(wrong))
    sys.exit(1)
PY
