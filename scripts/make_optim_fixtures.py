#!/usr/bin/python3
"""Reference fixtures for ddp's optim layer, computed by PyTorch 1.13.

Runs each optimizer configuration for five steps over two parameter tensors
(weight (8, 6) and bias (16,), 64 floats once concatenated, the layout of
ddp's flat parameter buffer) with a StepLR(step_size=2) stepped after every
optimizer step, and writes tests/fixtures/optim_<name>.bin. The gradients are
given, not computed from a loss: per element they span ~1e-7..1e3 (where
Adam's epsilon placement and Adadelta's eps show) and include exact zeros.

Run with Debian's torch: /usr/bin/python3 scripts/make_optim_fixtures.py
The format is described in docs/optim.md ("Fixture format").
"""
import os
import struct
import sys

import numpy as np
import torch

STEPS = 5
SHAPES = [(8, 6), (16,)]          # a weight and a bias; 48 + 16 = 64 floats
SCHED = {"step_size": 2, "gamma": 0.3}

# name -> (torch optimizer class, keyword options). Every option, defaults
# included, is written to the fixture so the C test needs no second copy.
CONFIGS = {
    "sgd_plain": ("sgd", dict(lr=0.1, momentum=0.0, dampening=0.0,
                              weight_decay=0.0, nesterov=False, maximize=False)),
    "sgd_momentum_wd_dampening": ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1,
                                              weight_decay=0.01, nesterov=False,
                                              maximize=False)),
    "sgd_nesterov_wd": ("sgd", dict(lr=0.05, momentum=0.8, dampening=0.0,
                                    weight_decay=0.001, nesterov=True, maximize=False)),
    "adam": ("adam", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                          amsgrad=False, maximize=False)),
    "adam_wd": ("adam", dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.05,
                             amsgrad=False, maximize=False)),
    "adam_wd_amsgrad": ("adam", dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-7,
                                     weight_decay=0.01, amsgrad=True, maximize=False)),
    "adam_maximize": ("adam", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.0, amsgrad=False, maximize=True)),
    "adadelta": ("adadelta", dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0,
                                  maximize=False)),
    "adadelta_wd": ("adadelta", dict(lr=0.5, rho=0.95, eps=1e-5, weight_decay=0.01,
                                     maximize=False)),
}

KINDS = {"sgd": 0, "adam": 1, "adadelta": 2}    # ddp_optim_kind

STATE_NAMES = {
    "sgd": ["momentum_buffer"],
    "adam": ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    "adadelta": ["square_avg", "acc_delta"],
}

# The "DDPFIX01" format of scripts/make_fixtures.py, read by the shared
# tests/support/fixture.c: dtype codes are ddp_dtype's, 0 float32, 1 float64
# (exact learning rates and options), 3 int64.
MAGIC = b"DDPFIX01"
DTYPES = {np.dtype("<f4"): 0, np.dtype("<f8"): 1, np.dtype("<i8"): 3}


def f64(value):
    return np.asarray(value, dtype="<f8")


def write_fixture(path, records):
    """records: list of (name, numpy array). See docs/optim.md."""
    out = bytearray(MAGIC)
    out += struct.pack("<II", len(records), 0)
    for name, arr in records:
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:   # (ascontiguousarray would make 0-d 1-d)
            arr = arr.copy(order="C")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        key = name.encode()
        out += struct.pack("<H", len(key)) + key
        out += struct.pack("<BB", DTYPES[arr.dtype], arr.ndim)
        out += struct.pack("<%dq" % arr.ndim, *arr.shape)
        out += arr.tobytes()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out)
    os.replace(tmp, path)


def make_grads(gen):
    """(STEPS, 64) float32 gradients with magnitudes spread over 1e-7..1e3."""
    n = sum(int(np.prod(s)) for s in SHAPES)
    scales = torch.tensor([1e-7, 1e-6, 3e-6, 1e-4, 1e-2, 1.0, 10.0, 1e3])
    grads = []
    for step in range(STEPS):
        g = torch.randn(n, generator=gen)
        # Each element keeps its magnitude class across steps but not exactly,
        # and the class pattern shifts with the step so moments vary.
        cls = (torch.arange(n) * 3 + step) % len(scales)
        g = g * scales[cls]
        g[(torch.arange(n) + step) % 13 == 0] = 0.0   # exact zeros
        grads.append(g.float())
    return torch.stack(grads)


def run(name, kind, opts, init, grads):
    params = []
    off = 0
    for s in SHAPES:
        k = int(np.prod(s))
        params.append(torch.nn.Parameter(init[off:off + k].clone().reshape(s)))
        off += k
    if kind == "sgd":
        opt = torch.optim.SGD(params, **opts)
    elif kind == "adam":
        opt = torch.optim.Adam(params, foreach=False, **opts)
    else:
        opt = torch.optim.Adadelta(params, foreach=False, **opts)
    sched = torch.optim.lr_scheduler.StepLR(opt, **SCHED)

    after, lrs = [], []
    for step in range(STEPS):
        off = 0
        for p in params:
            k = p.numel()
            p.grad = grads[step, off:off + k].clone().reshape(p.shape)
            off += k
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        after.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())

    recs = [("kind", np.array(KINDS[kind], dtype="<i8"))]
    for k, v in opts.items():
        if k == "betas":
            recs.append(("hp.beta1", f64(v[0])))
            recs.append(("hp.beta2", f64(v[1])))
        else:
            recs.append(("hp.%s" % k, f64(float(v))))
    recs.append(("sched.step_size", np.array(SCHED["step_size"], dtype="<i8")))
    recs.append(("sched.gamma", f64(SCHED["gamma"])))
    recs += [
        ("params.init", init.numpy().astype("<f4")),
        ("grads", grads.numpy().astype("<f4")),
        ("params", torch.stack(after).numpy().astype("<f4")),
        ("lr", f64(lrs)),
        ("lr.final", f64(opt.param_groups[0]["lr"])),
        ("sched.last_epoch", np.array(sched.last_epoch, dtype="<i8")),
    ]
    for sname in STATE_NAMES[kind]:
        vals = [opt.state[p].get(sname) for p in params]
        if any(v is None for v in vals):
            continue
        if sname == "step":   # one float32 scalar per tensor, all equal here
            assert all(float(v) == float(vals[0]) for v in vals)
            recs.append(("state.step", vals[0].detach().numpy().astype("<f4")))
        else:
            flat = torch.cat([v.detach().reshape(-1) for v in vals])
            recs.append(("state." + sname, flat.numpy().astype("<f4")))
    return recs


def main():
    assert torch.__version__.startswith("1.13"), torch.__version__
    torch.set_num_threads(1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outdir = os.path.join(root, "tests", "fixtures")
    os.makedirs(outdir, exist_ok=True)
    gen = torch.Generator().manual_seed(1313)
    n = sum(int(np.prod(s)) for s in SHAPES)
    init = torch.randn(n, generator=gen).float()
    grads = make_grads(gen)
    for name, (kind, opts) in CONFIGS.items():
        path = os.path.join(outdir, "optim_%s.bin" % name)
        write_fixture(path, run(name, kind, opts, init, grads))
        print("wrote", os.path.relpath(path, root), file=sys.stderr)


if __name__ == "__main__":
    main()
