#!/usr/bin/env python3
"""Peer benchmark: torch.distributed all_reduce (f32 sum, in place), gloo on CPU tensors or nccl
on GPU tensors, printing the same columns as `cargo xtask perf`: bytes, count, type, redop,
root, time per call in microseconds (slowest rank's average), algbw and busbw in GB/s
(nccl-tests' definitions), and the number of wrong elements after one checked call.

    python3 benches/peers/torch_allreduce.py --backend gloo -n 4 -b 8 -e 64M -f 4
    python3 benches/peers/torch_allreduce.py --backend nccl -n 2 -b 8 -e 1G -f 4
    dist-run -n 4 --hosts 2 --rate 1gbit -- python3 benches/peers/torch_allreduce.py -n 4 --iters 5

Starts its own ranks (one process each, one GPU each for nccl) unless RANK is set, as under
torchrun. NCCL_NVLS_ENABLE=0 is set in every process.
"""
import argparse
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def sizes(args):
    b = parse_size(args.b)
    while b <= parse_size(args.e):
        yield b
        b *= args.f


def run(rank, world, args, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    gpu = args.backend == "nccl"
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if rank == 0:
        print(f"# torch {torch.__version__} {args.backend} all_reduce, {world} ranks, float sum in place")
        print(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>4} {'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>6}")
    for nbytes in sizes(args):
        count = max(nbytes // 4, 1)
        idx = torch.arange(count, device=dev)
        x = ((rank * 3 + idx) % 7).to(torch.float32)
        dist.all_reduce(x)
        want = sum(((r * 3 + idx) % 7).to(torch.float32) for r in range(world))
        wrong = torch.tensor([int((x != want).sum().item())], dtype=torch.float64, device=dev)
        iters = args.iters or max(5, min(1000, (1 << 30) // (count * 4 + (64 << 10))))
        for _ in range(max(iters // 10, 2)):
            dist.all_reduce(x)
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        per = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64, device=dev)
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        dist.all_reduce(wrong)
        if rank == 0:
            s = per.item()
            algbw = count * 4 / s / 1e9
            busbw = algbw * 2 * (world - 1) / world
            print(f"{count * 4:>12} {count:>12} {'float':>8} {'sum':>6} {'-1':>4} {s * 1e6:>10.1f} {algbw:>8.3f} {busbw:>8.3f} {int(wrong.item()):>6}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("-n", type=int, default=4)
    p.add_argument("-b", default="8")
    p.add_argument("-e", default="64M")
    p.add_argument("-f", type=int, default=4)
    p.add_argument("--iters", type=int, default=0, help="timed calls per size (default: by size, 5 to 1000)")
    args = p.parse_args()
    if "RANK" in os.environ:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, 0)
        return
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.n, args, port), nprocs=args.n, join=True)


if __name__ == "__main__":
    main()
