#!/bin/bash
# usage: alt.sh ROUNDS spec...   spec = build[,VAR=val...]  (binaries /tmp/scale-<build>)
cd /work/main
rounds=$1; shift
for round in $(seq 1 $rounds); do
  for spec in "$@"; do
    IFS=, read -ra parts <<< "$spec"
    build=${parts[0]}
    while [ "$(ss -tan state time-wait | wc -l)" -gt 50 ]; do sleep 5; done
    echo "=== round $round $spec $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    env "${parts[@]:1}" python3 - "$build" <<'PY'
import resource, subprocess, sys, time
t = time.time()
out = subprocess.run(["./target/debug/xtask", "scale", "-n", "1024", "--program", f"/tmp/scale-{sys.argv[1]}"],
                     capture_output=True, text=True).stdout
r = resource.getrusage(resource.RUSAGE_CHILDREN)
lines = out.splitlines()
try:
    i = [l.startswith("phase") for l in lines].index(True)
    print("phases " + " | ".join(l.split()[-1] for l in lines[i+1:i+8]))
except ValueError:
    print(out[-2000:])
print(f"cpu user {r.ru_utime:.1f} sys {r.ru_stime:.1f} total {r.ru_utime + r.ru_stime:.1f} s, wall {time.time() - t:.1f} s, vol {r.ru_nvcsw} invol {r.ru_nivcsw} minflt {r.ru_minflt}")
PY
  done
done
