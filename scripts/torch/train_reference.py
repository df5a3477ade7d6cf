"""PyTorch reference for ddp-train: trains one of the seeds' models on Fashion-MNIST
(or MNIST) with the same settings ddp-train takes, and prints one JSON line with
test_accuracy, test_loss, train_loss and samples_per_s. Used by
scripts/check-accuracy.sh to compare ddp against PyTorch; run with Debian's
/usr/bin/python3 (python3-torch).

  /usr/bin/python3 scripts/torch/train_reference.py --model convnet --epochs 3 \
      --batch-size 100 --lr 0.01 --momentum 0.9 --seed 1
"""
import argparse, gzip, json, os, struct, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        raw = f.read()
    magic = struct.unpack(">I", raw[:4])[0]
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(data_dir, stem):
    for name in (stem, stem + ".gz"):
        p = os.path.join(data_dir, name)
        if os.path.exists(p):
            return p
    raise SystemExit(f"train_reference: {stem}[.gz] not found in {data_dir}")


class ConvNet(nn.Module):  # seed 001's ConvNet
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.fc = nn.Linear(7 * 7 * 32, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.reshape(x.size(0), -1))


def save_safetensors(state, path):
    """Writes a state dict by the safetensors spec (8-byte little-endian header
    length, JSON header, raw little-endian tensors); Debian has no package."""
    names = {torch.float32: "F32", torch.int64: "I64"}
    header, blobs, offset = {}, [], 0
    for name, t in state.items():
        raw = t.detach().contiguous().numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    os.replace(path + ".tmp", path)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="convnet", choices=["convnet"])
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-init", metavar="PATH",
                   help="write the initial state dict as safetensors (for ddp-train --init PATH)")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    xs = torch.from_numpy(read_idx(find(a.data, "train-images-idx3-ubyte")).astype(np.float32) / 255.0).unsqueeze(1)
    ys = torch.from_numpy(read_idx(find(a.data, "train-labels-idx1-ubyte")).astype(np.int64))
    xt = torch.from_numpy(read_idx(find(a.data, "t10k-images-idx3-ubyte")).astype(np.float32) / 255.0).unsqueeze(1)
    yt = torch.from_numpy(read_idx(find(a.data, "t10k-labels-idx1-ubyte")).astype(np.int64))
    # The order ddp-train walks: DistributedSampler with one replica, seeded
    # with --seed, set_epoch(e) each epoch (torch.randperm from seed + e).
    ds = torch.utils.data.TensorDataset(xs, ys)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=a.seed)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, sampler=sampler)
    model = ConvNet()
    if a.save_init:
        save_safetensors(model.state_dict(), a.save_init)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    losses, t_train = [], 0.0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        losses = []
        t0 = time.perf_counter()
        for xb, yb in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        t_train += time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(xt[i:i + 1000]) for i in range(0, len(xt), 1000)])
        test_loss = F.cross_entropy(logits, yt).item()
        acc = (logits.argmax(1) == yt).float().mean().item()
    print(json.dumps({"test_accuracy": acc, "test_loss": test_loss, "train_loss": float(np.mean(losses)),
                      "samples_per_s": len(xs) * a.epochs / t_train, "epochs": a.epochs}))


if __name__ == "__main__":
    main()
