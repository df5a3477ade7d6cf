#!/usr/bin/env python3
"""PyTorch's powerSGD_hook on fixed gradients, for tests/parallel/test_powersgd.c.

Runs torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook
itself (not a copy) over a world-2 gloo group (two processes on localhost),
on two buckets whose layout the C test rebuilds with the DDP wrapper:

  registration order        shape        bucket (memory order inside)
  p0 big.weight             [16, 20]     1
  p1 big.bias               [16]         1
  p2 conv1.weight           [8, 4, 3, 3] 0   (viewed 8 x 36)
  p3 conv1.bias             [8]          0
  p4 fc.weight              [10, 32]     0
  p5 fc.bias                [10]         0
  p6 conv2.weight           [8, 4, 3, 3] 0   (same shape as p2: grouped with it)
  p7 small.weight           [3, 4]       0   (not worth compressing)
  p8 thin.weight            [6, 12]      0   (rank 1: Q of 12 < 16 values, torch.randn's
                                               double path)

The hook sees bucket 0 then bucket 1 (is_last) each iteration, as DDP calls
it. Every configuration runs 5 iterations with start_powerSGD_iter 2 (two
plain allreduces, then three PowerSGD ones: the first draws Q, the next two
warm-start it), except "noef", which has neither error feedback nor warm
start and compresses from iteration 0 (a fresh Q every time).

Written to tests/fixtures/powersgd.bin (DDPFIX01, docs/nn.md), per
configuration C in r1 (rank 1), r2 (rank 2), r4 (rank 4), noef (rank 1):
  C.in.r{R}.t{T}.b{B}   the bucket's flat input on rank R at iteration T
  C.out.r{R}.t{T}.b{B}  what the hook returned (the approximated average)
  C.err.r{R}.t{T}.b{B}  state.error_dict[B] after the iteration (if any)
  C.q.t{T}.b{B}         state.q_memory_dict[B] after the iteration (if any)
  C.randn.{K}           the K-th torch.randn the hook drew (rank 0; the ranks
                        draw the same), before orthogonalization
  C.seeds               the torch.manual_seed values it used, in order

Usage: /opt/torch-venv/bin/python scripts/make_powersgd_fixture.py [out.bin]
"""
import os
import socket
import struct
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import Writer, DTYPE_INT64  # noqa: E402

SHAPES = [(16, 20), (16,), (8, 4, 3, 3), (8,), (10, 32), (10,), (8, 4, 3, 3), (3, 4), (6, 12)]
BUCKETS = [[2, 3, 4, 5, 6, 7, 8], [0, 1]]  # memory order inside each bucket
ITERS = 5
CONFIGS = {
    "r1": dict(matrix_approximation_rank=1, start_powerSGD_iter=2),
    "r2": dict(matrix_approximation_rank=2, start_powerSGD_iter=2),
    # rank 4: only p0 (16 x 20) is worth compressing; PyTorch orthogonalizes
    # with torch.linalg.qr above rank 2 (ddp with Gram-Schmidt: Q's columns
    # may differ in sign, the approximation not)
    "r4": dict(matrix_approximation_rank=4, start_powerSGD_iter=2),
    "noef": dict(matrix_approximation_rank=1, start_powerSGD_iter=0,
                 use_error_feedback=False, warm_start=False),
}


REAL_RANDN = torch.randn


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class Bucket:
    """What powerSGD_hook reads of a dist.GradBucket."""

    def __init__(self, index, buf, params):
        self._index, self._buf = index, buf
        self._grads, at = [], 0
        for p in params:
            n = numel(SHAPES[p])
            self._grads.append(buf[at:at + n].view(SHAPES[p]))
            at += n

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def gradients(self):
        return self._grads

    def is_last(self):
        return self._index == len(BUCKETS) - 1


def grads(cfg_i, t, r, b):
    g = torch.Generator().manual_seed(100000 * cfg_i + 1000 * t + 10 * r + b + 1)
    n = sum(numel(SHAPES[p]) for p in BUCKETS[b])
    return REAL_RANDN(n, generator=g, dtype=torch.float32)  # not the recording wrapper


def worker(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    real_randn, real_seed = torch.randn, torch.manual_seed
    for cfg_i, (cfg, kw) in enumerate(CONFIGS.items()):
        drawn, seeds = [], []

        def randn(*a, **k):
            t = real_randn(*a, **k)
            drawn.append(t.clone())
            return t

        def manual_seed(s):
            seeds.append(int(s))
            return real_seed(s)

        torch.randn, torch.manual_seed = randn, manual_seed
        state = psgd.PowerSGDState(process_group=None, **kw)
        for t in range(ITERS):
            for b in range(len(BUCKETS)):
                x = grads(cfg_i, t, rank, b)
                out[f"{cfg}.in.r{rank}.t{t}.b{b}"] = x.clone()
                y = psgd.powerSGD_hook(state, Bucket(b, x, BUCKETS[b])).wait()
                out[f"{cfg}.out.r{rank}.t{t}.b{b}"] = y.clone()
                if b in state.error_dict:
                    out[f"{cfg}.err.r{rank}.t{t}.b{b}"] = state.error_dict[b].clone()
                if rank == 0 and b in state.q_memory_dict:
                    out[f"{cfg}.q.t{t}.b{b}"] = state.q_memory_dict[b].clone()
        torch.randn, torch.manual_seed = real_randn, real_seed
        if rank == 0:
            for k, d in enumerate(drawn):
                out[f"{cfg}.randn.{k}"] = d.reshape(-1).clone()
            out[f"{cfg}.seeds"] = torch.tensor(seeds, dtype=torch.int64)
    queue.put((rank, {k: v.numpy() for k, v in out.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "powersgd.bin")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            sys.exit(f"a worker failed (exit {p.exitcode})")
    merged = {}
    for r in (0, 1):
        merged.update(results[r])
    w = Writer()
    for name in sorted(merged):
        a = torch.from_numpy(merged[name])
        w.add(name, a, DTYPE_INT64 if a.dtype == torch.int64 else None)
    w.write(path)
    print(f"wrote {path}: {len(merged)} tensors (torch {torch.__version__})")


if __name__ == "__main__":
    main()
