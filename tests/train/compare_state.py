"""Compares two ddp-train --dump-state files tensor by tensor.

usage: compare_state.py A B [--exact] [--only-params]
Passes when every tensor of B is in A with the same size and
max|a - b| <= 1e-4 * max|b| + 1e-6 (issue 7's tolerance), or, with --exact,
when every value is bit-identical. Prints the worst tensor; exit 1 on failure.
"""
import sys


def load(path):
    tensors = {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            name, numel = fields[0], int(fields[1])
            values = [float(v) for v in fields[2:]]
            if len(values) != numel:
                sys.exit(f"{path}: {name} says {numel} values but has {len(values)}")
            tensors[name] = values
    if not tensors:
        sys.exit(f"{path}: no tensors")
    return tensors


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    exact = "--exact" in sys.argv
    only_params = "--only-params" in sys.argv
    a, b = load(args[0]), load(args[1])
    worst, failed = None, []
    for name, ref in b.items():
        if only_params and not (name.endswith(".weight") or name.endswith(".bias")):
            continue
        got = a.get(name)
        if got is None or len(got) != len(ref):
            failed.append(f"{name}: missing or of another size in {args[0]}")
            continue
        err = max(abs(x - y) for x, y in zip(got, ref))
        bound = 0.0 if exact else 1e-4 * max(abs(y) for y in ref) + 1e-6
        if worst is None or err - bound > worst[1] - worst[2]:
            worst = (name, err, bound)
        if err > bound:
            failed.append(f"{name}: max|a-b| = {err:.3g} > {bound:.3g}")
    print(f"worst {worst[0]}: max|a-b| = {worst[1]:.3g} (bound {worst[2]:.3g}), "
          f"{len(b)} tensors")
    for f in failed:
        print("FAIL:", f)
    sys.exit(1 if failed else 0)


main()
