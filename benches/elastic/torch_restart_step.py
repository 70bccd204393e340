"""One rank of a 4-rank PyTorch (Gloo) job under `torchrun --max-restarts 1`: checked
all_reduce steps, rank 0 recording the last completed step in a checkpoint file; on the first
attempt rank 3 kills itself (SIGKILL) at KILL_STEP. torchrun then restarts every rank, which
resume from the checkpoint. Prints `KILL <unix time>` and, on rank 0, `STEP <n> <unix time>`
per completed step, for compare-torchrun.sh to measure the time from the kill to the next
completed step."""
import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
steps = int(os.environ.get("STEPS", "40"))
kill_step = int(os.environ.get("KILL_STEP", "10"))
ckpt = os.environ["CKPT"]
start = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
x = torch.empty(1 << 14)
for step in range(start, steps):
    if attempt == 0 and rank == world - 1 and step == kill_step:
        print(f"KILL {time.time():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    x.fill_(rank + 1)
    dist.all_reduce(x)
    assert x[0].item() == world * (world + 1) / 2, x[0].item()
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(ckpt + ".tmp", ckpt)
        print(f"STEP {step} {time.time():.6f}", flush=True)
dist.destroy_process_group()
