#!/usr/bin/env bash
# Time from a rank's SIGKILL to the next completed step, 4 ranks on this machine: PyTorch's way
# (torchrun --max-restarts 1 restarts every rank, which resume from a checkpoint; Gloo) beside
# dist's (the survivors recover in place: `cargo xtask chaos -n 4` with one kill, its
# "detected after" + "complete ... later"). Alternating rounds; prints one line per run.
#   benches/elastic/compare-torchrun.sh [ROUNDS]   (DIST_TORCH_PYTHON: a python with torch)
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds="${1:-3}"
py="${DIST_TORCH_PYTHON:-python3}"
torchrun="$(dirname "$py")/torchrun"
[ -x "$torchrun" ] || { echo "skipped: no torchrun beside $py"; exit 0; }
cargo build --release --quiet -p dist-tools --bin dist-chaos && cargo build --quiet -p xtask || exit 1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
for i in $(seq "$rounds"); do
    rm -f "$tmp/ckpt"
    CKPT="$tmp/ckpt" KILL_STEP=10 STEPS=20 timeout 300 "$torchrun" --standalone \
        --nproc-per-node 4 --max-restarts 1 --monitor-interval 0.1 \
        benches/elastic/torch_restart_step.py >"$tmp/torch.out" 2>"$tmp/torch.err"
    echo "torch round $i: exit $? $(uptime | sed 's/.*load/load/')"
    python3 - "$tmp/torch.out" <<'PY'
import re, sys
kill = None; after = None
for line in open(sys.argv[1]):
    m = re.search(r"KILL (\S+)", line)
    if m: kill = float(m.group(1))
    m = re.search(r"STEP (\d+) (\S+)", line)
    # The first step the killed rank never took (earlier steps may print after its kill).
    if m and kill is not None and after is None and int(m.group(1)) >= 10:
        after = float(m.group(2))
print(f"  torchrun --max-restarts: kill to next completed step {1e3 * (after - kill):.0f} ms"
      if kill and after else "  torchrun: no kill or no step after it")
PY
    timeout 300 target/debug/xtask chaos -n 4 --minutes 0.25 --min-ranks 3 --stops 0 \
        --seed "$i" >"$tmp/dist.out" 2>&1
    echo "dist round $i: exit $? $(uptime | sed 's/.*load/load/')"
    grep -E "^fault" "$tmp/dist.out" | sed 's/^/  /'
done
