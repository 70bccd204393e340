#!/usr/bin/env bash
# all_reduce between simulated hosts whose links are capped at a rate (`dist-run --hosts H
# --rate R`: network namespaces, tc's token bucket filter on each host's eth0), dist's
# (`dist-perf`) beside PyTorch's Gloo (torch_allreduce.py) and Open MPI (peers/openmpi-hosts.sh),
# all started by dist-run on the same kind of hosts, every rank under `ip netns exec` in its
# host's namespace. f32 sum in place. Needs root, iproute2 with tc, python3 with torch (PYTHON)
# and Open MPI (Debian's openmpi-bin, libopenmpi-dev).
#
#   benches/hosts-allreduce.sh OUTDIR
#
# Writes to OUTDIR, by alternating rounds (benches/peers/alternate.sh, ROUNDS, default 3), each
# section starting with the machine's load (uptime):
# - bw-HxP-RATE.txt for every H in HOSTS (default "2 4"), P ranks per host in PER_HOST
#   (default "1 2") and RATE in RATES (default "100mbit 1gbit"): sizes B to E (default 1M to
#   16M, factor 4), ITERS timed calls (default 3 at rates under 1 Gbit/s, else 10);
# - ceiling-H2x1-RATE.txt for every RATE in CEILING (default "2gbit 4gbit 8gbit none"; none:
#   no cap): dist alone at E, 10 calls, to find the highest rate this CPU sustains;
# - latency-H4x1.txt: 8 B on 4 hosts 0.1 ms apart (the delay hub), capped at 1 Gbit/s,
#   1000 calls.
# PARTS (default "bw ceiling latency") picks which of the three run; NO_BUILD=1 takes the
# binaries as they are. Then prints the tables
# (benches/hosts_table.py OUTDIR).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="${1:?usage: $0 OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
py="${PYTHON:-python3}"
lo="${B:-1M}" hi="${E:-16M}"
cd "$root"
if [ -z "${NO_BUILD:-}" ]; then
    cargo build --release --quiet -p dist-tools --bin dist-perf || exit 1
    cargo build --quiet -p dist-run --bin dist-run || exit 1
fi
run="$root/target/debug/dist-run"
perf="$root/target/release/dist-perf"
torch="$here/peers/torch_allreduce.py"
alt="$here/peers/alternate.sh"
mpi="$here/peers/openmpi-hosts.sh"
# dist-run prefixes rank 0's lines too; the table rows are rank 0's.
r0="sed -u 's/^\[r0\] //'"
export GLOO_SOCKET_IFNAME=eth0

parts="${PARTS:-bw ceiling latency}"
[[ " $parts " == *" bw "* ]] && for rate in ${RATES:-100mbit 1gbit}; do
    case "$rate" in *kbit | [0-9]mbit | [0-9][0-9]mbit | [0-9][0-9][0-9]mbit) iters=3 ;; *) iters=10 ;; esac
    iters="${ITERS:-$iters}"
    for h in ${HOSTS:-2 4}; do
        for p in ${PER_HOST:-1 2}; do
            n=$((h * p))
            link="-n $n --hosts $h --rate $rate --timeout 600"
            f="$out/bw-H${h}x${p}-$rate.txt"
            : >"$f"
            "$alt" "$f" \
                "dist=uptime; $run $link -- $perf --op all_reduce -b $lo -e $hi -f 4 --iters $iters --check | $r0" \
                "gloo=uptime; $run $link -- $py $torch --backend gloo -n $n -b $lo -e $hi -f 4 --iters $iters | $r0" \
                "openmpi=uptime; $run -n 1 --hosts $h --rate $rate --timeout 600 -- $mpi $h $p -b $lo -e $hi -f 4 --iters $iters | $r0"
        done
    done
done

[[ " $parts " == *" ceiling "* ]] && for rate in ${CEILING:-2gbit 4gbit 8gbit none}; do
    cap="--rate $rate"
    [ "$rate" = none ] && cap=""
    f="$out/ceiling-H2x1-$rate.txt"
    : >"$f"
    "$alt" "$f" \
        "dist=uptime; $run -n 2 --hosts 2 $cap --timeout 600 -- $perf --op all_reduce -b $hi -e $hi --iters 10 --check | $r0"
done

f="$out/latency-H4x1.txt"
link="-n 4 --hosts 4 --rate 1gbit --delay-ms 0.1 --timeout 600"
[[ " $parts " == *" latency "* ]] && : >"$f" && "$alt" "$f" \
    "dist=uptime; $run $link -- $perf --op all_reduce -b 8 -e 8 --iters 1000 --check | $r0" \
    "gloo=uptime; $run $link -- $py $torch --backend gloo -n 4 -b 8 -e 8 --iters 1000 | $r0" \
    "openmpi=uptime; $run -n 1 --hosts 4 --rate 1gbit --delay-ms 0.1 --timeout 600 -- $mpi 4 1 -b 8 -e 8 --iters 1000 | $r0"

"$py" "$here/hosts_table.py" "$out"
