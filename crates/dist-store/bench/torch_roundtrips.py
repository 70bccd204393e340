"""PyTorch's own TCPStore client doing what `store_load roundtrips` does: C clients (threads, one
connection each, its own key), set + get of BYTES bytes for SECS seconds; prints pairs a second.

    python torch_roundtrips.py HOST PORT CLIENTS BYTES SECS
"""
import datetime
import sys
import threading
import time

import torch.distributed as dist

host, port, clients, size, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
value = bytes(i % 256 for i in range(size))
stores = [dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60)) for _ in range(clients)]
counts = [0] * clients
start_line = threading.Barrier(clients)


def run(i):
    s, key = stores[i], f"py_rt{i}"
    start_line.wait()
    end = time.monotonic() + secs
    n = 0
    while time.monotonic() < end:
        s.set(key, value)
        assert len(s.get(key)) == size
        n += 1
    counts[i] = n


t0 = time.monotonic()
threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.monotonic() - t0
print(f"python roundtrips clients={clients} value_bytes={size} pairs={sum(counts)} "
      f"set+get_pairs_per_s={sum(counts) / wall:.0f}")
