"""The ConvNet's first K training steps in float64, the reference that the
data-parallel equivalence is measured against (scripts/dp-divergence.sh,
docs/parallel.md). Same model as seed 001's ConvNet, same initial weights
(a safetensors state dict, e.g. from --save-init), same sample order as
ddp-train (DistributedSampler at one replica, seeded with --seed, epoch 0),
plain or momentum SGD; BatchNorm in training mode over the whole global batch
(what SyncBatchNorm computes on any number of ranks). After every step it
writes the state dict in ddp-train --dump-state's text format (float64 values
printed with 17 digits) to PREFIX.STEP.

  /usr/bin/python3 scripts/torch/float64_trajectory.py --init init.safetensors \
      --steps 10 --batch-size 100 --lr 0.01 --seed 2 --out /tmp/ref
"""
import argparse, json, os, struct, sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_reference import ConvNet, find, read_idx, save_safetensors  # noqa: E402


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    kinds = {"F32": np.float32, "I64": np.int64}
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + begin:8 + n + end], dtype=np.dtype(kinds[e["dtype"]]).newbyteorder("<"))
        out[name] = torch.from_numpy(arr.copy().reshape(e["shape"]))
    return out


def dump(model, path):
    with open(path + ".tmp", "w") as f:
        for name, t in model.state_dict().items():
            flat = t.detach().reshape(-1)
            if t.dtype == torch.int64:
                vals = " ".join(str(int(v)) for v in flat)
            else:
                vals = " ".join(f"{float(v):.17g}" for v in flat)
            f.write(f"{name} {flat.numel()} {vals}\n")
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--init", help="initial state dict (safetensors); without it, PyTorch's init at --seed")
    p.add_argument("--save-init", metavar="PATH", help="write the float32 initial state dict and go on")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--out", required=True, help="prefix: the state after step k goes to PREFIX.k")
    a = p.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    model = ConvNet()
    if a.init:
        model.load_state_dict(read_safetensors(a.init), strict=True)
    if a.save_init:
        save_safetensors(model.state_dict(), a.save_init)
    dtype = torch.float64 if a.dtype == "float64" else torch.float32
    model = model.to(dtype)
    xs = torch.from_numpy(read_idx(find(a.data, "train-images-idx3-ubyte")).astype(np.float32) / 255.0).unsqueeze(1)
    ys = torch.from_numpy(read_idx(find(a.data, "train-labels-idx1-ubyte")).astype(np.int64))
    ds = torch.utils.data.TensorDataset(xs, ys)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=a.seed)
    sampler.set_epoch(0)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    model.train()
    for step, (xb, yb) in enumerate(loader, start=1):
        if step > a.steps:
            break
        opt.zero_grad()
        F.cross_entropy(model(xb.to(dtype)), yb).backward()
        opt.step()
        dump(model, f"{a.out}.{step}")


if __name__ == "__main__":
    main()
