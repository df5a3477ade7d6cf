#!/opt/torch-venv/bin/python
"""Reference fixtures for ddp's autocast (docs/tensor.md, "Mixed precision").

Runs the ops of the seeds' MNIST ConvNet (the RPC tutorial's Net, ddp's
"psnet": conv 1->32 3x3 on 28x28, relu, conv 32->64 3x3, max_pool 2, flatten,
linear 9216->128, relu, linear 128->10, log_softmax, nll_loss), plus batch
norm, matmul, cross_entropy and mse_loss on the same activations, under
torch.autocast("cpu", dtype) for dtype bfloat16 and float16 (PyTorch 2.x's
CPU autocast supports both), and writes tests/fixtures/autocast_<dtype>.bin.

Records: x (the batch), target, mse_target; per op <op> its parameters
(<op>.w, <op>.b, float32; fc1's weight is made by formula_weight, which the
C test repeats), <op>.dtype (int64: the output's ddp_dtype code, 0 float32,
4 float16, 5 bfloat16) and <op>.y (the output's values as float32, exact).
An op's input is the batch or an earlier op's output (see make()). The whole chain's backward (dropout left out: it is random) gives
chain.loss and chain.<param>.grad (float32, as autocast hands parameters'
gradients back in float32).

Run with the reference environment's PyTorch 2.x (not Debian's 1.13):
  /opt/torch-venv/bin/python scripts/make_autocast_fixtures.py
On the GPU machine (scripts/gpu-amp-steps.sh), the same ops under
torch.autocast("cuda", dtype) into OUTDIR/autocast_cuda_<dtype>.bin:
  python3 scripts/make_autocast_fixtures.py --device cuda --out OUTDIR
The inputs and parameters are made on the CPU from the same seeds (the
same values as the CPU fixtures) and moved to the GPU. TF32 is off, cuDNN
deterministic, and cuBLAS's reduced-precision reductions for bf16 / fp16
off (torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_
reduction = False), so that every GEMM accumulates in float32: the
accumulation bound of the C test holds for both sides.
The file format is scripts/make_fixtures.py's "DDPFIX01" (docs/nn.md).
"""
import argparse
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

MAGIC = b"DDPFIX01"
DTYPES = {np.dtype("<f4"): 0, np.dtype("<f8"): 1, np.dtype("<i8"): 3}
DDP_DTYPE = {torch.float32: 0, torch.float16: 4, torch.bfloat16: 5}
N = 2  # batch: the seeds' shapes with a small batch keeps the files small


def write_fixture(path, records):
    out = bytearray(MAGIC)
    out += struct.pack("<II", len(records), 0)
    for name, arr in records:
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:
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


def f32(t):
    return t.detach().float().cpu().contiguous().numpy().astype("<f4")


def formula_weight(rows, cols):
    """fc1's weight (rows, cols), made by a formula the C test repeats, so
    that its 1.2M values need not be stored: w[i] = (h(i) % 2001 - 1000) *
    2^-17 with h(i) = (1664525 * i + 1013904223) mod 2^32 >> 8: values in
    +-0.0076, exact in float32, most not exact in bfloat16 or float16 (up
    to 10 significant bits), so the cast's rounding is exercised."""
    i = np.arange(rows * cols, dtype=np.uint64)
    h = ((np.uint64(1664525) * i + np.uint64(1013904223)) % np.uint64(2**32)) >> np.uint64(8)
    v = (h % np.uint64(2001)).astype(np.int64) - 1000
    return torch.from_numpy((v.astype(np.float64) * 2.0**-17).astype(np.float32).reshape(rows, cols))


def make(dtype, seed, device="cpu"):
    """Records for one dtype. An op's input that is an earlier op's output
    (or an exact function of one: relu, max_pool, flatten) is not stored
    again: the C test rebuilds it from that output."""
    torch.manual_seed(seed)
    conv1 = torch.nn.Conv2d(1, 32, 3)
    conv2 = torch.nn.Conv2d(32, 64, 3)
    fc1 = torch.nn.Linear(9216, 128)
    with torch.no_grad():
        fc1.weight.copy_(formula_weight(128, 9216))
    fc2 = torch.nn.Linear(128, 10)
    bn_w = torch.nn.Parameter(torch.rand(32) + 0.5)
    bn_b = torch.nn.Parameter(torch.randn(32) * 0.1)
    x = (torch.rand(N, 1, 28, 28) - 0.1307) / 0.3081
    target = torch.randint(0, 10, (N,))
    mse_target = torch.randn(N, 10)
    rec = [("x", f32(x)), ("target", target.numpy().astype("<i8")),
           ("mse_target", f32(mse_target))]
    if device != "cpu":  # the same values, on the device
        for m in (conv1, conv2, fc1, fc2):
            m.to(device)
        with torch.no_grad():
            bn_w = torch.nn.Parameter(bn_w.detach().to(device))
            bn_b = torch.nn.Parameter(bn_b.detach().to(device))
        x, target, mse_target = x.to(device), target.to(device), mse_target.to(device)

    def op(name, out, **params):
        for k, v in params.items():
            rec.append((f"{name}.{k}", f32(v.cpu())))
        rec.append((f"{name}.dtype", np.array([DDP_DTYPE[out.dtype]], dtype="<i8")))
        rec.append((f"{name}.y", f32(out)))

    with torch.autocast(device, dtype):
        y1 = F.conv2d(x, conv1.weight, conv1.bias)                  # x
        op("conv1", y1, w=conv1.weight, b=conv1.bias)
        bn = F.batch_norm(y1, None, None, bn_w, bn_b, training=True, eps=1e-5)
        op("batch_norm", bn, w=bn_w, b=bn_b)                        # x: conv1.y
        r1 = F.relu(y1)
        y2 = F.conv2d(r1, conv2.weight, conv2.bias)                 # x: relu(conv1.y)
        op("conv2", y2, w=conv2.weight, b=conv2.bias)
        p = F.max_pool2d(y2, 2)
        f = torch.flatten(p, 1)
        h = F.linear(f, fc1.weight, fc1.bias)                       # x: flatten(pool(conv2.y))
        op("fc1", h, b=fc1.bias)                                    # w: formula_weight
        hr = F.relu(h)
        z = F.linear(hr, fc2.weight, fc2.bias)                      # x: relu(fc1.y)
        op("fc2", z, w=fc2.weight, b=fc2.bias)
        mm = torch.mm(hr, fc2.weight.t().contiguous())              # a: relu(fc1.y)
        op("matmul", mm, b=fc2.weight.t().contiguous())
        ls = F.log_softmax(z, dim=1)                                # x: fc2.y
        op("log_softmax", ls)
        nll = F.nll_loss(ls, target)                                # x: log_softmax.y
        op("nll_loss", nll)
        ce = F.cross_entropy(z, target)                             # x: fc2.y
        op("cross_entropy", ce)
        mse = F.mse_loss(z, mse_target)                             # x: fc2.y
        op("mse_loss", mse)
    # The chain conv1 .. nll_loss (dropout left out: it is random), its
    # backward outside the region as PyTorch advises. fc1's weight gradient
    # is stored for 4 rows, with the whole one's sum of squares.
    nll.backward()
    rec.append(("chain.loss", f32(nll.reshape(1))))
    for name, t in [("conv1.w", conv1.weight), ("conv1.b", conv1.bias),
                    ("conv2.w", conv2.weight), ("conv2.b", conv2.bias),
                    ("fc1.b", fc1.bias), ("fc2.w", fc2.weight), ("fc2.b", fc2.bias)]:
        assert t.grad.dtype == torch.float32
        rec.append((f"chain.{name}.grad", f32(t.grad)))
    # 4 rows whose gradient is not zero (a hidden unit relu closed for the
    # whole batch has none), with their indices
    rows = torch.nonzero(fc1.weight.grad.abs().sum(1) > 0).flatten()[:4]
    rec.append(("chain.fc1.w.grad_rows", rows.cpu().numpy().astype("<i8")))
    rec.append(("chain.fc1.w.grad_rows4", f32(fc1.weight.grad[rows])))
    rec.append(("chain.fc1.w.grad_sumsq",
                np.array([float((fc1.weight.grad.double() ** 2).sum())], dtype="<f8")))
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", help="output folder (default tests/fixtures)")
    args = ap.parse_args()
    root = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                    "fixtures")
    print("torch", torch.__version__)
    if int(torch.__version__.split(".")[0]) < 2:
        sys.exit("make_autocast_fixtures.py: needs PyTorch 2.x (/opt/torch-venv/bin/python)")
    torch.set_num_threads(1)
    prefix = "autocast_"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("SKIP: no CUDA device for torch")
            sys.exit(77)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        prefix = "autocast_cuda_"
        print("device", torch.cuda.get_device_name(0))
    for dtype, name, seed in [(torch.bfloat16, "bf16", 42), (torch.float16, "fp16", 43)]:
        path = os.path.join(root, f"{prefix}{name}.bin")
        rec = make(dtype, seed, args.device)
        write_fixture(path, rec)
        print(path, len(rec), "records", os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
