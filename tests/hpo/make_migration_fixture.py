"""Propulate 1.2.2 on one island of one worker with migration_probability 0.9
(the tutorials' value), pollination on: Propulate's worker draws rng.random()
for the emigration decision every generation even when there is no other
island to send to, so the draw is part of the seeded sequence that ddp's
search must reproduce (tests/hpo/test_hpo_search.c, docs/hpo.md). The mixed
problem of scripts/make_hpo_fixture.py (imported from there), seed 7,
pop_size 6, 100 generations.

Writes tests/hpo/propulate_migration_draw.txt in hpo_propulate.txt's format.
Run with the reference environment's Python:
  /opt/torch-venv/bin/python tests/hpo/make_migration_fixture.py
"""
import logging, os, random, shutil, sys, tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from make_hpo_fixture import PROBLEMS  # noqa: E402
from propulate import Islands  # noqa: E402
from propulate.utils import get_default_propagator, set_logger_config  # noqa: E402

OUT = os.path.join(HERE, "propulate_migration_draw.txt")
GENERATIONS = 100


def main():
    set_logger_config(level=logging.WARNING, log_file=None, log_to_stdout=False, log_rank=False, colors=False)
    name, fn, limits, seed, pop_size = [p for p in PROBLEMS if p[0] == "mixed"][0]
    rng = random.Random(seed + 0)
    propagator = get_default_propagator(pop_size=pop_size, limits=limits, crossover_prob=0.7,
                                        mutation_prob=0.4, random_init_prob=0.1, rng=rng)
    ckpt = tempfile.mkdtemp(prefix="hpo-fixture-")
    try:
        islands = Islands(loss_fn=fn, propagator=propagator, rng=rng, generations=GENERATIONS, num_islands=1,
                          migration_probability=0.9, pollination=True, checkpoint_path=ckpt)
        islands.propulate(logging_interval=10**9, debug=0)
        population = sorted(islands.propulator.population, key=lambda ind: ind.generation)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    assert [ind.generation for ind in population] == list(range(GENERATIONS))
    lines = ["# Propulate 1.2.2, one island of one worker, migration_probability 0.9, pollination: "
             "see tests/hpo/make_migration_fixture.py",
             f"problem {name} {seed} {pop_size} {GENERATIONS}"]
    for ind in population:
        traits = " ".join(f"{k}={ind[k]!r}" if not isinstance(ind[k], str) else f"{k}={ind[k]}" for k in limits)
        lines.append(f"{ind.generation} {ind.loss!r} {traits}")
    with open(OUT + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(OUT + ".tmp", OUT)
    print(f"wrote {OUT}: {len(lines)} lines", file=sys.stderr)


if __name__ == "__main__":
    main()
