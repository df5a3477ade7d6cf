/* ddp hpo: hyperparameter search, Propulate's asynchronous evolutionary
 * algorithm in C (docs/hpo.md): a search space, a random generator that
 * draws as CPython's random.Random does (so a search seeded like
 * Propulate's reproduces its individuals), Propulate's default propagator,
 * and the search over workers (multi-rank, on subgroups) and islands with
 * migration, with checkpoints it resumes from exactly.
 *
 *   ddp_hpo_space *space;
 *   DDP_TRY(ddp_hpo_space_parse("layers=int:2:10,act=cat:relu|tanh,lr=logfloat:1e-4:1e-2",
 *                               &space));
 *   ddp_hpo_options o = ddp_hpo_defaults();
 *   o.generations = 100;
 *   ddp_hpo_result r;
 *   DDP_TRY(ddp_hpo_search(space, &o, my_loss, user, &r));   // loss(values, user)
 *   ... r.individuals[i].values[trait], .loss ...
 *   ddp_hpo_result_free(&r);
 *   ddp_hpo_space_destroy(space); */
#ifndef DDP_HPO_H
#define DDP_HPO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- A Python-compatible random generator ----------------------------------
 * CPython 3.11's random.Random: MT19937 seeded from an integer as CPython
 * seeds it (init_by_array over the integer's 32-bit words), and each method
 * computing what CPython's computes from the same state, bit for bit. */
typedef struct ddp_pyrandom {
  uint32_t mt[624];
  int index;
  bool has_gauss_next; /* gauss() keeps its second value for the next call */
  double gauss_next;
} ddp_pyrandom;

void ddp_pyrandom_seed(ddp_pyrandom *r, int64_t seed); /* random.Random(seed) */
uint32_t ddp_pyrandom_uint32(ddp_pyrandom *r);          /* one MT19937 output */
double ddp_pyrandom_random(ddp_pyrandom *r);            /* random(): [0, 1), 53 bits */
uint64_t ddp_pyrandom_getrandbits(ddp_pyrandom *r, int k); /* 0 <= k <= 64 */
uint64_t ddp_pyrandom_below(ddp_pyrandom *r, uint64_t n);  /* _randbelow(n), n >= 1 */
int64_t ddp_pyrandom_randint(ddp_pyrandom *r, int64_t a, int64_t b); /* a <= b */
double ddp_pyrandom_uniform(ddp_pyrandom *r, double a, double b);
double ddp_pyrandom_gauss(ddp_pyrandom *r, double mu, double sigma);

/* ---- Search spaces ---------------------------------------------------------- */

typedef enum ddp_hpo_trait_kind {
  DDP_HPO_INT = 0,      /* an integer in [lo, hi], bounds included (Propulate's ordinal) */
  DDP_HPO_FLOAT = 1,    /* a real in [lo, hi], uniform (Propulate's interval) */
  DDP_HPO_LOGFLOAT = 2, /* a real in [lo, hi], uniform in log(x): learning rates (ddp's own) */
  DDP_HPO_CATEGORICAL = 3, /* one of n_choices names (Propulate's categorical) */
} ddp_hpo_trait_kind;

/* One trait. An individual holds one double per trait: the integer, the
 * real, or the index of the choice. Bounds are kept with lo <= hi whatever
 * order they were given in (Propulate's tutorial writes lr as (0.01,
 * 0.0001), and its clamp then pins every mutated lr to 0.01: ddp does not
 * copy that). */
typedef struct ddp_hpo_trait {
  const char *name;
  ddp_hpo_trait_kind kind;
  double lo, hi;              /* INT, FLOAT, LOGFLOAT */
  int n_choices;              /* CATEGORICAL */
  const char *const *choices; /* CATEGORICAL: n_choices names */
} ddp_hpo_trait;

typedef struct ddp_hpo_space ddp_hpo_space;

/* Parses "name=int:LO:HI,name=float:LO:HI,name=logfloat:LO:HI,
 * name=cat:A|B|C" (traits in that order: the order of the individual's
 * values and of crossover; point mutation picks among the names sorted, as
 * Propulate). Errors name the trait and what is wrong ("lr: logfloat needs
 * bounds > 0, got 0"). Free with ddp_hpo_space_destroy. */
ddp_status ddp_hpo_space_parse(const char *spec, ddp_hpo_space **out);
int ddp_hpo_space_size(const ddp_hpo_space *space);
const ddp_hpo_trait *ddp_hpo_space_trait(const ddp_hpo_space *space, int i);
/* The index of the trait called name, or -1. */
int ddp_hpo_space_find(const ddp_hpo_space *space, const char *name);
/* "layers=4 act=tanh lr=0.00123" into buf (always NUL-terminated). */
void ddp_hpo_format(const ddp_hpo_space *space, const double *values, char *buf, size_t bytes);
void ddp_hpo_space_destroy(ddp_hpo_space *space);

/* ---- Benchmark functions ------------------------------------------------------
 * Propulate's (its paper's and utils/benchmark_functions.py): sphere (2-D),
 * rosenbrock (2), step (5), quartic (30), rastrigin (20), griewank (10),
 * schwefel (10), bisphere (30), birastrigin (30), each over float traits
 * named as Propulate names them (a..z, A1, B1, ...) with its limits. */
typedef double (*ddp_hpo_benchmark_fn)(const double *x, int n);

/* The function called name, its dimension and its search space (a spec for
 * ddp_hpo_space_parse, written into space; any output may be NULL).
 * DDP_ERR_NOTFOUND lists the names. quartic's function here is noiseless;
 * ddp_hpo_quartic adds Propulate's N(0, 1) noise per term from `noise`. */
ddp_status ddp_hpo_benchmark(const char *name, ddp_hpo_benchmark_fn *fn, int *dims, char *space,
                             size_t space_bytes);
double ddp_hpo_quartic(const double *x, int n, ddp_pyrandom *noise);

/* ---- The search ------------------------------------------------------------- */

/* Propulate's default propagator and its loop. Start from
 * ddp_hpo_defaults(): generations 100 and, as Propulate's
 * get_default_propagator, pop_size 4 (Propulate's tutorials use 2 x ranks),
 * crossover 0.7, point mutation 0.4, random re-initialisation 0.1, sigma
 * factor 0.05; the rest as given in parentheses below. */
typedef struct ddp_hpo_options {
  int64_t generations;     /* evaluations of this worker (> 0) */
  int pop_size;            /* breeding population: the best pop_size active individuals */
  double crossover_prob;   /* Propulate's CrossoverUniform(crossover_prob): each trait is
                            * parent 2's when a draw exceeds it (so with probability
                            * 1 - crossover_prob); the crossover itself always runs */
  double mutation_prob;    /* point mutation: one trait redrawn */
  double random_init_prob; /* the child replaced by a fresh random individual */
  double sigma_factor;     /* interval mutation: sigma = sigma_factor * (hi - lo) */
  int64_t seed;            /* the generator is random.Random(seed + worker's first rank) */
  int ranks_per_worker;    /* ranks that train each individual together (1) */
  /* How often a worker takes in its island's new individuals and sends its
   * own, at most (seconds; 0.001): every generation when an evaluation
   * takes longer, as Propulate; with a free objective, the exchange does not
   * cap the rate. */
  double exchange_interval_s;
  /* Islands (Propulate's Islands): the workers split into `islands`
   * contiguous blocks, sizes as even as possible (the first ones one larger).
   * Each generation a worker sends emigrants with probability
   * migration_prob / its island's size, num_migrants to every other island
   * (Propulate's default topology). Pollination (default, as Propulate's):
   * copies of the best active individuals go, and each arrival replaces
   * (deactivates) the worst active individual of the worker it is assigned
   * to; real migration: the worker's own best active ones go and are
   * deactivated at home. */
  int islands;             /* 1 */
  double migration_prob;   /* 0.9 (Propulate's tutorials) */
  int num_migrants;        /* 1 */
  bool pollination;        /* true */
  /* Checkpoints (docs/hpo.md, "Checkpoints"): each worker's first rank
   * keeps a journal of everything that entered its population in
   * checkpoint_dir, committed (written, fsync'd, with its generator's state)
   * at most every checkpoint_interval_s and at the end. NULL: none. */
  const char *checkpoint_dir;
  double checkpoint_interval_s; /* 1.0 */
  /* Continue the search in checkpoint_dir (or start one there if it holds
   * none). Without it, a directory holding a search is refused. */
  bool resume;
  /* The caller's own options that a resumed search must share (e.g. the
   * objective's), "key=value" lines; stored with the search's. May be NULL. */
  const char *fingerprint;
  uint64_t reserved[3];
} ddp_hpo_options;
DDP_STRUCT_SIZE(ddp_hpo_options, 152);

ddp_hpo_options ddp_hpo_defaults(void);

/* The loss of one individual (values: one per trait). With multi-rank
 * workers every rank of the worker calls it at once with the same values
 * and `worker`, the worker's process group (NULL for a worker of one
 * rank), to train together (data-parallel on that group, through the
 * trainer); the worker's first rank's return value is the loss. A failed
 * evaluation returns INFINITY (NaN is taken as INFINITY). */
typedef double (*ddp_hpo_objective)(const ddp_hpo_space *space, const double *values,
                                    ddp_process_group *worker, void *user);

typedef struct ddp_hpo_individual {
  double *values; /* one per trait (owned by the result) */
  double loss;
  int64_t generation; /* its worker's evaluation index: (worker, generation) names it */
  int island, worker; /* where it was bred: island, and worker (0..workers-1 over the world) */
  int current;         /* the worker of its island now responsible for it (island-local) */
  int migration_steps; /* islands it moved through; copies differ by it */
  bool active;         /* breeds; migration and replacement deactivate */
  double start_s, end_s; /* evaluation window (ddp_time_s) */
} ddp_hpo_individual;

typedef struct ddp_hpo_result {
  ddp_hpo_individual *individuals; /* in evaluation order */
  int64_t count;
  int64_t best; /* index of the lowest loss (first of equals), -1 if none */
} ddp_hpo_result;

/* Runs the search of one worker on one island: generations times, breed a
 * child from the active population (a fresh random individual while fewer
 * than pop_size are known), evaluate it, add it. Deterministic for a seed:
 * with the same space, options and objective it evaluates the individuals
 * Propulate 1.2.2 evaluates with random.Random(seed), in the same order
 * (docs/hpo.md says where the two differ). */
ddp_status ddp_hpo_search(const ddp_hpo_space *space, const ddp_hpo_options *options,
                          ddp_hpo_objective objective, void *user, ddp_hpo_result *result);

/* The search over a world of processes: ranks_per_worker consecutive ranks
 * form a worker (a split of `world`, made once; its first rank breeds and
 * sends the individual to the others, all of them evaluate it), and the
 * workers form `islands` islands: each worker sends what it evaluated to
 * its island's other workers through `store` (the job's key-value store,
 * borrowed; keys under "hpo/") and takes in what they evaluated, and
 * migrants come and go between islands, all without waiting for anyone, as
 * Propulate's workers do. Collective over `world` (a barrier at the start
 * and at the end, after which every worker's first rank holds its island's
 * individuals, active and not, in *result; the other ranks get an empty
 * result). The world's size must be a multiple of ranks_per_worker. */
ddp_status ddp_hpo_search_world(const ddp_hpo_space *space, const ddp_hpo_options *options,
                                ddp_hpo_objective objective, void *user,
                                ddp_process_group *world, ddp_store *store,
                                ddp_hpo_result *result);
void ddp_hpo_result_free(ddp_hpo_result *result);

#ifdef __cplusplus
}
#endif

#endif /* DDP_HPO_H */
