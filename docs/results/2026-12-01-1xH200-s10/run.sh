#!/bin/bash
# Session 10 on the lent host: 1,024 ranks of the scale example, 521ffe0 (base) and d75cce1
# (receivers wait in poll on their socket), alternating, with the job's CPU time (no GPU used).
set -u
B=gpu-s10
export NCCL_NVLS_ENABLE=0
nproc; uptime; ulimit -n 65536 2>/dev/null; ulimit -n
for round in 1 2 3; do
  for build in base poll; do
    for s in $(seq 90); do tw=$(ss -s | grep -o 'timewait [0-9]*' | grep -o '[0-9]*'); [ "${tw:-0}" -lt 50 ] && break; sleep 1; done
    echo "=== round $round build $build $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    python3 - "$B" "$build" <<'PY'
import resource, subprocess, sys, time
b, build = sys.argv[1], sys.argv[2]
t = time.time()
out = subprocess.run([f"{b}/xtask", "scale", "-n", "1024", "--program", f"{b}/scale-{build}"],
                     capture_output=True, text=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print("\n".join((out.stdout + out.stderr).splitlines()[-14:]))
print(f"cpu user {r.ru_utime:.1f} s sys {r.ru_stime:.1f} s total {r.ru_utime + r.ru_stime:.1f} s, wall {time.time() - t:.1f} s, ctxsw vol {r.ru_nvcsw} invol {r.ru_nivcsw}")
PY
  done
done > $OUT/scale-16core.txt 2>&1
grep -E "^===|^total|^error|^cpu" $OUT/scale-16core.txt
