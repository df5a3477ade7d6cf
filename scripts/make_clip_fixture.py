#!/opt/torch-venv/bin/python
"""PyTorch fixture for gradient-norm clipping (ddp-train --clip-grad-norm).

Takes the gradients PyTorch computed for the toy model and the ConvNet (the
"<param>.grad" records of tests/fixtures/model_toy.bin and model_convnet.bin,
written by scripts/make_fixtures.py), puts them on parameters in the same
order, and runs torch.nn.utils.clip_grad_norm_ (norm_type 2, foreach as
PyTorch picks on the CPU) with two max_norms: one below the total norm (the
gradients are scaled) and one above it (clip_coef clamps to 1). Writes
tests/fixtures/clip_grad_norm.bin (DDPFIX01, tests/support/fixture.c) with,
for MODEL in toy, convnet and CASE in 0, 1:

  MODEL:CASE:max_norm          float64, shape ()
  MODEL:CASE:total_norm        float32, shape (): what clip_grad_norm_ returns
  MODEL:CASE:<param>.grad      float32: the gradient after clipping (case 0
                               only: in case 1 PyTorch multiplies by 1.0 and
                               the gradients are model_MODEL.bin's, asserted
                               here)

Run: /opt/torch-venv/bin/python scripts/make_clip_fixture.py
"""
import os
import struct

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "tests", "fixtures")
MAGIC = b"DDPFIX01"
SIZES = {0: 4, 1: 8, 3: 8, 5: 2}


def read_fixture(path):
    """[(name, dtype, shape, bytes)] in file order."""
    data = open(path, "rb").read()
    assert data[:8] == MAGIC, path
    count, _ = struct.unpack_from("<II", data, 8)
    off, out = 16, []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, off)
        off += 2
        name = data[off:off + n].decode()
        off += n
        dtype, ndim = struct.unpack_from("<BB", data, off)
        off += 2
        shape = struct.unpack_from("<%dq" % ndim, data, off)
        off += 8 * ndim
        numel = int(np.prod(shape)) if ndim else 1
        raw = data[off:off + numel * SIZES[dtype]]
        off += numel * SIZES[dtype]
        out.append((name, dtype, shape, raw))
    return out


def record(name, dtype, shape, raw):
    nb = name.encode()
    head = struct.pack("<H", len(nb)) + nb + struct.pack("<BB", dtype, len(shape))
    head += b"".join(struct.pack("<q", s) for s in shape)
    return head + raw


def main():
    torch.set_num_threads(1)
    records = []
    for model in ("toy", "convnet"):
        grads = [(n[:-5], shape, np.frombuffer(raw, "<f4").reshape(shape))
                 for n, dtype, shape, raw in read_fixture(os.path.join(FIX, "model_%s.bin" % model))
                 if n.endswith(".grad")]
        assert all(dtype == 0 for n, dtype, _, _ in read_fixture(os.path.join(FIX, "model_%s.bin" % model))
                   if n.endswith(".grad"))
        norm = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for _, _, g in grads)))
        # A max_norm a third of the norm (scaled) and one three times it (not).
        for case, max_norm in enumerate((round(norm / 3, 4), round(norm * 3, 4))):
            params = []
            for _, _, g in grads:
                p = torch.nn.Parameter(torch.zeros(g.shape))
                p.grad = torch.from_numpy(g.copy())
                params.append(p)
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
            records.append(record("%s:%d:max_norm" % (model, case), 1, (),
                                  struct.pack("<d", max_norm)))
            records.append(record("%s:%d:total_norm" % (model, case), 0, (),
                                  total.numpy().astype("<f4").tobytes()))
            for (name, shape, g), p in zip(grads, params):
                if max_norm > norm:  # multiplied by 1.0: unchanged (asserted), not stored
                    assert np.array_equal(p.grad.numpy(), g), name
                    continue
                records.append(record("%s:%d:%s.grad" % (model, case, name), 0, shape,
                                      p.grad.numpy().astype("<f4").tobytes()))
            print("%-8s case %d: norm %.6f max_norm %g -> %s" % (
                model, case, total.item(), max_norm, "scaled" if max_norm < norm else "unchanged"))
    path = os.path.join(FIX, "clip_grad_norm.bin")
    with open(path + ".tmp", "wb") as f:
        f.write(MAGIC + struct.pack("<II", len(records), 0))
        for r in records:
            f.write(r)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
