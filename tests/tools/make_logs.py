"""Writes synthetic inputs for test_ddp_plot.sh into DIR:
  three_epochs.jsonl  a 3-epoch-like ddp-train log: 600 steps an epoch,
                      the loss falling with noise, an evaluation every 200
                      steps and at each epoch's end, samples/s settling,
                      phases with a slow step every 50 and parts summing
                      past step_ms every 97, preempted_ms null
                      on some steps (as where the kernel has no schedstat);
  scaling.tsv         bench-ddp.sh's table: ddp and PyTorch at worlds 1,
                      2 and 4, five rounds each (deliberately not in order).
Deterministic (a fixed seed), so a failure reproduces."""
import json
import math
import random
import sys

d = sys.argv[1]
rng = random.Random(27)
with open(d + "/three_epochs.jsonl", "w") as f:
    clock = 0.0
    for step in range(1, 1801):
        epoch = (step - 1) // 600
        load, fwd, bwd = 0.1 + 0.05 * rng.random(), 9 + rng.random(), 17 + 2 * rng.random()
        comm = 0.4 * rng.random()
        opt = 0.06
        total = load + fwd + bwd + comm + opt + 0.3 + (25 if step % 50 == 0 else 0)
        if step % 97 == 0:  # the parts timed a little over the step: "other" is 0, not negative
            total -= 0.5
        clock += total / 1000
        rec = {"step": step, "epoch": epoch, "loss": 2.3 * math.exp(-step / 300) + 0.25 + 0.05 * rng.random(),
               "lr": 0.01, "samples_per_s": 100 * step / clock, "load_ms": load, "forward_ms": fwd,
               "backward_compute_ms": bwd, "backward_comm_ms": comm, "optimizer_ms": opt,
               "step_ms": total, "preempted_ms": None if step % 7 == 0 else rng.random()}
        f.write(json.dumps(rec) + "\n")
        if step % 200 == 0:
            acc = 0.9 - 0.4 * math.exp(-step / 400)
            f.write(json.dumps({"step": step, "epoch": epoch, "test_loss": 1.5 - acc, "test_accuracy": acc}) + "\n")
with open(d + "/scaling.tsv", "w") as f:
    f.write("side\tworld\tsamples_per_s\tround\n")
    rows = []
    for r in range(1, 6):
        for side, base, eff in (("ddp", 3300, 0.93), ("PyTorch", 2500, 0.88)):
            for w in (4, 1, 2):
                rows.append("%s\t%d\t%.1f\t%d" % (side, w, base * w * eff ** (w > 1) * (1 + 0.02 * rng.random()), r))
    rng.shuffle(rows)
    f.write("\n".join(rows) + "\n")
