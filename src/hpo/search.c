/* The search loop of one worker on one island (Propulate's Propulator
 * with one worker): breed from the active population, evaluate, add. */
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
  return o;
}

static ddp_status check_options(const ddp_hpo_options *o) {
  if (o->generations < 1)
    return ddp_error(DDP_ERR_INVALID, "hpo: generations is %lld (>= 1)", (long long)o->generations);
  if (o->pop_size < 2)
    return ddp_error(DDP_ERR_INVALID, "hpo: pop_size is %d (>= 2: breeding takes two parents)",
                     o->pop_size);
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
  if (r->individuals) free(r->individuals[0].values); /* one block for every individual */
  free(r->individuals);
  *r = (ddp_hpo_result){.best = -1};
}

ddp_status ddp_hpo_search(const ddp_hpo_space *space, const ddp_hpo_options *o,
                          ddp_hpo_objective objective, void *user, ddp_hpo_result *result) {
  if (!space || !o || !objective || !result)
    return ddp_error(DDP_ERR_INVALID, "ddp_hpo_search: space, options, objective and result "
                                      "must not be NULL");
  *result = (ddp_hpo_result){.best = -1};
  DDP_TRY(check_options(o));
  const int traits = ddp_hpo_space_size(space);
  const int64_t n = o->generations;
  /* Everything is sized once: the individuals, their values, and the
   * breeding's views of the population. */
  ddp_hpo_individual *inds = calloc((size_t)n, sizeof *inds);
  double *values = calloc((size_t)(n * traits), sizeof *values);
  const double **views = calloc((size_t)n, sizeof *views);
  double *best_loss = calloc((size_t)o->pop_size, sizeof *best_loss);
  int64_t *best = calloc((size_t)o->pop_size, sizeof *best);
  if (!inds || !values || !views || !best_loss || !best) {
    free(inds), free(values), free(views), free(best_loss), free(best);
    return ddp_error(DDP_ERR_NOMEM, "hpo: no memory for %lld individuals", (long long)n);
  }
  ddp_pyrandom rng;
  ddp_pyrandom_seed(&rng, o->seed);
  int n_best = 0;
  for (int64_t g = 0; g < n; g++) {
    ddp_hpo_individual *ind = &inds[g];
    ind->values = values + g * traits;
    /* The active population: every individual so far (one worker, no
     * migration: nothing is ever deactivated). */
    ddp__hpo_breed(space, o, &rng, views, g, best, ind->values);
    ind->generation = g;
    ind->active = true;
    ind->start_s = ddp_time_s();
    double loss = objective(space, ind->values, user);
    ind->end_s = ddp_time_s();
    ind->loss = isnan(loss) ? INFINITY : loss;
    views[g] = ind->values;
    ddp__hpo_rank_insert(best, best_loss, &n_best, o->pop_size, g, ind->loss);
    if (result->best < 0 || ind->loss < inds[result->best].loss) result->best = g;
  }
  free(views);
  free(best_loss);
  free(best);
  result->individuals = inds;
  result->count = n;
  return DDP_OK;
}
