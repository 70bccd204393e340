#!/usr/bin/env bash
# Alternating rounds of several variants of one measurement, so that every variant sees the
# machine as it is at the time: ROUNDS rounds (default 3), each running every variant in the
# order given, and appending to FILE, for each, a line `== NAME round I HH:MM:SS` (UTC) and
# its output, without the launcher's `[rank]` log lines and Python's warnings. Prints the
# number of sections in FILE. Medians per size of such a file: benches/peers/medians.py.
#   benches/peers/alternate.sh FILE NAME=COMMAND [NAME=COMMAND ...]
# COMMAND runs under `bash -c` (so `VAR=value cmd`, pipes and `;` work); a failing or
# time-limited command leaves its section short and the rounds go on.
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 FILE NAME=COMMAND [NAME=COMMAND ...]" >&2
    exit 2
fi
file="$1"
shift
for i in $(seq "${ROUNDS:-3}"); do
    for v in "$@"; do
        echo "== ${v%%=*} round $i $(date -u +%T)" >>"$file"
        bash -c "${v#*=}" 2>&1 | grep -v -e '^\[' -e Warning -e 'return func' >>"$file"
    done
done
grep -c '^==' "$file"
