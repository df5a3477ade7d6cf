/* The search loop (Propulate's Propulator): each worker's first rank breeds
 * from the active population it knows, the worker evaluates, and the
 * individual joins the population and goes to the island's other workers;
 * arrivals from them join as they come. One worker of one rank is the
 * plain loop; several workers exchange through the store (exchange.c);
 * a worker of several ranks trains each individual together. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpo/hpo_internal.h"

ddp_hpo_options ddp_hpo_defaults(void) {
  ddp_hpo_options o = {0};
  o.generations = 100;
  o.pop_size = 4;
  o.crossover_prob = 0.7;
  o.mutation_prob = 0.4;
  o.random_init_prob = 0.1;
  o.sigma_factor = 0.05;
  o.seed = 0;
  o.ranks_per_worker = 1;
  o.exchange_interval_s = 0.001;
  o.islands = 1;
  o.migration_prob = 0.9;
  o.num_migrants = 1;
  o.pollination = true;
  o.checkpoint_interval_s = 1.0;
  return o;
}

static ddp_status check_options(const ddp_hpo_options *o) {
  if (o->generations < 1)
    return ddp_error(DDP_ERR_INVALID, "hpo: generations is %lld (>= 1)", (long long)o->generations);
  if (o->pop_size < 2)
    return ddp_error(DDP_ERR_INVALID, "hpo: pop_size is %d (>= 2: breeding takes two parents)",
                     o->pop_size);
  if (o->ranks_per_worker < 1)
    return ddp_error(DDP_ERR_INVALID, "hpo: ranks_per_worker is %d (>= 1)", o->ranks_per_worker);
  if (o->islands < 1)
    return ddp_error(DDP_ERR_INVALID, "hpo: islands is %d (>= 1)", o->islands);
  if (o->num_migrants < 1)
    return ddp_error(DDP_ERR_INVALID, "hpo: num_migrants is %d (>= 1)", o->num_migrants);
  if (!(o->migration_prob >= 0 && o->migration_prob <= 1))
    return ddp_error(DDP_ERR_INVALID, "hpo: migration_prob is %g (in [0, 1])", o->migration_prob);
  if (!(o->checkpoint_interval_s >= 0))
    return ddp_error(DDP_ERR_INVALID, "hpo: checkpoint_interval_s is %g (>= 0)",
                     o->checkpoint_interval_s);
  if (o->resume && !o->checkpoint_dir)
    return ddp_error(DDP_ERR_INVALID, "hpo: resume needs a checkpoint_dir");
  if (!(o->exchange_interval_s >= 0))
    return ddp_error(DDP_ERR_INVALID, "hpo: exchange_interval_s is %g (>= 0)",
                     o->exchange_interval_s);
  const double p[4] = {o->crossover_prob, o->mutation_prob, o->random_init_prob, o->sigma_factor};
  static const char *const names[4] = {"crossover_prob", "mutation_prob", "random_init_prob",
                                       "sigma_factor"};
  for (int i = 0; i < 4; i++)
    if (!(p[i] >= 0 && p[i] <= 1))
      return ddp_error(DDP_ERR_INVALID, "hpo: %s is %g (in [0, 1])", names[i], p[i]);
  return DDP_OK;
}

void ddp_hpo_result_free(ddp_hpo_result *r) {
  if (!r) return;
  if (r->individuals && r->count > 0) ddp_free(r->individuals[0].values); /* one block for all */
  ddp_free(r->individuals);
  *r = (ddp_hpo_result){.best = -1};
}

/* ---- What a worker knows ---------------------------------------------------- */

/* Every individual this worker knows, in the order it learnt of them (its
 * own and arrivals), sized once for the whole search: capacity is every
 * worker's generations. best[] is SelectMin's view (ddp__hpo_rank_insert). */
typedef struct population {
  int traits, pop_size;
  int64_t count, cap;
  ddp_hpo_individual *inds;
  double *values;
  const double **views;
  int64_t *best;
  double *best_loss;
  int n_best;
  int64_t n_active;
  int64_t best_overall;
  /* Deactivations that came before their individual (Propulate's
   * `replaced` / `emigrated` lists): retried after every poll. */
  ddp_hpo_individual *pending_deact;
  int64_t n_pending_deact, cap_pending_deact;
  /* Evaluations known, one bit per (worker, generation): a resumed worker
   * sends its evaluations again, and the others keep the first copy. */
  uint8_t *seen;
  int64_t generations;
} population;

static void population_free(population *p) {
  ddp_free(p->seen);
  ddp_free(p->pending_deact);
  ddp_free(p->inds);
  ddp_free(p->values);
  ddp_free(p->views);
  ddp_free(p->best);
  ddp_free(p->best_loss);
}

static ddp_status population_init(population *p, int traits, int pop_size, int64_t cap,
                                  int workers, int64_t generations) {
  *p = (population){.traits = traits, .pop_size = pop_size, .cap = cap, .best_overall = -1,
                    .generations = generations};
  p->seen = ddp_calloc((size_t)((workers * generations + 7) / 8), 1);
  p->inds = ddp_calloc((size_t)cap, sizeof *p->inds);
  p->values = ddp_calloc((size_t)(cap * traits) + 1, sizeof *p->values);
  p->views = ddp_calloc((size_t)cap, sizeof *p->views);
  p->best = ddp_calloc((size_t)pop_size, sizeof *p->best);
  p->best_loss = ddp_calloc((size_t)pop_size, sizeof *p->best_loss);
  if (!p->inds || !p->values || !p->views || !p->best || !p->best_loss || !p->seen) {
    population_free(p);
    return ddp_error(DDP_ERR_NOMEM, "hpo: no memory for %lld individuals", (long long)cap);
  }
  for (int64_t i = 0; i < cap; i++) p->inds[i].values = p->values + i * traits;
  return DDP_OK;
}

/* The next slot; the caller fills it and calls population_add. */
static ddp_hpo_individual *population_next(population *p) {
  return p->count < p->cap ? &p->inds[p->count] : NULL;
}

/* Whether evaluation (worker, generation) is known; marks it known. */
static bool seen_before(population *p, const ddp_hpo_individual *ind) {
  int64_t bit = (int64_t)ind->worker * p->generations + ind->generation;
  if (bit < 0 || ind->generation >= p->generations) return false;
  bool was = p->seen[bit / 8] & (1u << (bit % 8));
  p->seen[bit / 8] |= (uint8_t)(1u << (bit % 8));
  return was;
}

static void population_add(population *p) {
  ddp_hpo_individual *ind = &p->inds[p->count];
  if (isnan(ind->loss)) ind->loss = INFINITY;
  p->views[p->count] = ind->values;
  if (ind->active) {
    ddp__hpo_rank_insert(p->best, p->best_loss, &p->n_best, p->pop_size, p->count, ind->loss);
    p->n_active++;
  }
  if (p->best_overall < 0 || ind->loss < p->inds[p->best_overall].loss) p->best_overall = p->count;
  p->count++;
}

/* A copy of *ind in the next slot (values copied). */
static ddp_status population_append(population *p, const ddp_hpo_individual *ind) {
  ddp_hpo_individual *slot = population_next(p);
  if (!slot)
    return ddp_error(DDP_ERR_STATE, "hpo: more individuals arrived than this search evaluates "
                     "and migrates (%lld): another search's messages in the store?",
                     (long long)p->cap);
  double *values = slot->values;
  *slot = *ind;
  slot->values = values;
  memcpy(values, ind->values, (size_t)p->traits * sizeof *values);
  population_add(p);
  return DDP_OK;
}

/* SelectMin's view of the active individuals, rebuilt: after a member of
 * it was deactivated (migration events only). O(population). */
static void rebuild_best(population *p) {
  p->n_best = 0;
  for (int64_t i = 0; i < p->count; i++)
    if (p->inds[i].active)
      ddp__hpo_rank_insert(p->best, p->best_loss, &p->n_best, p->pop_size, i, p->inds[i].loss);
}

static void deactivate(population *p, int64_t i) {
  if (!p->inds[i].active) return;
  p->inds[i].active = false;
  p->n_active--;
  for (int k = 0; k < p->n_best; k++)
    if (p->best[k] == i) {
      rebuild_best(p);
      break;
    }
}

/* The individual (worker, generation, migration steps) among the active, or -1. */
static int64_t find_active(const population *p, const ddp_hpo_individual *ind) {
  for (int64_t i = p->count - 1; i >= 0; i--) {
    const ddp_hpo_individual *q = &p->inds[i];
    if (q->active && q->worker == ind->worker && q->generation == ind->generation &&
        q->migration_steps == ind->migration_steps)
      return i;
  }
  return -1;
}

/* The k lowest losses among the active individuals that pass `keep` (all
 * when keep_current < 0, else those whose current is keep_current), in
 * (loss, index) order: Propulate's SelectMin over that list. Returns how
 * many (fewer when fewer qualify). */
static int select_min(const population *p, int keep_current, int k, int64_t *out, double *loss) {
  int n = 0;
  for (int64_t i = 0; i < p->count; i++) {
    const ddp_hpo_individual *q = &p->inds[i];
    if (q->active && (keep_current < 0 || q->current == keep_current))
      ddp__hpo_rank_insert(out, loss, &n, k, i, q->loss);
  }
  return n;
}

/* Hands the population over to *result (its first individual's values
 * pointer owns the block). */
static void population_to_result(population *p, ddp_hpo_result *result) {
  ddp_free(p->seen);
  ddp_free(p->pending_deact);
  ddp_free(p->views);
  ddp_free(p->best);
  ddp_free(p->best_loss);
  result->individuals = p->inds;
  result->count = p->count;
  result->best = p->best_overall;
  if (p->count == 0) ddp_free(p->values);
}

/* ---- The loop --------------------------------------------------------------- */

typedef struct worker_ctx {
  const ddp_hpo_space *space;
  const ddp_hpo_options *o;
  ddp_hpo_objective objective;
  void *user;
  ddp_process_group *worker_pg; /* NULL: a worker of one rank */
  int worker, n_workers;
  int64_t world_rank; /* of the worker's first rank: the generator's seed offset */
  /* Islands: island i holds workers [displ[i], displ[i] + count[i]). */
  int island, island_rank; /* this worker's island and its rank there */
  int *displ, *count;
} worker_ctx;

/* Propulate's island sizes: W / I each, the first W % I one more. */
static ddp_status island_layout(worker_ctx *w, int islands) {
  if (islands > w->n_workers)
    return ddp_error(DDP_ERR_INVALID, "hpo: %d islands for %d workers: every island needs one",
                     islands, w->n_workers);
  w->displ = ddp_calloc((size_t)islands, sizeof *w->displ);
  w->count = ddp_calloc((size_t)islands, sizeof *w->count);
  if (!w->displ || !w->count) return ddp_error(DDP_ERR_NOMEM, "hpo: out of memory");
  for (int i = 0, at = 0; i < islands; i++) {
    w->displ[i] = at;
    w->count[i] = w->n_workers / islands + (i < w->n_workers % islands);
    if (w->worker >= at && w->worker < at + w->count[i]) {
      w->island = i;
      w->island_rank = w->worker - at;
    }
    at += w->count[i];
  }
  return DDP_OK;
}

/* What a poll hands over, with where it goes. */
typedef struct arrivals {
  const worker_ctx *w;
  population *pop;
  ddp__hpo_exchange *x;
  ddp_pyrandom *rng;
  ddp__hpo_journal *journal; /* NULL: no checkpoints */
} arrivals;

/* A message that changed the population goes to the journal. */
static ddp_status journal(arrivals *a, const ddp__hpo_message *m) {
  return a->journal ? ddp__hpo_journal_append(a->journal, m) : DDP_OK;
}

static ddp_status remember_deactivation(population *p, const ddp_hpo_individual *ind) {
  if (p->n_pending_deact == p->cap_pending_deact) {
    int64_t cap = p->cap_pending_deact ? 2 * p->cap_pending_deact : 16;
    ddp_hpo_individual *grown = ddp_realloc(
        p->pending_deact, (size_t)p->n_pending_deact * sizeof *grown, (size_t)cap * sizeof *grown);
    if (!grown) return ddp_error(DDP_ERR_NOMEM, "hpo: out of memory");
    p->pending_deact = grown;
    p->cap_pending_deact = cap;
  }
  ddp_hpo_individual *d = &p->pending_deact[p->n_pending_deact++];
  *d = *ind;
  d->values = NULL;
  return DDP_OK;
}

/* Deactivations whose individual has arrived since. */
static void settle_deactivations(population *p) {
  int64_t kept = 0;
  for (int64_t k = 0; k < p->n_pending_deact; k++) {
    int64_t i = find_active(p, &p->pending_deact[k]);
    if (i >= 0) deactivate(p, i);
    else p->pending_deact[kept++] = p->pending_deact[k];
  }
  p->n_pending_deact = kept;
}

/* Pollination's arrival on its responsible worker: the worst active
 * individual this worker answers for goes (SelectMax(1), the last of the
 * highest losses as Python's sorted by -loss keeps the first of equals:
 * the earliest), and the island's other workers are told. */
static ddp_status replace_worst(arrivals *a) {
  population *p = a->pop;
  int64_t worst = -1;
  for (int64_t i = 0; i < p->count; i++) {
    const ddp_hpo_individual *q = &p->inds[i];
    if (q->active && q->current == a->w->island_rank &&
        (worst < 0 || q->loss > p->inds[worst].loss))
      worst = i;
  }
  if (worst < 0) return DDP_OK;
  ddp__hpo_message m = {.kind = DDP__HPO_DEACTIVATE, .island = a->w->island,
                        .ind = p->inds[worst]};
  DDP_TRY(ddp__hpo_exchange_send(a->x, &m));
  DDP_TRY(journal(a, &m));
  deactivate(p, worst);
  return DDP_OK;
}

static ddp_status take_in(const ddp__hpo_message *m, void *user) {
  arrivals *a = user;
  const worker_ctx *w = a->w;
  if (m->island != w->island) return DDP_OK; /* another island's business */
  switch (m->kind) {
  case DDP__HPO_EVAL:
    if (seen_before(a->pop, &m->ind)) return DDP_OK; /* sent again by a resumed worker */
    DDP_TRY(journal(a, m));
    return population_append(a->pop, &m->ind);
  case DDP__HPO_MIGRANT: {
    ddp__hpo_message in = *m;
    in.ind.migration_steps++; /* as Propulate counts it, on arrival */
    in.ind.active = true;
    DDP_TRY(journal(a, &in));
    DDP_TRY(population_append(a->pop, &in.ind));
    if (w->o->pollination && in.ind.current == w->island_rank) DDP_TRY(replace_worst(a));
    return DDP_OK;
  }
  case DDP__HPO_DEACTIVATE: {
    DDP_TRY(journal(a, m));
    int64_t i = find_active(a->pop, &m->ind);
    if (i >= 0) deactivate(a->pop, i);
    else DDP_TRY(remember_deactivation(a->pop, &m->ind));
    return DDP_OK;
  }
  }
  return DDP_OK;
}

/* Replaying a journal: each message as it entered the population then. */
static ddp_status replay(const ddp__hpo_message *m, void *user) {
  arrivals *a = user;
  switch (m->kind) {
  case DDP__HPO_EVAL:
  case DDP__HPO_MIGRANT:
    if (m->kind == DDP__HPO_EVAL) (void)seen_before(a->pop, &m->ind);
    return population_append(a->pop, &m->ind);
  case DDP__HPO_DEACTIVATE: {
    int64_t i = find_active(a->pop, &m->ind);
    if (i >= 0) deactivate(a->pop, i);
    else DDP_TRY(remember_deactivation(a->pop, &m->ind));
    return DDP_OK;
  }
  }
  return DDP_OK;
}

/* Emigration, as Propulate's Pollinator or Migrator sends: to every other
 * island, num_migrants of the best active individuals (pollination: of all
 * of them, copies; migration: of those this worker answers for, shuffled,
 * and deactivated at home), each assigned to a random worker there. */
static ddp_status send_emigrants(arrivals *a) {
  const worker_ctx *w = a->w;
  const ddp_hpo_options *o = w->o;
  population *p = a->pop;
  const int targets = o->islands - 1, per_target = o->num_migrants;
  const int total = o->pollination ? per_target : per_target * targets;
  int64_t chosen[256];
  double chosen_loss[256];
  if (total > 256)
    return ddp_error(DDP_ERR_INVALID, "hpo: %d emigrants at once (at most 256)", total);
  int n = select_min(p, o->pollination ? -1 : w->island_rank, total, chosen, chosen_loss);
  /* Propulate sends only when enough are eligible. */
  if (n < total) return DDP_OK;
  if (!o->pollination) ddp__pyrandom_shuffle(a->rng, chosen, n);
  int next = 0;
  for (int target = 0; target < o->islands; target++) {
    if (target == w->island) continue;
    for (int k = 0; k < per_target; k++) {
      const int64_t i = chosen[o->pollination ? k : next++];
      ddp__hpo_message go = {.kind = DDP__HPO_MIGRANT, .island = target, .ind = p->inds[i]};
      go.ind.current = (int)ddp_pyrandom_below(a->rng, (uint64_t)w->count[target]);
      DDP_TRY(ddp__hpo_exchange_send(a->x, &go));
      if (!o->pollination) { /* it leaves: gone here and on the island's other workers */
        ddp__hpo_message gone = {.kind = DDP__HPO_DEACTIVATE, .island = w->island, .ind = p->inds[i]};
        DDP_TRY(ddp__hpo_exchange_send(a->x, &gone));
        DDP_TRY(journal(a, &gone));
        deactivate(p, i);
      }
    }
  }
  return DDP_OK;
}

/* The worker's first rank: breed, evaluate with the worker, keep, tell the
 * island; take in arrivals at most every exchange_interval_s; send
 * emigrants with probability migration_prob / island size. */
static ddp_status lead_loop(const worker_ctx *w, population *pop, ddp__hpo_exchange *x,
                            ddp__hpo_journal *jn, ddp_pyrandom *rng_state, int64_t first) {
  const ddp_hpo_options *o = w->o;
  const int traits = ddp_hpo_space_size(w->space);
  ddp_pyrandom rng = *rng_state;
  arrivals a = {.w = w, .pop = pop, .x = x, .rng = &rng, .journal = jn};
  /* Propulate's workers draw the emigration decision every generation
   * whenever migration_probability > 0, even on a single island or alone,
   * where nobody is sent anything: the draw is part of the seeded sequence
   * (skipping it made ddp's individuals part from Propulate's from the
   * third generation on, with the tutorials' 0.9 on one island). */
  const bool migration = o->migration_prob > 0;
  const bool others = o->islands > 1; /* islands to send emigrants to */
  const double migration_prob = o->migration_prob / w->count[w->island];
  double last_exchange = ddp_time_s(), last_commit = last_exchange;
  for (int64_t g = first; g < o->generations; g++) {
    ddp_hpo_individual *ind = population_next(pop);
    if (!ind) return ddp_error(DDP_ERR_STATE, "hpo: the population is full at generation %lld",
                               (long long)g);
    ddp__hpo_breed(w->space, o, &rng, pop->views, pop->n_active, pop->best, ind->values);
    if (w->worker_pg)
      DDP_TRY(ddp_broadcast(w->worker_pg, ind->values, (size_t)traits, DDP_FLOAT64, 0));
    ind->generation = g;
    ind->worker = w->worker;
    ind->island = w->island;
    ind->current = w->island_rank;
    ind->migration_steps = 0;
    ind->active = true;
    ind->start_s = ddp_time_s();
    double loss = w->objective(w->space, ind->values, w->worker_pg, w->user);
    ind->end_s = ddp_time_s();
    ind->loss = loss;
    (void)seen_before(pop, ind);
    ddp__hpo_message m = {.kind = DDP__HPO_EVAL, .island = w->island, .ind = *ind};
    DDP_TRY(journal(&a, &m));
    population_add(pop);
    if (x && w->count[w->island] > 1) DDP_TRY(ddp__hpo_exchange_send(x, &m));
    if (migration && ddp_pyrandom_random(&rng) < migration_prob && others && x)
      DDP_TRY(send_emigrants(&a));
    if (x) {
      if (ind->end_s - last_exchange >= o->exchange_interval_s) {
        int64_t got;
        DDP_TRY(ddp__hpo_exchange_flush(x));
        DDP_TRY(ddp__hpo_exchange_poll(x, take_in, &a, &got));
        settle_deactivations(pop);
        last_exchange = ddp_time_s();
      }
    }
    /* A commit: everything so far, and the generator as the next
     * generation finds it. */
    if (jn && ddp_time_s() - last_commit >= o->checkpoint_interval_s) {
      DDP_TRY(ddp__hpo_journal_commit(jn, g + 1, &rng));
      last_commit = ddp_time_s();
    }
  }
  *rng_state = rng;
  return x ? ddp__hpo_exchange_flush(x) : DDP_OK;
}

/* The worker's other ranks: take each individual from the first, evaluate
 * it with the others. */
static ddp_status follow_loop(const worker_ctx *w, int64_t first) {
  const int traits = ddp_hpo_space_size(w->space);
  double *values = ddp_alloc((size_t)traits * sizeof *values + 1);
  if (!values) return ddp_error(DDP_ERR_NOMEM, "hpo: out of memory");
  ddp_status s = DDP_OK;
  for (int64_t g = first; s == DDP_OK && g < w->o->generations; g++) {
    s = ddp_broadcast(w->worker_pg, values, (size_t)traits, DDP_FLOAT64, 0);
    if (s == DDP_OK) (void)w->objective(w->space, values, w->worker_pg, w->user);
  }
  ddp_free(values);
  return s;
}

/* The options a resumed search must share, as search.meta holds them. */
static ddp_status describe(const worker_ctx *w, char *buf, size_t bytes) {
  const ddp_hpo_options *o = w->o;
  size_t at = 0;
#define ADD(...)                                                                    \
  do {                                                                              \
    int n_ = snprintf(buf + at, bytes - at, __VA_ARGS__);                           \
    if (n_ < 0 || (size_t)n_ >= bytes - at)                                         \
      return ddp_error(DDP_ERR_RANGE, "hpo checkpoint: the options describe too long"); \
    at += (size_t)n_;                                                               \
  } while (0)
  ADD("ddp-hpo checkpoint 1\nworkers=%d\nranks_per_worker=%d\nislands=%d\npop_size=%d\n",
      w->n_workers, o->ranks_per_worker, o->islands, o->pop_size);
  ADD("crossover_prob=%.17g\nmutation_prob=%.17g\nrandom_init_prob=%.17g\nsigma_factor=%.17g\n",
      o->crossover_prob, o->mutation_prob, o->random_init_prob, o->sigma_factor);
  ADD("seed=%lld\nmigration_prob=%.17g\nnum_migrants=%d\npollination=%d\n", (long long)o->seed,
      o->migration_prob, o->num_migrants, (int)o->pollination);
  for (int i = 0; i < ddp_hpo_space_size(w->space); i++) {
    const ddp_hpo_trait *t = ddp_hpo_space_trait(w->space, i);
    ADD("trait.%s=%d:%.17g:%.17g:%d", t->name, (int)t->kind, t->lo, t->hi, t->n_choices);
    for (int c = 0; c < t->n_choices; c++) ADD(":%s", t->choices[c]);
    ADD("\n");
  }
  if (o->fingerprint) ADD("%s\n", o->fingerprint);
#undef ADD
  return DDP_OK;
}

/* Rank 0 checks or starts checkpoint_dir; every rank learns the verdict. */
static ddp_status check_directory(const worker_ctx *w, ddp_process_group *world, bool *resuming) {
  int rank = world ? ddp_process_group_rank(world) : 0;
  int64_t verdict[2] = {DDP_OK, 0};
  if (rank == 0) {
    char meta[16384];
    ddp_status s = describe(w, meta, sizeof meta);
    bool r = false;
    if (s == DDP_OK) s = ddp__hpo_meta_check(w->o->checkpoint_dir, meta, w->o->resume, &r);
    verdict[0] = s;
    verdict[1] = r;
  }
  if (world && ddp_process_group_size(world) > 1) {
    ddp_status b = ddp_broadcast(world, verdict, 2, DDP_INT64, 0);
    if (b != DDP_OK) return ddp_error_wrap(b, "hpo: hearing rank 0 on %s", w->o->checkpoint_dir);
  }
  *resuming = verdict[1] != 0;
  if (verdict[0] != DDP_OK && rank != 0)
    return ddp_error((ddp_status)verdict[0], "hpo: rank 0 refused the checkpoint directory %s "
                     "(its message says why)", w->o->checkpoint_dir);
  return (ddp_status)verdict[0];
}

ddp_status ddp_hpo_search(const ddp_hpo_space *space, const ddp_hpo_options *o,
                          ddp_hpo_objective objective, void *user, ddp_hpo_result *result) {
  return ddp_hpo_search_world(space, o, objective, user, NULL, NULL, result);
}

ddp_status ddp_hpo_search_world(const ddp_hpo_space *space, const ddp_hpo_options *o,
                                ddp_hpo_objective objective, void *user,
                                ddp_process_group *world, ddp_store *store,
                                ddp_hpo_result *result) {
  if (!space || !o || !objective || !result)
    return ddp_error(DDP_ERR_INVALID, "ddp_hpo_search: space, options, objective and result "
                                      "must not be NULL");
  *result = (ddp_hpo_result){.best = -1};
  DDP_TRY(check_options(o));
  const int rank = world ? ddp_process_group_rank(world) : 0;
  const int size = world ? ddp_process_group_size(world) : 1;
  const int r = o->ranks_per_worker;
  if (size % r != 0)
    return ddp_error(DDP_ERR_INVALID, "hpo: %d ranks do not split into workers of %d ranks "
                     "(ranks_per_worker must divide the world's size)", size, r);
  const int n_workers = size / r;
  if (n_workers > 1 && !store)
    return ddp_error(DDP_ERR_INVALID, "hpo: %d workers exchange through a store; none given",
                     n_workers);
  worker_ctx w = {.space = space, .o = o, .objective = objective, .user = user,
                  .worker = rank / r, .n_workers = n_workers, .world_rank = rank - rank % r};
  ddp_status s = island_layout(&w, o->islands);
  if (s != DDP_OK) {
    ddp_free(w.displ), ddp_free(w.count);
    return s;
  }
  /* Workers of several ranks: a split of the world, made once. */
  if (r > 1) {
    s = ddp_process_group_split(world, w.worker, rank, &w.worker_pg);
    if (s != DDP_OK) {
      ddp_free(w.displ), ddp_free(w.count);
      return ddp_error_wrap(s, "hpo: making worker %d's group", w.worker);
    }
  }
  const bool lead = rank % r == 0;
  population pop = {0};
  ddp__hpo_exchange *x = NULL;
  ddp__hpo_journal *jn = NULL;
  ddp_pyrandom rng;
  ddp_pyrandom_seed(&rng, o->seed + w.world_rank);
  int64_t first = 0;
  bool resuming = false;
  if (o->checkpoint_dir) s = check_directory(&w, world, &resuming);
  if (lead && s == DDP_OK) {
    /* Room for every individual the island's workers evaluate, and for the
     * migrants: at most num_migrants per other island per emigration, one
     * emigration per generation per worker. */
    int64_t cap = o->generations * n_workers;
    if (o->islands > 1) cap += o->generations * n_workers * (int64_t)o->num_migrants;
    s = population_init(&pop, ddp_hpo_space_size(space), o->pop_size, cap, n_workers,
                        o->generations);
    arrivals a = {.w = &w, .pop = &pop};
    if (s == DDP_OK && o->checkpoint_dir)
      s = ddp__hpo_journal_open(o->checkpoint_dir, w.worker, ddp_hpo_space_size(space), resuming,
                                replay, &a, &rng, &first, &jn);
    if (s == DDP_OK) settle_deactivations(&pop);
    if (s == DDP_OK && n_workers > 1)
      s = ddp__hpo_exchange_create(store, w.worker, n_workers, ddp_hpo_space_size(space), 64, &x);
    /* A resumed worker sends its evaluations again: the others may have
     * lost those they had not committed (they keep the first copy). */
    for (int64_t i = 0; s == DDP_OK && x && first > 0 && i < pop.count; i++) {
      const ddp_hpo_individual *q = &pop.inds[i];
      if (q->worker != w.worker || q->migration_steps != 0) continue;
      ddp__hpo_message m = {.kind = DDP__HPO_EVAL, .island = w.island, .ind = *q};
      m.ind.active = true;
      s = ddp__hpo_exchange_send(x, &m);
    }
  }
  /* A worker's other ranks start where its first resumed. */
  if (s == DDP_OK && w.worker_pg) {
    s = ddp_broadcast(w.worker_pg, &first, 1, DDP_INT64, 0);
    if (s != DDP_OK) ddp_error_wrap(s, "hpo: worker %d telling its ranks where it resumed", w.worker);
  }
  /* Every count is in the store before anyone polls. */
  if (world && size > 1) {
    ddp_status b = ddp_barrier(world);
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the start's barrier");
  }
  if (s == DDP_OK) s = lead ? lead_loop(&w, &pop, x, jn, &rng, first) : follow_loop(&w, first);
  /* The end: every worker has sent everything; the leads take the rest in,
   * so each ends with the island's whole population. */
  if (world && size > 1) {
    ddp_status b = ddp_barrier(world);
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the end's barrier");
  }
  if (s == DDP_OK && x) {
    /* Pollination's replacements made here are sent out and taken in
     * once more, as Propulate's end does (its barriers between). */
    int64_t got;
    ddp_pyrandom unused = {0}; /* the end sends no emigrants */
    arrivals a = {.w = &w, .pop = &pop, .x = x, .rng = &unused, .journal = jn};
    s = ddp__hpo_exchange_poll(x, take_in, &a, &got);
    if (s == DDP_OK) s = ddp__hpo_exchange_flush(x);
    ddp_status b = ddp_barrier(world);
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the end's second barrier");
    a.journal = jn;
    if (s == DDP_OK) s = ddp__hpo_exchange_poll(x, take_in, &a, &got);
    settle_deactivations(&pop);
  } else if (world && size > 1) {
    ddp_status b = ddp_barrier(world); /* the leads' second barrier */
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the end's second barrier");
  }
  if (s == DDP_OK && jn) s = ddp__hpo_journal_commit(jn, o->generations, &rng);
  ddp__hpo_journal_close(jn);
  ddp__hpo_exchange_destroy(x);
  ddp_process_group_destroy(w.worker_pg);
  ddp_free(w.displ);
  ddp_free(w.count);
  if (s != DDP_OK) {
    if (lead) population_free(&pop);
    return s;
  }
  if (lead) population_to_result(&pop, result);
  return DDP_OK;
}
