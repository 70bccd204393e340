#!/usr/bin/env bash
# dist's store server beside PyTorch's libuv server, in one run on this machine: a storm of
# N concurrent VALIDATE + PING + ADD clients against each, then set + get round trips (1 and 64
# clients, 16 B and 1 MiB values) against each, alternating, ROUNDS times.
#
#   DIST_TORCH_PYTHON=$(cargo xtask torch-venv) crates/dist-store/bench/compare.sh [N] [ROUNDS]
#
# Each server runs in a process of its own (a process may hold 20,000 descriptors here: the
# storm's N client sockets and the server's N need two). PyTorch's server gets STORM_DEADLINE
# seconds (default 300) for its storm; the answers it gave by then are reported.
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
start dist "$B" serve; DP=$(cat "$tmp/dist.port")
echo "# storms: $N clients"
echo "dist:  $("$B" storm 127.0.0.1:"$DP" "$N" 600)"
start libuv "$PY" crates/dist-store/tests/py/torch_server.py libuv; TP=$(cat "$tmp/libuv.port")
echo "libuv: $("$B" storm 127.0.0.1:"$TP" "$N" "$DEADLINE" 2>/dev/null)"
# The storm leaves PyTorch's server busy with its leftovers: a fresh one for the round trips.
start libuv2 "$PY" crates/dist-store/tests/py/torch_server.py libuv; TP=$(cat "$tmp/libuv2.port")
echo "# round trips (set + get pairs a second), alternating, $ROUNDS rounds of 4 s"
for r in $(seq "$ROUNDS"); do
  for size in 16 1048576; do
    for c in 1 64; do
      echo "round $r dist:  $("$B" roundtrips 127.0.0.1:"$DP" "$c" "$size" 4)"
      echo "round $r libuv: $("$B" roundtrips 127.0.0.1:"$TP" "$c" "$size" 4)"
    done
  done
done
