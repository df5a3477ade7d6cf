/* The search loop (Propulate's Propulator): each worker's first rank breeds
 * from the active population it knows, the worker evaluates, and the
 * individual joins the population and goes to the island's other workers;
 * arrivals from them join as they come. One worker of one rank is the
 * plain loop; several workers exchange through the store (exchange.c);
 * a worker of several ranks trains each individual together. */
#include <math.h>
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
  if (r->individuals && r->count > 0) free(r->individuals[0].values); /* one block for all */
  free(r->individuals);
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
  int64_t best_overall;
} population;

static void population_free(population *p) {
  free(p->inds);
  free(p->values);
  free(p->views);
  free(p->best);
  free(p->best_loss);
}

static ddp_status population_init(population *p, int traits, int pop_size, int64_t cap) {
  *p = (population){.traits = traits, .pop_size = pop_size, .cap = cap, .best_overall = -1};
  p->inds = calloc((size_t)cap, sizeof *p->inds);
  p->values = calloc((size_t)(cap * traits) + 1, sizeof *p->values);
  p->views = calloc((size_t)cap, sizeof *p->views);
  p->best = calloc((size_t)pop_size, sizeof *p->best);
  p->best_loss = calloc((size_t)pop_size, sizeof *p->best_loss);
  if (!p->inds || !p->values || !p->views || !p->best || !p->best_loss) {
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

static void population_add(population *p) {
  ddp_hpo_individual *ind = &p->inds[p->count];
  if (isnan(ind->loss)) ind->loss = INFINITY;
  p->views[p->count] = ind->values;
  ddp__hpo_rank_insert(p->best, p->best_loss, &p->n_best, p->pop_size, p->count, ind->loss);
  if (p->best_overall < 0 || ind->loss < p->inds[p->best_overall].loss) p->best_overall = p->count;
  p->count++;
}

static ddp_status take_in(const ddp_hpo_individual *ind, void *user) {
  population *p = user;
  ddp_hpo_individual *slot = population_next(p);
  if (!slot)
    return ddp_error(DDP_ERR_STATE, "hpo: more individuals arrived than the island's workers "
                     "evaluate (%lld): another search's records in the store?", (long long)p->cap);
  double *values = slot->values;
  *slot = *ind;
  slot->values = values;
  memcpy(values, ind->values, (size_t)p->traits * sizeof *values);
  population_add(p);
  return DDP_OK;
}

/* Hands the population over to *result (its first individual's values
 * pointer owns the block). */
static void population_to_result(population *p, ddp_hpo_result *result) {
  free(p->views);
  free(p->best);
  free(p->best_loss);
  result->individuals = p->inds;
  result->count = p->count;
  result->best = p->best_overall;
  if (p->count == 0) free(p->values);
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
} worker_ctx;

/* The worker's first rank: breed, evaluate with the worker, keep, send;
 * take in arrivals at most every exchange_interval_s. */
static ddp_status lead_loop(const worker_ctx *w, population *pop, ddp__hpo_exchange *x) {
  const ddp_hpo_options *o = w->o;
  const int traits = ddp_hpo_space_size(w->space);
  ddp_pyrandom rng;
  ddp_pyrandom_seed(&rng, o->seed + w->world_rank);
  double last_exchange = ddp_time_s();
  for (int64_t g = 0; g < o->generations; g++) {
    ddp_hpo_individual *ind = population_next(pop);
    if (!ind) return ddp_error(DDP_ERR_STATE, "hpo: the population is full at generation %lld",
                               (long long)g);
    /* The active population: everything known (no migration deactivates). */
    ddp__hpo_breed(w->space, o, &rng, pop->views, pop->count, pop->best, ind->values);
    if (w->worker_pg)
      DDP_TRY(ddp_broadcast(w->worker_pg, ind->values, (size_t)traits, DDP_FLOAT64, 0));
    ind->generation = g;
    ind->worker = w->worker;
    ind->island = 0;
    ind->active = true;
    ind->start_s = ddp_time_s();
    double loss = w->objective(w->space, ind->values, w->worker_pg, w->user);
    ind->end_s = ddp_time_s();
    ind->loss = loss;
    population_add(pop);
    if (x) {
      DDP_TRY(ddp__hpo_exchange_send(x, ind));
      if (ind->end_s - last_exchange >= o->exchange_interval_s) {
        int64_t got;
        DDP_TRY(ddp__hpo_exchange_flush(x));
        DDP_TRY(ddp__hpo_exchange_poll(x, take_in, pop, &got));
        last_exchange = ddp_time_s();
      }
    }
  }
  return x ? ddp__hpo_exchange_flush(x) : DDP_OK;
}

/* The worker's other ranks: take each individual from the first, evaluate
 * it with the others. */
static ddp_status follow_loop(const worker_ctx *w) {
  const int traits = ddp_hpo_space_size(w->space);
  double *values = malloc((size_t)traits * sizeof *values + 1);
  if (!values) return ddp_error(DDP_ERR_NOMEM, "hpo: out of memory");
  ddp_status s = DDP_OK;
  for (int64_t g = 0; s == DDP_OK && g < w->o->generations; g++) {
    s = ddp_broadcast(w->worker_pg, values, (size_t)traits, DDP_FLOAT64, 0);
    if (s == DDP_OK) (void)w->objective(w->space, values, w->worker_pg, w->user);
  }
  free(values);
  return s;
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
  ddp_status s = DDP_OK;
  /* Workers of several ranks: a split of the world, made once. */
  if (r > 1) {
    s = ddp_process_group_split(world, w.worker, rank, &w.worker_pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "hpo: making worker %d's group", w.worker);
  }
  const bool lead = rank % r == 0;
  population pop = {0};
  ddp__hpo_exchange *x = NULL;
  if (lead) {
    s = population_init(&pop, ddp_hpo_space_size(space), o->pop_size, o->generations * n_workers);
    if (s == DDP_OK && n_workers > 1)
      s = ddp__hpo_exchange_create(store, w.worker, n_workers, ddp_hpo_space_size(space), 64, &x);
  }
  /* Every count is in the store before anyone polls. */
  if (world && size > 1) {
    ddp_status b = ddp_barrier(world);
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the start's barrier");
  }
  if (s == DDP_OK) s = lead ? lead_loop(&w, &pop, x) : follow_loop(&w);
  /* The end: every worker has sent everything; the leads take the rest in,
   * so each ends with the island's whole population. */
  if (world && size > 1) {
    ddp_status b = ddp_barrier(world);
    if (s == DDP_OK && b != DDP_OK) s = ddp_error_wrap(b, "hpo: the end's barrier");
  }
  if (s == DDP_OK && x) {
    int64_t got;
    s = ddp__hpo_exchange_poll(x, take_in, &pop, &got);
  }
  ddp__hpo_exchange_destroy(x);
  ddp_process_group_destroy(w.worker_pg);
  if (s != DDP_OK) {
    if (lead) population_free(&pop);
    return s;
  }
  if (lead) population_to_result(&pop, result);
  return DDP_OK;
}
