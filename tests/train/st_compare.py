"""Compares the tensors of safetensors files by their bytes, reading the
format by its spec (8-byte little-endian header length, JSON header, data).

  st_compare.py A B          exit 0 when A and B hold the same tensor names,
                             dtypes, shapes and bytes (metadata is ignored:
                             it holds each save's id); else print what differs
  st_compare.py --get F NAME print tensor NAME of F (a scalar or a list)
"""
import json
import struct
import sys

FORMATS = {"F32": "f", "F64": "d", "I64": "q", "I32": "i", "U8": "B"}


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


def main():
    if sys.argv[1] == "--get":
        dtype, shape, data = read(sys.argv[2])[sys.argv[3]]
        vals = struct.unpack("<%d%s" % (len(data) // struct.calcsize(FORMATS[dtype]), FORMATS[dtype]), data)
        print(vals[0] if not shape else list(vals))
        return 0
    a, b = read(sys.argv[1]), read(sys.argv[2])
    bad = sorted(set(a) ^ set(b))
    for k in bad:
        print("only in %s: %s" % (sys.argv[1] if k in a else sys.argv[2], k))
    for k in sorted(set(a) & set(b)):
        if a[k] != b[k]:
            print("differs: %s (%s %s vs %s %s)" % (k, a[k][0], a[k][1], b[k][0], b[k][1]))
            bad.append(k)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
