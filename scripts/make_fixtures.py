#!/usr/bin/python3
"""PyTorch parity fixtures for ddp's nn layer (the seeds' models).

For each model this builds the PyTorch definition the seed uses, initialises it
with torch.manual_seed (PyTorch's own init), perturbs BatchNorm's affine
parameters and running stats away from their defaults (so that loading them is
tested), runs ONE forward + backward on a fixed random batch, and writes
tests/fixtures/model_<name>.bin with:

  input, target                      the batch
  <state-dict name>                  every parameter and buffer before the step,
                                     in state_dict() order
  output                             the forward's output (logits / log-probs)
  loss                               the loss (shape ())
  <param name>.grad                  every parameter's gradient
  after:<buffer name>                every buffer after the step (BN running
                                     stats, num_batches_tracked)
  eval:output                        the output of a second forward in eval mode
                                     (running stats), after the step, same input

Modes: convnet, toy, headtail and convnet-3 run in training mode. psnet runs in
eval mode: it has no BatchNorm, so eval differs from train only in that its two
Dropout2d layers are the identity, which makes the step deterministic.

Large parameters (more than 65536 elements: psnet's fc1.weight) are rounded to
bfloat16 before the step and stored as bfloat16, halving the file; the C reader
widens them to float32 exactly, so both sides start from identical weights.

Format ("DDPFIX01", little-endian; read by tests/support/fixture.c):
  header: 8 bytes magic "DDPFIX01", u32 record count, u32 reserved (0)
  record: u16 name length, name bytes (no NUL), u8 dtype (ddp_dtype: 0 float32,
          1 float64, 3 int64, 5 bfloat16), u8 ndim, ndim x i64 shape, raw data
          (numel x dtype size bytes)

Run with Debian's torch: /usr/bin/python3 scripts/make_fixtures.py
"""
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
MAGIC = b"DDPFIX01"
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_BFLOAT16 = 0, 3, 5
BF16_THRESHOLD = 65536


# ---- The models, as the seeds write them ----

class ToyModel(nn.Module):  # seed 001
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class HeadTail(nn.Module):  # seed 000's ToyModel, on one device
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 32)
        self.tail = nn.Linear(32, 10)

    def forward(self, x):
        return self.tail(self.head(x))


class ConvNet(nn.Module):  # seed 001, refs/torch_ddp_convnet.py
    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.MaxPool2d(2, 2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(),
                                    nn.MaxPool2d(2, 2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.reshape(x.size(0), -1))


class PsNet(nn.Module):  # seed 001's RPC parameter-server Net
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout2d(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


class PropulateNet(nn.Module):  # seed 002 (Propulate's tutorial Net)
    def __init__(self, conv_layers, activation):
        super().__init__()
        layers = [nn.Sequential(nn.Conv2d(1, 10, kernel_size=3, padding=1), activation())]
        layers += [nn.Sequential(nn.Conv2d(10, 10, kernel_size=3, padding=1), activation())
                   for _ in range(conv_layers - 1)]
        self.fc = nn.Linear(7840, 10)
        self.conv_layers = nn.Sequential(*layers)

    def forward(self, x):
        b, c, w, h = x.size()
        x = self.conv_layers(x)
        x = x.view(b, 10 * 28 * 28)
        x = self.fc(x)
        return F.log_softmax(x, dim=1)


# name -> (constructor, batch, input kind, loss, training mode)
MODELS = {
    "toy": (ToyModel, 8, "vec10", "mse", True),
    "headtail": (HeadTail, 8, "vec32", "cross_entropy", True),
    "convnet": (ConvNet, 8, "mnist", "cross_entropy", True),
    "psnet": (PsNet, 2, "mnist", "nll", False),
    "convnet-3": (lambda: PropulateNet(3, nn.Tanh), 4, "mnist", "nll", True),
}


# ---- Writing ----

def to_bf16_exact(t):
    """Rounds a float32 tensor to the nearest bfloat16 (ties to even), as float32."""
    return t.to(torch.bfloat16).to(torch.float32)


class Writer:
    def __init__(self):
        self.records = []
        self.names = set()

    def add(self, name, tensor, dtype=None):
        assert name not in self.names, name
        self.names.add(name)
        t = tensor.detach().cpu().contiguous()
        if dtype is None:
            dtype = DTYPE_INT64 if t.dtype == torch.int64 else DTYPE_FLOAT32
        if dtype == DTYPE_FLOAT32:
            raw = t.to(torch.float32).numpy().astype("<f4").tobytes()
        elif dtype == DTYPE_INT64:
            raw = t.to(torch.int64).numpy().astype("<i8").tobytes()
        elif dtype == DTYPE_BFLOAT16:
            bits = t.to(torch.float32).numpy().astype("<f4").view("<u4")
            assert np.all(bits & 0xFFFF == 0), name + " is not bfloat16-exact"
            raw = (bits >> 16).astype("<u2").tobytes()
        else:
            raise ValueError(dtype)
        nb = name.encode()
        head = struct.pack("<H", len(nb)) + nb + struct.pack("<BB", dtype, t.dim())
        head += b"".join(struct.pack("<q", s) for s in t.shape)
        self.records.append(head + raw)

    def write(self, path):
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<II", len(self.records), 0))
            for r in self.records:
                f.write(r)
        os.replace(tmp, path)


def make_batch(kind, batch, loss, gen):
    if kind == "mnist":
        x = torch.randn(batch, 1, 28, 28, generator=gen)
    elif kind == "vec10":
        x = torch.randn(batch, 10, generator=gen)
    else:
        x = torch.randn(batch, 32, generator=gen)
    if loss == "mse":
        y = torch.randn(batch, 5, generator=gen)
    else:
        y = torch.randint(0, 10, (batch,), generator=gen, dtype=torch.int64)
    return x, y


def perturb_batchnorm(model, gen):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(1 + 0.2 * torch.randn(c, generator=gen))
                m.bias.copy_(0.2 * torch.randn(c, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(c, generator=gen))
                m.running_var.copy_(1 + 0.5 * torch.rand(c, generator=gen))
                m.num_batches_tracked.fill_(3)


def make_fixture(name, seed):
    ctor, batch, kind, loss_kind, training = MODELS[name]
    torch.manual_seed(seed)
    model = ctor()
    gen = torch.Generator().manual_seed(seed + 1000)
    perturb_batchnorm(model, gen)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > BF16_THRESHOLD:
                p.copy_(to_bf16_exact(p))
    x, y = make_batch(kind, batch, loss_kind, gen)

    w = Writer()
    w.add("input", x)
    w.add("target", y)
    for key, value in model.state_dict().items():
        big = value.dtype == torch.float32 and value.numel() > BF16_THRESHOLD
        w.add(key, value, DTYPE_BFLOAT16 if big else None)

    model.train(training)
    model.zero_grad()
    out = model(x)
    if loss_kind == "mse":
        loss = F.mse_loss(out, y)
    elif loss_kind == "cross_entropy":
        loss = F.cross_entropy(out, y)
    else:
        loss = F.nll_loss(out, y)
    loss.backward()
    w.add("output", out)
    w.add("loss", loss)
    for pname, p in model.named_parameters():
        w.add(pname + ".grad", p.grad)
    for bname, b in model.named_buffers():
        w.add("after:" + bname, b)
    model.eval()
    with torch.no_grad():
        w.add("eval:output", model(x))

    path = os.path.join(OUT_DIR, "model_%s.bin" % name)
    w.write(path)
    print("%-10s %8d bytes  loss %.6f  %s" % (name, os.path.getsize(path), loss.item(),
                                             "train" if training else "eval"))


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(OUT_DIR, exist_ok=True)
    names = sys.argv[1:] or list(MODELS)
    for name in names:
        if name not in MODELS:
            sys.exit("unknown model %r (choose from %s)" % (name, ", ".join(MODELS)))
        make_fixture(name, 1234 + list(MODELS).index(name))


if __name__ == "__main__":
    main()
