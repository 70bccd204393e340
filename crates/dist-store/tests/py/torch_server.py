"""Serves a PyTorch TCPStore (libuv or legacy) on a free port, prints the port, and serves until
its stdin closes. Used by dist-store's interop tests and load benchmark."""
import datetime
import sys

import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "libuv"
port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
store = dist.TCPStore(
    "127.0.0.1",
    port,
    is_master=True,
    wait_for_workers=False,
    use_libuv=(backend == "libuv"),
    timeout=datetime.timedelta(seconds=300),
)
print(store.port, flush=True)
sys.stdin.read()
