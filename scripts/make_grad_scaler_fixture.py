#!/opt/torch-venv/bin/python
"""Writes tests/fixtures/grad_scaler.txt: PyTorch 2.x's torch.amp.GradScaler
(device "cpu") fed made-up gradient sequences, with infs and NaNs at chosen
steps, step by step: the gradients going in (as backward of the scaled loss
would leave them), the gradients after unscale_, whether an inf/NaN was
found, whether optimizer.step() ran, and the scale and _growth_tracker after
update(). tests/optim/test_grad_scaler.c replays each sequence through
ddp_grad_scaler and must match every bit.

Run with the reference environment's PyTorch (2.x, not Debian's 1.13):
  /opt/torch-venv/bin/python scripts/make_grad_scaler_fixture.py tests/fixtures/grad_scaler.txt

Floats are written as their float32 bits in hex, so NaN payloads and -0
survive; the file is text so a reader can follow a sequence by eye."""
import struct
import sys

import torch


def bits(x):
    return "%08x" % struct.unpack("<I", struct.pack("<f", float(x)))[0]


# name, init_scale, growth_factor, backoff_factor, growth_interval, steps,
# {step: (element, value)} of the non-finite gradients injected (0-based).
SCENARIOS = [
    # Small interval: growth every 3 clean steps, backoffs, back-to-back infs,
    # NaN, -inf, and a skip right at the step the tracker would have grown.
    ("small_interval", 2.0**16, 2.0, 0.5, 3, 40,
     {4: (0, float("inf")), 5: (3, float("nan")), 11: (6, float("-inf")),
      17: (1, float("nan")), 18: (2, float("inf")), 19: (5, float("inf")),
      30: (7, float("nan"))}),
    # PyTorch's defaults: one growth after 2000 clean steps, between infs.
    ("defaults", 2.0**16, 2.0, 0.5, 2000, 2100,
     {5: (0, float("inf")), 10: (2, float("nan")), 2050: (1, float("-inf"))}),
    # Factors that are not powers of two: the float32 rounding of scale *
    # factor (computed in float64) and of the reciprocal (float64 -> float32).
    ("odd_factors", 3.0, 1.7, 0.3, 2, 30,
     {3: (4, float("inf")), 8: (0, float("nan")), 9: (0, float("nan")),
      20: (6, float("inf"))}),
    # Near float32's top: the scale stops growing instead of reaching inf.
    ("overflow_guard", 2.0**126, 2.0, 0.5, 1, 6, {4: (1, float("inf"))}),
]

SHAPES = [(2, 2), (3,), (1,)]  # 8 floats over three parameters


def main(out_path):
    lines = ["# torch.amp.GradScaler('cpu') replays, made by scripts/make_grad_scaler_fixture.py "
             "with torch %s" % torch.__version__,
             "# scenario NAME INIT_SCALE GROWTH_FACTOR BACKOFF_FACTOR GROWTH_INTERVAL N STEPS",
             "# step K in <N float32 bits> out <N float32 bits> found F skipped S scale <bits> "
             "tracker T"]
    n = sum(torch.Size(s).numel() for s in SHAPES)
    for name, init, gf, bf, gi, steps, inject in SCENARIOS:
        gen = torch.Generator().manual_seed(1234)
        params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        opt = torch.optim.SGD(params, lr=1.0)
        calls = [0]
        real_step = opt.step

        def counted_step(*a, **k):
            calls[0] += 1
            return real_step(*a, **k)

        opt.step = counted_step
        scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=gf,
                                      backoff_factor=bf, growth_interval=gi)
        lines.append("scenario %s %r %r %r %d %d %d" % (name, init, gf, bf, gi, n, steps))
        for k in range(steps):
            # scale(loss): what the trainer's seed does; lazily makes _scale.
            scaler.scale(torch.ones(()))
            scale_now = scaler.get_scale()
            # The gradients backward of loss * scale leaves: made-up values
            # of a few binades times the scale, in float32.
            flat = (torch.randn(n, generator=gen) * 2.0 ** torch.randint(-12, 4, (n,), generator=gen))
            flat = (flat.double() * scale_now).float()
            if k in inject:
                i, v = inject[k]
                flat[i] = v
            off = 0
            for p in params:
                m = p.numel()
                p.grad = flat[off:off + m].clone().view(p.shape)
                off += m
            grads_in = flat.clone()
            scaler.unscale_(opt)
            grads_out = torch.cat([p.grad.reshape(-1) for p in params])
            state = scaler._per_optimizer_states[id(opt)]
            found = int(sum(v.item() for v in state["found_inf_per_device"].values()) > 0)
            before = calls[0]
            scaler.step(opt)
            skipped = int(calls[0] == before)
            scaler.update()
            sd = scaler.state_dict()
            lines.append("step %d in %s out %s found %d skipped %d scale %s tracker %d" % (
                k, " ".join(bits(x) for x in grads_in.tolist()),
                " ".join(bits(x) for x in grads_out.tolist()), found, skipped,
                bits(sd["scale"]), sd["_growth_tracker"]))
        sd = scaler.state_dict()
        lines.append("end %s scale %s tracker %d growth_factor %r backoff_factor %r "
                     "growth_interval %d" % (name, bits(sd["scale"]), sd["_growth_tracker"],
                                             sd["growth_factor"], sd["backoff_factor"],
                                             sd["growth_interval"]))
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/grad_scaler.txt")
