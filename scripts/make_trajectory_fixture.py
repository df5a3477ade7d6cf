#!/usr/bin/python3
"""Multi-step PyTorch reference for seed 001's ConvNet on Fashion-MNIST.

One-step parity (make_fixtures.py) cannot see a defect that only shows over
many steps: BatchNorm's running statistics drifting, the momentum buffer, the
eval-mode forward after training, the loader's pairing of images and labels.
This trains the ConvNet exactly as scripts/torch/train_reference.py does
(SGD lr 0.01, momentum 0.9, batch 100, cross-entropy, train mode) for STEPS
steps on a fixed sequence of real training batches and records the trajectory,
written to tests/fixtures/trajectory_convnet.bin (DDPFIX01, see
make_fixtures.py) with:

  indices                 (STEPS, BATCH) int64: training-set indices of each
                          step's batch (the images are not stored: the C test
                          reads the same dataset from /usr/share/datasets)
  labels, pixel_sums      (STEPS, BATCH) int64 / float32: each sample's label
                          and the sum of its 784 scaled pixels, to check the
                          C loader's images and their pairing with labels
  <state-dict name>       the initial state (torch.manual_seed(SEED) init)
  loss                    (STEPS) float32: the loss of every step, before its
                          update
  step8:<state-dict name>, step8:momentum:<param>, step8:eval:logits
                          the same as final:..., after SNAPSHOT steps: before
                          float noise has grown (it grows tenfold every three
                          steps or so), so these are compared tightly
  final:<state-dict name> every parameter and buffer after STEPS steps
  final:momentum:<param>  SGD's momentum buffer after STEPS steps
  final:eval:logits       (EVAL_N, 10) eval-mode logits of the first EVAL_N
                          test images after training
  eval:loss, eval:correct the mean cross-entropy and the number correct

Run with Debian's torch: /usr/bin/python3 scripts/make_trajectory_fixture.py
"""
import os
import sys

sys.dont_write_bytecode = True

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "torch"))
from make_fixtures import Writer  # noqa: E402
from train_reference import ConvNet, find, read_idx  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
OUT = os.path.join(HERE, "..", "tests", "fixtures", "trajectory_convnet.bin")
SEED = 1
STEPS = 60
BATCH = 100
EVAL_N = 1000
SNAPSHOT = 8
LR, MOMENTUM = 0.01, 0.9


def record(w, prefix, model, opt, x_eval):
    """The state dict and momentum buffers, and the eval-mode logits on
    x_eval (which leave the model in eval mode)."""
    for key, value in model.state_dict().items():
        w.add(prefix + key, value)
    for name, p in model.named_parameters():
        w.add(prefix + "momentum:" + name, opt.state[p]["momentum_buffer"])
    model.eval()
    with torch.no_grad():
        logits = model(x_eval)
    w.add(prefix + "eval:logits", logits)
    return logits


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    xs = torch.from_numpy(read_idx(find(DATA, "train-images-idx3-ubyte")).astype(np.float32) / 255.0).unsqueeze(1)
    ys = torch.from_numpy(read_idx(find(DATA, "train-labels-idx1-ubyte")).astype(np.int64))
    xt = torch.from_numpy(read_idx(find(DATA, "t10k-images-idx3-ubyte")).astype(np.float32) / 255.0).unsqueeze(1)
    yt = torch.from_numpy(read_idx(find(DATA, "t10k-labels-idx1-ubyte")).astype(np.int64))

    torch.manual_seed(SEED)
    model = ConvNet()
    gen = torch.Generator().manual_seed(SEED + 1000)
    indices = torch.randperm(len(xs), generator=gen)[:STEPS * BATCH].reshape(STEPS, BATCH)

    w = Writer()
    w.add("indices", indices)
    w.add("labels", ys[indices])
    w.add("pixel_sums", xs[indices].double().sum(dim=(2, 3, 4)).float())
    for key, value in model.state_dict().items():
        w.add(key, value)

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()
    losses = []
    for step in range(STEPS):
        idx = indices[step]
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step + 1 == SNAPSHOT:
            record(w, "step%d:" % SNAPSHOT, model, opt, xt[:EVAL_N])
            model.train()
    w.add("loss", torch.tensor(losses, dtype=torch.float32))
    logits = record(w, "final:", model, opt, xt[:EVAL_N])
    with torch.no_grad():
        eval_loss = F.cross_entropy(logits, yt[:EVAL_N])
        correct = int((logits.argmax(1) == yt[:EVAL_N]).sum())
    w.add("eval:loss", eval_loss)
    w.add("eval:correct", torch.tensor(correct, dtype=torch.int64))

    w.write(OUT)
    print("trajectory_convnet.bin: %d bytes, %d steps, loss %.4f -> %.4f, eval %d/%d correct, "
          "eval loss %.4f" % (os.path.getsize(OUT), STEPS, losses[0], losses[-1], correct, EVAL_N,
                              eval_loss.item()))


if __name__ == "__main__":
    main()
