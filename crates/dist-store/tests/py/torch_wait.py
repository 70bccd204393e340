"""Connects to HOST PORT, says "waiting", waits 60 s for a key that never comes, and reports how
the wait ended (the test stops the server meanwhile)."""
import datetime
import sys
import time

import torch.distributed as dist

s = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False,
                  timeout=datetime.timedelta(seconds=60))
print("waiting", flush=True)
t0 = time.monotonic()
try:
    s.wait(["never"], datetime.timedelta(seconds=60))
    print("returned", flush=True)
except Exception as e:  # noqa: BLE001
    print(f"raised after {time.monotonic() - t0:.2f} s: {type(e).__name__}: {e}", flush=True)
