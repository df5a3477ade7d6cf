#!/usr/bin/python3
"""The reference for bench/bench_store.c: the same two loads on PyTorch's
TCPStore (torch.distributed.TCPStore), server in this process as rank 0 hosts
it, clients as threads (the store's calls release the GIL).

  rendezvous   N clients each connect, add 1 to a counter, set their address
               key and wait for all N address keys; time to the last done.
  throughput   64 clients each doing synchronous set + get of a 16-byte value
               for 2 s; total operations per second.

Usage: /usr/bin/python3 bench/bench_store_torch.py [--clients N] [--tp-clients N]
                                                   [--seconds S] [--runs R]
"""
import argparse
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist


def rendezvous_once(port, n, run):
    keys = [f"run{run}/addr/{i}" for i in range(n)]
    go = threading.Event()
    done = [0.0] * n
    errors = []

    def client(rank):
        go.wait()
        try:
            s = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
            s.add(f"run{run}/count", 1)
            s.set(keys[rank], f"10.1.{rank // 256}.{rank % 256}:29{rank % 1000:03d}")
            s.wait(keys, timedelta(seconds=120))
            done[rank] = time.monotonic()
        except Exception as e:  # noqa: BLE001 - report any failure
            errors.append(f"client {rank}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(errors[0])
    return max(done) - t0


def throughput_once(port, n, seconds):
    go = threading.Event()
    ops = [0] * n
    errors = []
    ready = threading.Barrier(n + 1)

    def client(i):
        try:
            s = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
            key = f"tp/{i}"
            ready.wait()
            go.wait()
            end = time.monotonic() + seconds
            count = 0
            while count % 64 or time.monotonic() < end:
                value = f"{count:016x}".encode()
                s.set(key, value)
                if s.get(key) != value:
                    raise RuntimeError("wrong value")
                count += 2
            ops[i] = count
        except Exception as e:  # noqa: BLE001
            errors.append(f"client {i}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(errors[0])
    return sum(ops) / (time.monotonic() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=1024)
    p.add_argument("--tp-clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--mode", default="all", choices=["all", "rendezvous", "throughput"])
    a = p.parse_args()
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False)
    port = server.port
    if a.mode in ("all", "rendezvous"):
        t = sorted(rendezvous_once(port, a.clients, r) for r in range(a.runs))
        print(f"torch rendezvous: {a.clients} clients (connect + add + set + wait for all "
              f"{a.clients} keys): median {statistics.median(t):.3f} s "
              f"(min {t[0]:.3f}, max {t[-1]:.3f}, {a.runs} runs)", flush=True)
    if a.mode in ("all", "throughput"):
        t = sorted(throughput_once(port, a.tp_clients, a.seconds) for _ in range(a.runs))
        print(f"torch throughput: {a.tp_clients} clients, synchronous set+get of 16-byte values "
              f"for {a.seconds:.1f} s: median {statistics.median(t):.0f} ops/s "
              f"(min {t[0]:.0f}, max {t[-1]:.0f}, {a.runs} runs)", flush=True)


if __name__ == "__main__":
    main()
