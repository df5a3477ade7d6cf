"""PyTorch side of the checkpoint interop test (run by test_torch_interop.sh
with the reference environment's Python, $DDP_TORCH_PY: PyTorch 2.x, numpy
and the safetensors package).

  torch_interop.py check FILE     loads ddp's checkpoint FILE with the
                                  safetensors package into PyTorch's ConvNet
                                  with load_state_dict(strict=True), after
                                  checking every tensor's name (in file order),
                                  dtype and shape against model.state_dict();
                                  prints the Fashion-MNIST test accuracy
  torch_interop.py write FILE     trains a PyTorch ConvNet for 20 steps, writes
                                  its state dict with DistributedDataParallel's
                                  "module." prefix to FILE with the safetensors
                                  package; prints its accuracy

Both directions go through the safetensors package (safetensors.torch), the
reader and writer PyTorch users have, not through a reading of the spec of
our own. The ConvNet is seed 001's (the same layers as ddp's "convnet").
"""
import gzip
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DATA = "/usr/share/datasets/fashion-mnist"


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
                                    nn.BatchNorm2d(32), nn.ReLU(),
                                    nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        return self.fc(out.reshape(out.size(0), -1))


def idx(path):
    raw = gzip.open(path).read()
    magic, n = struct.unpack(">II", raw[:8])
    if magic == 2051:
        rows, cols = struct.unpack(">II", raw[8:16])
        return np.frombuffer(raw, np.uint8, offset=16).reshape(n, 1, rows, cols)
    return np.frombuffer(raw, np.uint8, offset=8)


def accuracy(model, split="t10k"):
    x = torch.from_numpy(idx("%s/%s-images-idx3-ubyte.gz" % (DATA, split)).astype(np.float32) / 255.0)
    y = torch.from_numpy(idx("%s/%s-labels-idx1-ubyte.gz" % (DATA, split)).astype(np.int64))
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            correct += (model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
    return correct / len(x)


def check(path):
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        names, meta = f.offset_keys(), f.metadata() or {}
    model = ConvNet()
    want = model.state_dict()
    if names != list(want):
        sys.exit("names differ from ConvNet().state_dict():\n  file  %s\n  torch %s" % (names, list(want)))
    for k, v in want.items():
        if state[k].dtype != v.dtype or tuple(state[k].shape) != tuple(v.shape):
            sys.exit("%s: file %s %s, torch %s %s" % (k, state[k].dtype, tuple(state[k].shape), v.dtype, tuple(v.shape)))
    model.load_state_dict(state, strict=True)
    assert meta.get("format") == "pt", meta
    print("%.4f" % accuracy(model))


def write(path):
    torch.manual_seed(7)
    model = ConvNet()
    x = torch.from_numpy(idx("%s/train-images-idx3-ubyte.gz" % DATA)[:2000].astype(np.float32) / 255.0)
    y = torch.from_numpy(idx("%s/train-labels-idx1-ubyte.gz" % DATA)[:2000].astype(np.int64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for i in range(20):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i * 100:(i + 1) * 100]), y[i * 100:(i + 1) * 100]).backward()
        opt.step()
    state = {"module." + k: v for k, v in model.state_dict().items()}   # as DDP's state_dict names them
    save_file(state, path, metadata={"format": "pt"})
    print("%.4f" % accuracy(model))


if __name__ == "__main__":
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2])
