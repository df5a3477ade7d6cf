"""PyTorch reference for ddp's GPU training step (issue 26): the seeds' ConvNet
(../shared/refs/torch_ddp_convnet.py: two Conv2d-BatchNorm-ReLU-MaxPool layers
and a Linear, CrossEntropyLoss, SGD lr 0.01 momentum 0.9) trained eagerly on
one GPU by one process, TF32 off, on synthetic data already on the device.
For each batch size: warm-up steps, then R rounds of S steps, each round timed
between two torch.cuda.synchronize() calls. Prints one JSON line per batch
size and variant:
  {"impl": "torch", "variant": "eager", "batch": B, "samples_per_s_rounds": [...],
   "samples_per_s_median": X, "step_us_median": U, "torch": "2.x", "device": "...",
   "cudnn_deterministic": false, "final_loss": L, ...}
Variants: eager (PyTorch's defaults), deterministic (cudnn.deterministic),
graph (the whole step captured once with torch.cuda.graphs and replayed: what
PyTorch reaches without launch overhead, for information).
With --autocast bf16 (fp16) the forward and the loss run under
torch.autocast(device, dtype), backward outside it (PyTorch's recipe; no
GradScaler: the step's speed), and each record says "autocast": "bf16"
(scripts/gpu-amp-steps.sh, issue 42).
Without torch or without a CUDA device it prints why and exits 77 (skipped).
Used by scripts/gpu-check.sh; by hand:
  python3 scripts/torch/gpu_convnet_step.py --batch 100 1024 --deterministic --cuda-graph
"""
import argparse, json, statistics, sys, time

SKIP = 77


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[100, 1024], help="batch sizes (default 100 1024)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per batch size (default 5)")
    p.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default 20)")
    p.add_argument("--deterministic", action="store_true",
                   help="also run with torch.backends.cudnn.deterministic=True")
    p.add_argument("--only-deterministic", action="store_true",
                   help="run only the deterministic variant (not the default eager one)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also run the whole step captured as one CUDA graph (torch.cuda.graphs)")
    p.add_argument("--device", default="cuda",
                   help="cuda (default), or cpu to try this script where there is no GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--autocast", choices=["bf16", "fp16"],
                   help="forward and loss under torch.autocast in this dtype")
    a = p.parse_args()
    if min(a.batch) < 1 or a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        p.error("batch sizes, rounds and steps must be positive, warmup not negative")
    return a


def skip(why):
    print(json.dumps({"impl": "torch", "skipped": why}), flush=True)
    print(f"gpu_convnet_step: skipped: {why}", file=sys.stderr, flush=True)
    sys.exit(SKIP)


def build_convnet(nn):
    """The seeds' ConvNet, as in ../shared/refs/torch_ddp_convnet.py."""

    class ConvNet(nn.Module):
        def __init__(self, num_classes=10):
            super().__init__()
            self.layer1 = nn.Sequential(nn.Conv2d(1, 16, 5, 1, 2), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2, 2))
            self.layer2 = nn.Sequential(nn.Conv2d(16, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2))
            self.fc = nn.Linear(7 * 7 * 32, num_classes)

        def forward(self, x):
            x = self.layer2(self.layer1(x))
            return self.fc(x.reshape(x.size(0), -1))

    return ConvNet()


def measure(torch, a, batch, variant):
    """One batch size and variant: returns the JSON record."""
    nn = torch.nn
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.backends.cudnn.deterministic = variant == "deterministic"
    torch.manual_seed(a.seed)
    model = build_convnet(nn).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = nn.CrossEntropyLoss()
    # Synthetic data, already on the device: pixels in [0, 1) like the
    # scaled Fashion-MNIST images, labels uniform over the 10 classes.
    x = torch.rand(batch, 1, 28, 28, device=dev)  # (B, 1, 28, 28)
    y = torch.randint(0, 10, (batch,), device=dev)  # (B,)

    import contextlib
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.autocast)

    def region():
        return torch.autocast(dev.type, amp_dtype) if amp_dtype else contextlib.nullcontext()

    def step():
        opt.zero_grad()
        with region():
            loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        return loss

    if variant == "graph":
        if not cuda:
            print("gpu_convnet_step: the graph variant needs CUDA; left out on cpu", file=sys.stderr)
            return None
        # PyTorch's whole-network capture recipe: warm up on a side stream
        # (so the momentum buffers and cuDNN/cuBLAS workspaces exist), then
        # capture one step; gradients are set to None before the capture so
        # that backward allocates them from the graph's private pool.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(3, a.warmup)):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            with region():
                static_loss = lossf(model(x), y)
            static_loss.backward()
            opt.step()

        def run():
            graph.replay()
            return static_loss
    else:
        for _ in range(a.warmup):
            step()
        run = step

    sync()
    rounds = []
    loss = None
    for _ in range(a.rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = run()
        sync()
        rounds.append(a.steps * batch / (time.perf_counter() - t0))
    med = statistics.median(rounds)
    final_loss = float(loss.item())
    return {
        "impl": "torch",
        "variant": variant,
        "batch": batch,
        "samples_per_s_rounds": [round(r, 1) for r in rounds],
        "samples_per_s_median": round(med, 1),
        "step_us_median": round(batch / med * 1e6, 2),
        "rounds": a.rounds,
        "steps": a.steps,
        "warmup": a.warmup,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
        "final_loss": round(final_loss, 5),
        "autocast": a.autocast,
        "finite": final_loss == final_loss and abs(final_loss) != float("inf"),
    }


def main():
    a = parse_args()
    try:
        import torch
    except ImportError as e:
        skip(f"no torch in {sys.executable} ({e})")
    if a.device == "cuda" and not torch.cuda.is_available():
        skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    # float32 as computed without TF32, like ddp's kernels (issue 26).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    variants = [] if a.only_deterministic else ["eager"]
    if a.deterministic or a.only_deterministic:
        variants.append("deterministic")
    if a.cuda_graph:
        variants.append("graph")
    bad = 0
    for batch in a.batch:
        for variant in variants:
            try:
                rec = measure(torch, a, batch, variant)
            except Exception as e:  # one variant failing (a capture error) must not hide the others
                rec = {"impl": "torch", "variant": variant, "batch": batch, "error": f"{type(e).__name__}: {e}"}
                # The graph variant is for information: its failure is
                # reported, not a failure of the reference.
                bad += variant != "graph"
            if rec is None:
                continue
            if rec.get("finite") is False:
                bad += 1
            print(json.dumps(rec), flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
