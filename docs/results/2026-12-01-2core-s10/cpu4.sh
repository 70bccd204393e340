#!/bin/bash
cd /work/main
for round in 1 2; do
  for build in base poll2 fix; do
    while [ "$(ss -tan state time-wait | wc -l)" -gt 50 ]; do sleep 5; done
    echo "=== round $round build $build $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    python3 - "$build" <<'PY'
import resource, subprocess, sys, time
t = time.time()
out = subprocess.run(["./target/debug/xtask", "scale", "-n", "1024", "--program", f"/tmp/scale-{sys.argv[1]}"],
                     capture_output=True, text=True).stdout
r = resource.getrusage(resource.RUSAGE_CHILDREN)
print("\n".join(out.splitlines()[-14:]))
print(f"cpu user {r.ru_utime:.1f} s sys {r.ru_stime:.1f} s total {r.ru_utime + r.ru_stime:.1f} s, wall {time.time() - t:.1f} s, ctxsw vol {r.ru_nvcsw} invol {r.ru_nivcsw}")
PY
  done
done
