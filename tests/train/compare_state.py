"""Compares two ddp-train --dump-state files tensor by tensor.

usage: compare_state.py A B [--exact] [--only-params] [--init P0 [--rel-update R]]
                          [--tol REL ABS]

Default (issue 7's tolerance): passes when every tensor of B is in A with the
same size and max|a - b| <= 1e-4 * max|b| + 1e-6 (--tol REL ABS: REL *
max|b| + ABS; issue 23's equivalence bound is --tol 1e-5 1e-7); with
--exact, when every value is bit-identical.

With --init P0 (the state both runs started from), each tensor is measured
against what training changed in it: ||a - b|| <= R * ||b - p0|| (L2 norms
over the tensor, R = --rel-update, default 1e-2). A tensor that training
does not move (||b - p0|| below 1e-3 of ||b||: a convolution's bias before
batch norm, whose gradient is 0 in exact arithmetic; num_batches_tracked's
count is compared exactly) falls back to the default bound. Why this
criterion for the ConvNet: docs/parallel.md, "How close is equal".

Prints the worst tensor; exit 1 on failure.
"""
import math
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


def option(name, default=None):
    if name not in sys.argv:
        return default
    at = sys.argv.index(name)
    if at + 1 >= len(sys.argv):
        sys.exit(f"compare_state.py: {name} needs a value")
    return sys.argv[at + 1]


def max_bound(got, ref, tol):
    """(error, bound) by the tolerance (REL, ABS): issue 7's by default."""
    err = max(abs(x - y) for x, y in zip(got, ref))
    return err, tol[0] * max(abs(y) for y in ref) + tol[1]


def update_bound(got, ref, p0, rel):
    """(error, bound) against the update, or None when training left the tensor in place."""
    moved = math.sqrt(sum((y - z) ** 2 for y, z in zip(ref, p0)))
    if moved <= 1e-3 * math.sqrt(sum(y * y for y in ref)):
        return None
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(got, ref))), rel * moved


def main():
    init_path = option("--init")
    rel = float(option("--rel-update", "1e-2"))
    tol = (1e-4, 1e-6)
    if "--tol" in sys.argv:
        at = sys.argv.index("--tol")
        if at + 2 >= len(sys.argv):
            sys.exit("compare_state.py: --tol needs REL and ABS")
        tol = (float(sys.argv[at + 1]), float(sys.argv[at + 2]))
    skip = {init_path, option("--rel-update")}
    if "--tol" in sys.argv:
        skip |= set(sys.argv[sys.argv.index("--tol") + 1:sys.argv.index("--tol") + 3])
    args = [a for a in sys.argv[1:] if not a.startswith("--") and a not in skip]
    if len(args) != 2:
        sys.exit(__doc__)
    exact = "--exact" in sys.argv
    only_params = "--only-params" in sys.argv
    a, b = load(args[0]), load(args[1])
    p0 = load(init_path) if init_path else None
    worst, failed = None, []
    for name, ref in b.items():
        if only_params and not (name.endswith(".weight") or name.endswith(".bias")):
            continue
        got = a.get(name)
        if got is None or len(got) != len(ref):
            failed.append(f"{name}: missing or of another size in {args[0]}")
            continue
        kind = "max|a-b|"
        if exact or name.endswith("num_batches_tracked"):
            err, bound = max(abs(x - y) for x, y in zip(got, ref)), 0.0
        elif p0 is not None and name in p0 and len(p0[name]) == len(ref) and \
                (measured := update_bound(got, ref, p0[name], rel)) is not None:
            (err, bound), kind = measured, "||a-b||"
        else:
            err, bound = max_bound(got, ref, tol)
        share = err / bound if bound else (math.inf if err else 0.0)
        if worst is None or share > worst[4]:
            worst = (name, err, bound, kind, share)
        if err > bound:
            failed.append(f"{name}: {kind} = {err:.3g} > {bound:.3g}")
    print(f"worst {worst[0]}: {worst[3]} = {worst[1]:.3g} (bound {worst[2]:.3g}), "
          f"{len(b)} tensors")
    for f in failed:
        print("FAIL:", f)
    sys.exit(1 if failed else 0)


main()
