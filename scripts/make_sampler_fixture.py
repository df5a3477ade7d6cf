#!/usr/bin/python3
"""The sampler fixture: index lists computed by PyTorch 1.13's own samplers.

For each case of the table below it runs torch.utils.data's
DistributedSampler (num_replicas, rank, shuffle, seed, drop_last, after
set_epoch(epoch)) or RandomSampler (with generator=torch.Generator() seeded
once with `seed`, iterated epoch + 1 times: the last pass is recorded) and
writes the index list to tests/fixtures/sampler_indices.txt, which
tests/data/test_sampler_torch.c compares with ddp's samplers index by index.

Run with Debian's torch: /usr/bin/python3 scripts/make_sampler_fixture.py

Format (text): '#' lines are comments; each case is two lines,
  <kind> <N> <replicas> <rank> <seed> <epoch> <shuffle> <drop_last> <count>
  <count indices separated by spaces>   (an empty line when count is 0)
kind is "distributed" or "random" (random leaves replicas 1, rank 0,
shuffle 1, drop_last 0).
"""
import os
import sys

import torch
from torch.utils.data import DistributedSampler, RandomSampler

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                   "sampler_indices.txt")

# (N, replicas, rank, seed, epoch, shuffle, drop_last)
DISTRIBUTED = [
    # N not divisible by replicas: padding (repeats the head) or dropping.
    *[(10, 3, r, 0, 0, True, False) for r in range(3)],
    *[(10, 3, r, 0, 0, True, True) for r in range(3)],
    (10, 3, 1, 0, 0, False, False),
    (10, 3, 2, 0, 0, False, True),
    # Divisible.
    *[(12, 4, r, 5, 2, True, False) for r in (0, 3)],
    # N < replicas: the padding is longer than the dataset (repeated twice and more).
    *[(2, 5, r, 0, 1, True, False) for r in range(5)],
    (2, 5, 3, 0, 1, True, True),        # drop_last: nothing for anyone
    (2, 5, 4, 0, 1, False, False),
    (1, 3, 2, 9, 0, True, False),
    (0, 2, 1, 0, 0, True, False),       # an empty dataset
    # Epochs and seeds.
    *[(1000, 4, 3, 42, e, True, False) for e in (0, 1, 7)],
    (1001, 4, 0, 42, 5, True, True),
    (1001, 4, 3, 42, 5, True, False),
    (100, 2, 1, 2**32 + 3, 0, True, False),   # the generator keeps the low 32 bits
    (100, 2, 1, 2**32 - 1, 2, True, False),   # seed + epoch crosses 2^32
    # Fashion-MNIST's size: long randperms.
    (60000, 4, 1, 0, 0, True, False),
    (60000, 7, 6, 3, 1, True, True),
    (60000, 7, 6, 3, 1, True, False),
    (10000, 3, 2, 0, 0, False, False),
]

# (N, seed, epoch)
RANDOM = [
    (10, 0, 0), (10, 0, 3), (1, 3, 2), (2, 3, 4), (1000, 5, 2),
    (60000, 1, 1),   # the whole second randperm of 60000 from one stream
]


def distributed(n, replicas, rank, seed, epoch, shuffle, drop_last):
    s = DistributedSampler(range(n), num_replicas=replicas, rank=rank, shuffle=shuffle,
                           seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    idx = list(s)
    assert len(idx) == len(s)
    return idx


def random_sampler(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed)
    s = RandomSampler(range(n), generator=g)
    for _ in range(epoch):
        list(s)
    return list(s)


def main():
    lines = ["# PyTorch %s index lists; see scripts/make_sampler_fixture.py" % torch.__version__]
    for (n, r, k, seed, e, sh, dl) in DISTRIBUTED:
        idx = distributed(n, r, k, seed, e, sh, dl)
        lines.append("distributed %d %d %d %d %d %d %d %d" % (n, r, k, seed, e, sh, dl, len(idx)))
        lines.append(" ".join(map(str, idx)))
    for (n, seed, e) in RANDOM:
        idx = random_sampler(n, seed, e)
        lines.append("random %d 1 0 %d %d 1 0 %d" % (n, seed, e, len(idx)))
        lines.append(" ".join(map(str, idx)))
    with open(OUT + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(OUT + ".tmp", OUT)
    print("wrote %s (%d cases)" % (OUT, len(DISTRIBUTED) + len(RANDOM)), file=sys.stderr)


if __name__ == "__main__":
    main()
