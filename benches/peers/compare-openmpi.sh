#!/usr/bin/env bash
# Side by side: dist's all_reduce (cargo xtask perf) and Open MPI's MPI_Allreduce over TCP on
# loopback, f32 sum, RANKS ranks (default 4), sizes B to E (default 8 to 64M, factor 2),
# alternating ROUNDS times (default 3) so that both see the same machine; prints the median of
# each size as a markdown table with the ratios.
# Needs Debian's openmpi-bin and libopenmpi-dev.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds="${ROUNDS:-3}"
ranks="${RANKS:-4}"
lo="${B:-8}" hi="${E:-64M}"
out="$(mktemp -d)"
cargo build --release --quiet -p dist-tools --bin dist-perf
for i in $(seq "$rounds"); do
    cargo xtask perf --op all_reduce -n "$ranks" -b "$lo" -e "$hi" -f 2 --check >"$out/dist.$i" 2>&1
    benches/peers/run-openmpi.sh -n "$ranks" -b "$lo" -e "$hi" -f 2 >"$out/mpi.$i" 2>&1
done
python3 - "$out" "$rounds" "$ranks" "${DIST_SHM:-1}" <<'PY'
import statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def load(prefix):
    rows = {}
    for i in range(1, rounds + 1):
        for line in open(f"{d}/{prefix}.{i}"):
            f = line.split()
            if len(f) >= 9 and f[0].isdigit():
                rows.setdefault(int(f[0]), []).append((float(f[5]), float(f[7]), f[8]))
    return rows
dist, mpi = load("dist"), load("mpi")
ranks = int(sys.argv[3])
# dist_core::collectives::select, for one lane (this script's machines have fewer than 8 cores).
# With shared memory on (DIST_SHM unset or 1) the ranks of this one host all_reduce on the host
# arena (dist_core::collectives::host) up to the group's limit (in dist-perf's header): whole up
# to 32 KiB, in shares from there; larger buffers as below, over the shared-memory rings.
import re
head = next((l for l in open(f"{d}/dist.1") if l.startswith("# dist perf")), "")
m = re.search(r"host arena up to (\d+) KiB", head)
arena_max = int(m.group(1)) << 10 if m else 0
arena = sys.argv[4] != "0"
algo = lambda b: (("host arena, every rank reduces all" if b <= 32 * 1024
                   else "host arena, a share per rank") if arena and b <= arena_max
                  else "recursive doubling" if b <= 64 * 1024 or b // 4 < ranks
                  else "ring RS+AG, 256 KiB pieces" if ranks < 8 or b // ranks >= 512 * 1024
                  else "recursive halving and doubling")
print("| bytes | dist µs | Open MPI µs | time ratio (MPI/dist) | dist busbw GB/s | Open MPI busbw GB/s | busbw ratio (dist/MPI) | dist verified | dist algorithm |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for b in sorted(set(dist) & set(mpi)):
    dt = statistics.median(x[0] for x in dist[b]); mt = statistics.median(x[0] for x in mpi[b])
    db = statistics.median(x[1] for x in dist[b]); mb = statistics.median(x[1] for x in mpi[b])
    wrong = sum(int(x[2]) for x in dist[b] if x[2].isdigit())
    print(f"| {b} | {dt:.1f} | {mt:.1f} | {mt/dt:.2f} | {db:.3f} | {mb:.3f} | {db/mb if mb else float('nan'):.2f} | {'yes' if wrong == 0 else f'{wrong} wrong'} | {algo(b)} |")
PY
