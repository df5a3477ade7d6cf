"""CPython's random.Random, as the reference for ddp's Python-compatible
generator (src/hpo/pyrandom.c, tests/hpo/test_pyrandom.c). For each seed,
one line per call, in order, each value as repr() (exact):

  seed S
  random V          getrandbits K V     below N V      randint A B V
  uniform A B V     gauss MU SIGMA V    sample N K I0 I1 ...   shuffle N I0 I1 ...

Run with a CPython 3.11 (the version whose algorithms ddp follows):
  python3 scripts/make_pyrandom_fixture.py   -> tests/fixtures/pyrandom.txt
"""
import os, random, sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "pyrandom.txt")
assert sys.version_info[:2] == (3, 11), "CPython 3.11's algorithms (randbelow, sample) are the reference"

lines = []
for seed in (0, 1, 42, 12345, -7, 2**32 + 5, 2**40 + 123):
    r = random.Random(seed)
    lines.append(f"seed {seed}")
    for _ in range(3):
        lines.append(f"random {r.random()!r}")
    for k in (1, 5, 31, 32, 33, 53, 64):
        lines.append(f"getrandbits {k} {r.getrandbits(k)}")
    for n in (1, 2, 3, 7, 10, 1000, 2**31 + 11, 2**33 - 1):
        lines.append(f"below {n} {r._randbelow(n)}")
    for a, b in ((2, 10), (-5, 5), (0, 1), (1, 1), (0, 2**40)):
        lines.append(f"randint {a} {b} {r.randint(a, b)}")
    for a, b in ((-5.12, 5.12), (1e-4, 1e-2), (0.5, 0.999)):
        lines.append(f"uniform {a!r} {b!r} {r.uniform(a, b)!r}")
    for mu, sigma in ((0.0, 1.0), (2.5, 0.512), (-1.0, 3.0)):
        lines.append(f"gauss {mu!r} {sigma!r} {r.gauss(mu, sigma)!r}")
    for n, k in ((4, 2), (21, 2), (22, 2), (30, 7), (200, 2), (3, 1), (100, 90)):
        lines.append(f"sample {n} {k} " + " ".join(str(i) for i in r.sample(range(n), k)))
    for n in (1, 2, 9):
        x = list(range(n))
        r.shuffle(x)
        lines.append(f"shuffle {n} " + " ".join(str(i) for i in x))
    lines.append(f"random {r.random()!r}")
tmp = OUT + ".tmp"
with open(tmp, "w") as f:
    f.write("# CPython %d.%d.%d random.Random: see scripts/make_pyrandom_fixture.py\n" % sys.version_info[:3])
    f.write("\n".join(lines) + "\n")
os.replace(tmp, OUT)
