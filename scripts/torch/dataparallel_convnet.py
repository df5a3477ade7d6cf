"""Seed 003's one-line change in PyTorch on the CPU: torch.nn.DataParallel around seed 001's ConvNet
(Fashion-MNIST, SGD lr 0.01 momentum 0.9) in one process. Without GPUs DataParallel runs the module as
it is, so the only parallelism is PyTorch's intra-op threads (--threads). The batch is the whole step's
(--batch 200 = 2 x 100, what two DDP ranks of 100 take together).
Prints one line: 'torch-dp threads=T batch=B steps=S samples_per_s=X final_loss=L'.
Run: /opt/torch-venv/bin/python scripts/torch/dataparallel_convnet.py --threads 2 --batch 200 --steps 200
(scripts/bench-dataparallel.sh runs it beside ddp's DataParallel and the DDP runs.)"""
import argparse, gzip, struct, time
import numpy as np
import torch, torch.nn as nn

DATA = "/usr/share/datasets/fashion-mnist"

def idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic, n = struct.unpack(">II", raw[:8])
    if magic == 2051:
        r, c = struct.unpack(">II", raw[8:16])
        return np.frombuffer(raw, np.uint8, offset=16).reshape(n, 1, r, c)
    return np.frombuffer(raw, np.uint8, offset=8)

class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2))
        self.fc = nn.Linear(7 * 7 * 32, num_classes)
    def forward(self, x):
        x = self.layer2(self.layer1(x))
        return self.fc(x.reshape(x.size(0), -1))

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2); p.add_argument("--batch", type=int, default=200)
    p.add_argument("--steps", type=int, default=200); p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.from_numpy(idx(f"{DATA}/train-images-idx3-ubyte.gz").astype(np.float32) / 255.0)
    y = torch.from_numpy(idx(f"{DATA}/train-labels-idx1-ubyte.gz").astype(np.int64))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=a.batch, shuffle=True)
    model = ConvNet()
    model = torch.nn.DataParallel(model)  # the seed's one line (device_ids: none on the CPU)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    step, t0, loss = 0, None, None
    while step < a.steps + a.warmup:
        for xb, yb in loader:
            if step == a.warmup:
                t0 = time.perf_counter()
            opt.zero_grad(); loss = lossf(model(xb), yb); loss.backward(); opt.step()
            step += 1
            if step >= a.steps + a.warmup:
                break
    dt = time.perf_counter() - t0
    print(f"torch-dp threads={a.threads} batch={a.batch} steps={a.steps} "
          f"samples_per_s={a.steps * a.batch / dt:.1f} final_loss={loss.item():.4f}", flush=True)

if __name__ == "__main__":
    main()
