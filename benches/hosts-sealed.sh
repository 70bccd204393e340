#!/usr/bin/env bash
# dist's all_reduce between rate-capped simulated hosts (`dist-run --hosts H --rate R`: network
# namespaces, tc's token bucket filter on each host's eth0), in alternating rounds of two
# variants each (benches/peers/alternate.sh, ROUNDS, default 3), every row checked. Needs root
# and iproute2 with tc.
#
#   benches/hosts-sealed.sh OUTDIR
#
# PARTS (default "seal spread") picks:
# - seal: sealed connections (DIST_SEAL=1) against plain ones, both with the same secret, one
#   rank a host: seal-HxP-RATE.txt for H in HOSTS (default "2 4"), P in SEAL_PER_HOST
#   (default 1), RATE in SEAL_RATES (default 1gbit);
# - spread: two ranks a host, dist's own choice (`dist`) against the flat ring forced
#   (`ring`, DIST_ALL_REDUCE=ring): spread-Hx2-RATE.txt for H in HOSTS, RATE in RATES
#   (default "100mbit 1gbit"); with OLD_PERF (a dist-perf of another build), that build's
#   choice too (`before`).
# Sizes B to E (default 16M to 64M, factor 2 for seal, 4 for spread), ITERS timed calls
# (default 3 under 1 Gbit/s, else 5) after 2 warm-up calls. NO_BUILD=1 takes the binaries as
# they are. Medians: python3 benches/hosts_sealed_table.py OUTDIR.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
out="${1:?usage: $0 OUTDIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
lo="${B:-16M}" hi="${E:-64M}"
cd "$root"
if [ -z "${NO_BUILD:-}" ]; then
    cargo build --release --quiet -p dist-tools --bin dist-perf || exit 1
    cargo build --quiet -p dist-run --bin dist-run || exit 1
fi
run="$root/target/debug/dist-run"
perf="$root/target/release/dist-perf"
alt="$here/peers/alternate.sh"
r0="sed -u 's/^\[r0\] //'"
export DIST_SECRET=hosts-sealed-bench-secret
iters_for() {
    case "$1" in *kbit | [0-9]mbit | [0-9][0-9]mbit | [0-9][0-9][0-9]mbit) echo "${ITERS:-3}" ;; *) echo "${ITERS:-5}" ;; esac
}

parts="${PARTS:-seal spread}"
[[ " $parts " == *" seal "* ]] && for rate in ${SEAL_RATES:-1gbit}; do
    iters="$(iters_for "$rate")"
    for h in ${HOSTS:-2 4}; do
        for p in ${SEAL_PER_HOST:-1}; do
            n=$((h * p))
            link="-n $n --hosts $h --rate $rate --timeout 600"
            f="$out/seal-H${h}x${p}-$rate.txt"
            : >"$f"
            "$alt" "$f" \
                "plain=uptime; DIST_SEAL=0 $run $link -- $perf --op all_reduce -b $lo -e $hi -f 2 --iters $iters --check | $r0" \
                "sealed=uptime; DIST_SEAL=1 $run $link -- $perf --op all_reduce -b $lo -e $hi -f 2 --iters $iters --check | $r0"
        done
    done
done

[[ " $parts " == *" spread "* ]] && for rate in ${RATES:-100mbit 1gbit}; do
    iters="$(iters_for "$rate")"
    for h in ${HOSTS:-2 4}; do
        n=$((h * 2))
        link="-n $n --hosts $h --rate $rate --timeout 600"
        f="$out/spread-H${h}x2-$rate.txt"
        : >"$f"
        variants=(
            "dist=uptime; $run $link -- $perf --op all_reduce -b $lo -e $hi -f 4 --iters $iters --check | $r0"
            "ring=uptime; DIST_ALL_REDUCE=ring $run $link -- $perf --op all_reduce -b $lo -e $hi -f 4 --iters $iters --check | $r0"
        )
        [ -n "${OLD_PERF:-}" ] && variants+=(
            "before=uptime; $run $link -- $OLD_PERF --op all_reduce -b $lo -e $hi -f 4 --iters $iters --check | $r0"
        )
        "$alt" "$f" "${variants[@]}"
    done
done
python3 "$here/hosts_sealed_table.py" "$out"
