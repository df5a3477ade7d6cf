"""Fashion-MNIST with a short test set, for tests whose final evaluation
must stay short under ASan: the training files linked, the test files cut
to their first KEEP images.

usage: fashion_small.py SRC DST KEEP"""
import gzip
import os
import struct
import sys

src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(dst)
for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
    os.symlink(f"{src}/{name}.gz", f"{dst}/{name}.gz")
for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
    raw = gzip.open(f"{src}/{name}.gz").read()
    ndim = raw[3]
    dims = list(struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim]))
    per = 1
    for d in dims[1:]:
        per *= d
    dims[0] = keep
    head = raw[:4] + struct.pack(f">{ndim}I", *dims)
    open(f"{dst}/{name}", "wb").write(head + raw[4 + 4 * ndim: 4 + 4 * ndim + keep * per])
