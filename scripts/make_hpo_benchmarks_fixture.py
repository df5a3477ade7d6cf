"""Propulate 1.2.2's benchmark functions at fixed points, the reference for
ddp's (src/hpo/benchmarks.c, tests/hpo/test_hpo_benchmarks.c). For each
function, its limits and 4 points drawn uniformly inside them (numpy,
seeded), one line "NAME LO HI VALUE X0 X1 ..." with repr() floats; quartic
with its noise set to 0 (numpy.random.normal replaced by zeros).
Run with the reference environment's Python:
  /opt/torch-venv/bin/python scripts/make_hpo_benchmarks_fixture.py
"""
import os
import numpy as np
from propulate.utils import benchmark_functions as bf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hpo_benchmarks.txt")
NAMES = ["sphere", "rosenbrock", "step", "quartic", "rastrigin", "griewank", "schwefel", "bisphere", "birastrigin"]
np.random.normal = lambda size=None, **kw: np.zeros(size)  # quartic without its noise
rs = np.random.RandomState(2)
lines = ["# Propulate 1.2.2 benchmark functions: see scripts/make_hpo_benchmarks_fixture.py"]
for name in NAMES:
    fn, limits = bf.get_function_search_space(name)
    (lo, hi), dims = next(iter(limits.values())), len(limits)
    assert all(v == (lo, hi) for v in limits.values())
    for _ in range(4):
        x = rs.uniform(lo, hi, size=dims)
        value = float(fn(dict(zip(limits, (float(v) for v in x)))))
        lines.append(f"{name} {lo!r} {hi!r} {value!r} " + " ".join(repr(float(v)) for v in x))
tmp = OUT + ".tmp"
with open(tmp, "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(tmp, OUT)
