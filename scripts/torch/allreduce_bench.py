"""PyTorch's all_reduce over NCCL at world 2 on one GPU, for gpu-check's n5
(issue 39): the reference ddp-bench --device cuda is compared with.

Two processes (torch.multiprocessing), each with its own NCCL_HOSTID so that
NCCL accepts two ranks on one GPU (its socket transport; NCCL_SOCKET_IFNAME=lo,
NCCL_IB_DISABLE=1), as ddp's ranks run there. For each size from -b to -e
bytes (doubling), float32 sum: `warmup` untimed calls, then `iters` calls
timed as PyTorch users time them (one torch.cuda.synchronize after the loop),
the slowest rank's mean. One JSON line per size on stdout:
  {"impl": "torch", "size": B, "time_us": T, "algbw": GB/s, "busbw": GB/s}
busbw = algbw * 2 (P - 1) / P, nccl-tests' convention, as ddp-bench's.

Usage: python3 allreduce_bench.py [-b 1M] [-e 64M] [-n 20] [-w 5]
"""
import argparse
import json
import os
import socket
import sys
import time


def parse_bytes(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def worker(rank, world, port, args):
    os.environ["NCCL_HOSTID"] = "ddp-gpu-check-%d" % rank
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world)
    size = args.b
    while size <= args.e:
        t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(args.w):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.n):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        mean = torch.tensor([(time.perf_counter() - t0) / args.n], device="cuda")
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        if rank == 0:
            us = mean.item() * 1e6
            algbw = size / (us * 1e-6) * 1e-9
            print(json.dumps({"impl": "torch", "size": size, "time_us": round(us, 3),
                              "algbw": round(algbw, 4),
                              "busbw": round(algbw * 2 * (world - 1) / world, 4)}), flush=True)
        size *= 2
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-b", type=parse_bytes, default=1 << 20)
    p.add_argument("-e", type=parse_bytes, default=64 << 20)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    args = p.parse_args()
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device for PyTorch")
        sys.exit(77)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
