#!/usr/bin/env bash
# dist's store server beside PyTorch's libuv server, in one run on this machine: a storm of
# N concurrent VALIDATE + PING + ADD clients against each, then set + get round trips (1 and 64
# clients, 16 B and 1 MiB values) against each, alternating, ROUNDS times.
#
#   DIST_TORCH_PYTHON=$(cargo xtask torch-venv) crates/dist-store/bench/compare.sh [N] [ROUNDS]
#
# Each server runs in a process of its own (a process may hold 20,000 descriptors here: the
# storm's N client sockets and the server's N need two). PyTorch's server gets STORM_DEADLINE
# seconds (default 300) for its storm; the answers it gave by then are reported. N=0 skips the
# storms. Each round-trip line ends with the server's CPU time (user + system, from /proc) a
# pair. Then dist's client beside PyTorch's (torch_roundtrips.py), both against dist's server.
# OLD=PATH (a store_load built from another commit) adds that build's server to the round trips
# as "old".
set -euo pipefail
cd "$(dirname "$0")/../../.."
N=${1:-10000}
ROUNDS=${2:-3}
PY=${DIST_TORCH_PYTHON:-python3}
DEADLINE=${STORM_DEADLINE:-300}
cargo build --release -q -p dist-store --example store_load
B=target/release/examples/store_load
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT

start() { # start NAME CMD...: runs CMD with stdin held open, waits for the port it prints
  # (into $tmp/NAME.port). Not in a $(...) subshell: the pids must reach the cleanup.
  local name=$1; shift
  mkfifo "$tmp/$name.in"
  "$@" < "$tmp/$name.in" > "$tmp/$name.port" 2>"$tmp/$name.err" &
  pids+=($!)
  sleep 100000 > "$tmp/$name.in" &
  pids+=($!)
  for _ in $(seq 120); do [ -s "$tmp/$name.port" ] && break; sleep 1; done
}

echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) host $(hostname) cpus $(nproc) load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
start dist "$B" serve; DP=$(cat "$tmp/dist.port"); DPID=${pids[-2]}
if [ "$N" -gt 0 ]; then
  echo "# storms: $N clients"
  echo "dist:  $("$B" storm 127.0.0.1:"$DP" "$N" 600)"
  start libuv "$PY" crates/dist-store/tests/py/torch_server.py libuv; TP=$(cat "$tmp/libuv.port")
  echo "libuv: $("$B" storm 127.0.0.1:"$TP" "$N" "$DEADLINE" 2>/dev/null)"
fi
# The storm leaves PyTorch's server busy with its leftovers: a fresh one for the round trips.
start libuv2 "$PY" crates/dist-store/tests/py/torch_server.py libuv; TP=$(cat "$tmp/libuv2.port"); TPID=${pids[-2]}
if [ -n "${OLD:-}" ]; then start old "$OLD" serve; OP=$(cat "$tmp/old.port"); OPID=${pids[-2]}; fi

cpu_ticks() { # user + system clock ticks of process $1
  awk '{print $14 + $15}' "/proc/$1/stat"
}
timed() { # timed PID CMD...: runs CMD, appends server PID's CPU µs a pair
  local pid=$1 before after out pairs
  shift
  before=$(cpu_ticks "$pid")
  out=$("$@")
  after=$(cpu_ticks "$pid")
  pairs=$(sed -n 's/.* pairs=\([0-9]*\).*/\1/p' <<<"$out")
  echo "$out server_cpu_us_per_pair=$(awk -v t=$((after - before)) -v p="$pairs" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.1f", p ? t * 1e6 / hz / p : 0 }')"
}
echo "# round trips (set + get pairs a second), alternating, $ROUNDS rounds of 4 s"
for r in $(seq "$ROUNDS"); do
  for size in 16 1048576; do
    for c in 1 64; do
      echo "round $r dist:  $(timed "$DPID" "$B" roundtrips 127.0.0.1:"$DP" "$c" "$size" 4)"
      echo "round $r libuv: $(timed "$TPID" "$B" roundtrips 127.0.0.1:"$TP" "$c" "$size" 4)"
      if [ -n "${OLD:-}" ]; then
        echo "round $r old:   $(timed "$OPID" "$B" roundtrips 127.0.0.1:"$OP" "$c" "$size" 4)"
      fi
    done
  done
done
echo "# clients side by side against dist's server, alternating, $ROUNDS rounds of 4 s"
for r in $(seq "$ROUNDS"); do
  for size in 16 1048576; do
    for c in 1 64; do
      echo "round $r dist client:    $("$B" roundtrips 127.0.0.1:"$DP" "$c" "$size" 4)"
      echo "round $r pytorch client: $("$PY" crates/dist-store/bench/torch_roundtrips.py 127.0.0.1 "$DP" "$c" "$size" 4 2>/dev/null)"
    done
  done
done
