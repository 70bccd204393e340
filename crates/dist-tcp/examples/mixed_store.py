"""One job under torchrun, Python and Rust ranks, one store.

torchrun --standalone --nproc-per-node N mixed_store.py RUST_BINARY

The worker torchrun starts as local rank 0 stays Python: it reaches the store torchrun's agent
serves (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) with
torch.distributed.TCPStore, sets a key for the Rust ranks and reads the key each of them sets
back. Every other worker becomes a Rust rank: it renumbers itself among the Rust ranks (RANK and
WORLD_SIZE less the Python ones) and execs RUST_BINARY (dist-tcp's `mixed_store` example), which
forms its dist job through the same store.
"""

import os
import sys
from datetime import timedelta

PYTHON_RANKS = 1

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
if rank >= PYTHON_RANKS:
    env = dict(os.environ)
    env["RANK"] = str(rank - PYTHON_RANKS)
    env["WORLD_SIZE"] = str(world - PYTHON_RANKS)
    env["LOCAL_RANK"] = str(int(env.get("LOCAL_RANK", rank)) - PYTHON_RANKS)
    env["LOCAL_WORLD_SIZE"] = str(int(env.get("LOCAL_WORLD_SIZE", world)) - PYTHON_RANKS)
    env["PYTHON_RANKS"] = str(PYTHON_RANKS)
    os.execve(sys.argv[1], [sys.argv[1]], env)

import torch.distributed as dist  # noqa: E402 (only the Python rank needs torch)

store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    int(os.environ["MASTER_PORT"]),
    is_master=False,
    timeout=timedelta(seconds=60),
)
store.set("mixed/from_python", "hello from python rank %d" % rank)
for r in range(world - PYTHON_RANKS):
    said = store.get("mixed/from_rust/%d" % r).decode()
    expected = 'rust rank %d read "hello from python rank %d"' % (r, rank)
    if said != expected:
        sys.exit("python rank %d: key mixed/from_rust/%d holds %r" % (rank, r, said))
    print("python rank %d read: %s" % (rank, said), flush=True)
