"""Propulate 1.2.2 on one of its benchmark functions, for comparing search
quality with ddp-hpo (scripts/hpo-quality.sh). Every rank seeds
random.Random(seed + rank), as Propulate's tutorials do; default propagator
with pop_size 2 x ranks; islands with migration probability 0.9 and
pollination (Propulate's tutorial settings). Prints on rank 0:
"best F" (the lowest loss any rank saw).
Run: mpirun --allow-run-as-root --oversubscribe -np 2 PY propulate_bench.py --function rastrigin
     --islands 2 --generations 200 --seed 3
"""
import argparse, logging, random, shutil, tempfile

from mpi4py import MPI
from propulate import Islands
from propulate.utils import get_default_propagator, set_logger_config
from propulate.utils.benchmark_functions import get_function_search_space

p = argparse.ArgumentParser()
p.add_argument("--function", default="sphere")
p.add_argument("--generations", type=int, default=200)
p.add_argument("--islands", type=int, default=1)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
comm = MPI.COMM_WORLD
fn, limits = get_function_search_space(a.function)
ckpt = comm.bcast(tempfile.mkdtemp(prefix="propulate-q-") if comm.rank == 0 else None, root=0)
set_logger_config(level=logging.WARNING, log_file=None, log_to_stdout=False, log_rank=False, colors=False)
rng = random.Random(a.seed + comm.rank)
propagator = get_default_propagator(pop_size=2 * comm.size, limits=limits, crossover_prob=0.7,
                                    mutation_prob=0.4, random_init_prob=0.1, rng=rng)
islands = Islands(loss_fn=fn, propagator=propagator, rng=rng, generations=a.generations,
                  num_islands=a.islands, migration_probability=0.9, pollination=True,
                  checkpoint_path=ckpt)
islands.propulate(logging_interval=10**9, debug=0)
best = min((ind.loss for ind in islands.propulator.population), default=float("inf"))
best = comm.allreduce(best, op=MPI.MIN)
if comm.rank == 0:
    print(f"best {best!r}", flush=True)
    shutil.rmtree(ckpt, ignore_errors=True)
