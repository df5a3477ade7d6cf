#!/usr/bin/env python3
"""Counts, from ddp-train's sample logs (DDP_TRAIN_SAMPLE_LOG=DIR: one
samples.<pid>.jsonl per rank and round), that over the committed steps of
every epoch each sample was seen exactly once.

Usage: sample_count.py DIR NUM_SAMPLES EPOCHS

Each line is one rank's step: {"step", "epoch", "start", "rank", "replicas",
"first", "samples"}, sample i at position first + i * replicas of the epoch's
global order. "start" is the step the process resumed from, so the rounds of
an elastic job are told apart by it: a round that resumed at step c redid
every step after c, so the lines of the rounds before it with step > c are
not committed (a killed round's steps after its last checkpoint). Checked:
  * every committed step has exactly one line per rank of its world;
  * in each epoch the committed positions are 0..T-1, each once, with
    N <= T < N + replicas (the distributed sampler pads the last step);
  * the samples at positions below N are 0..N-1, each exactly once; a
    padding position p >= N holds the sample of position p - N (the order
    repeated from its start, as PyTorch's DistributedSampler pads);
  * EPOCHS epochs, 0..EPOCHS-1.
Exits 1 naming the first thing that does not hold."""
import glob
import json
import os
import sys


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    folder, n, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "samples.*.jsonl"))):
        with open(path) as f:
            for k, text in enumerate(f):
                try:
                    rec = json.loads(text)
                except ValueError:
                    fail("%s:%d is not a JSON line (%r)" % (path, k + 1, text[:80]))
                rec["where"] = "%s:%d" % (os.path.basename(path), k + 1)
                lines.append(rec)
    if not lines:
        fail("no sample logs in " + folder)
    starts = sorted({r["start"] for r in lines})
    next_start = {s: (starts[i + 1] if i + 1 < len(starts) else None) for i, s in enumerate(starts)}
    committed, redone = [], 0
    for r in lines:
        ns = next_start[r["start"]]
        if ns is not None and r["step"] > ns:
            redone += 1
        else:
            committed.append(r)
    # One line per rank of every committed step.
    steps = {}
    for r in committed:
        steps.setdefault(r["step"], []).append(r)
    for step, rs in sorted(steps.items()):
        world = rs[0]["replicas"]
        ranks = sorted(r["rank"] for r in rs)
        if ranks != list(range(world)) or any(r["replicas"] != world for r in rs):
            fail("step %d: lines of ranks %s (worlds %s), expected one per rank 0..%d" %
                 (step, ranks, sorted({r["replicas"] for r in rs}), world - 1))
    if sorted(steps) != list(range(1, max(steps) + 1)):
        missing = sorted(set(range(1, max(steps) + 1)) - set(steps))
        fail("committed steps missing: %s" % missing[:10])
    # Positions and samples per epoch.
    by_epoch = {}
    for r in committed:
        pos = by_epoch.setdefault(r["epoch"], {})
        for i, sample in enumerate(r["samples"]):
            p = r["first"] + i * r["replicas"]
            if p in pos:
                fail("epoch %d: position %d taken twice (%s and step %d)" % (r["epoch"], p, r["where"], pos[p][1]))
            pos[p] = (sample, r["step"], r["replicas"])
    if sorted(by_epoch) != list(range(epochs)):
        fail("epochs %s, expected 0..%d" % (sorted(by_epoch), epochs - 1))
    padded = 0
    for e, pos in sorted(by_epoch.items()):
        total = max(pos) + 1
        last_world = pos[max(pos)][2]
        if len(pos) != total:
            fail("epoch %d: %d positions of 0..%d (%d missing)" % (e, len(pos), total - 1, total - len(pos)))
        if not n <= total < n + last_world:
            fail("epoch %d: %d positions for %d samples at world %d" % (e, total, n, last_world))
        seen = sorted(pos[p][0] for p in range(n))
        if seen != list(range(n)):
            counts = {}
            for s in seen:
                counts[s] = counts.get(s, 0) + 1
            twice = [s for s, c in counts.items() if c > 1]
            never = sorted(set(range(n)) - set(counts))
            fail("epoch %d: samples seen twice %s, never %s" % (e, twice[:10], never[:10]))
        for p in range(n, total):
            if pos[p][0] != pos[p - n][0]:
                fail("epoch %d: padding position %d holds sample %d, not %d (position %d)" %
                     (e, p, pos[p][0], pos[p - n][0], p - n))
        padded += total - n
    print("sample count: %d epochs of %d samples, each sample exactly once over the committed steps "
          "(%d steps; %d runs resumed at steps %s; %d rank-steps after a last checkpoint redone; "
          "%d padding positions)" % (epochs, n, max(steps), len(starts), starts, redone, padded))


main()
