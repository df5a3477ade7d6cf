/* Propulate 1.2.2's default propagator (utils.get_default_propagator),
 * draw for draw: Conditional(pop_size, Compose([SelectMin(pop_size),
 * SelectUniform(2), CrossoverUniform(crossover_prob), PointMutation,
 * IntervalMutationNormal (when the space has a float trait),
 * InitUniform(probability random_init_prob)]), InitUniform). Each step
 * below says which of Propulate's it is and draws exactly what it draws, in
 * the same order, from the same generator. */
#include <math.h>
#include <string.h>

#include "hpo/hpo_internal.h"

/* exp(x) back into [lo, hi]: exp(log(lo)) may round below lo. */
static double log_to_bounds(const ddp_hpo_trait *t, double x) {
  return fmin(t->hi, fmax(t->lo, exp(x)));
}

/* A fresh value for trait t: randint for int, uniform for float, choice
 * (an index) for categorical; ddp's logfloat is uniform in log(x). */
static double draw_trait(const ddp_hpo_trait *t, ddp_pyrandom *r) {
  switch (t->kind) {
  case DDP_HPO_INT: return (double)ddp_pyrandom_randint(r, (int64_t)t->lo, (int64_t)t->hi);
  case DDP_HPO_FLOAT: return ddp_pyrandom_uniform(r, t->lo, t->hi);
  case DDP_HPO_LOGFLOAT: return log_to_bounds(t, ddp_pyrandom_uniform(r, log(t->lo), log(t->hi)));
  case DDP_HPO_CATEGORICAL: return (double)ddp_pyrandom_below(r, (uint64_t)t->n_choices);
  }
  return 0;
}

/* InitUniform(probability p): one draw decides; on success every trait is
 * drawn in the space's order. Returns whether it replaced `child`. */
static bool init_uniform(const ddp_hpo_space *s, ddp_pyrandom *r, double p, double *child) {
  if (!(ddp_pyrandom_random(r) < p)) return false;
  for (int i = 0; i < ddp_hpo_space_size(s); i++) child[i] = draw_trait(ddp_hpo_space_trait(s, i), r);
  return true;
}

/* SelectMin(pop_size) keeps the best pop_size of the stably sorted
 * active population; since only those are ever read, they are kept as they
 * come instead of sorting everything each generation (Propulate sorts its
 * whole population per breed: its cost grows with the population). */
void ddp__hpo_rank_insert(int64_t *best, double *best_loss, int *count, int cap, int64_t index,
                          double loss) {
  int at = *count;
  while (at > 0 && best_loss[at - 1] > loss) at--; /* after every equal loss: stable */
  if (at >= cap) return;
  int last = *count < cap ? *count : cap - 1;
  memmove(best + at + 1, best + at, (size_t)(last - at) * sizeof *best);
  memmove(best_loss + at + 1, best_loss + at, (size_t)(last - at) * sizeof *best_loss);
  best[at] = index;
  best_loss[at] = loss;
  if (*count < cap) (*count)++;
}

void ddp__hpo_breed(const ddp_hpo_space *s, const ddp_hpo_options *o, ddp_pyrandom *r,
                    const double *const *values, int64_t n, const int64_t *order, double *child) {
  const int traits = ddp_hpo_space_size(s);
  /* Conditional: fewer than pop_size known, a fresh individual
   * (InitUniform at probability 1, which still draws its decision). */
  if (n < o->pop_size) {
    init_uniform(s, r, 1.0, child);
    return;
  }
  /* SelectMin(pop_size): order[0..best) (ddp__hpo_rank_insert). */
  int64_t best = o->pop_size;
  /* SelectUniform(2): random.sample(best, 2). CPython takes its pool
   * method up to 21 candidates and its set method beyond; ddp__pyrandom_sample
   * does both (with scratch for up to 128; beyond that, the set method's two
   * draws written out: a second index drawn again while it repeats the
   * first). */
  int64_t pick[2];
  if (best <= 128) {
    int64_t pool[128];
    bool taken[128];
    ddp__pyrandom_sample(r, best, 2, pick, pool, taken);
  } else {
    pick[0] = (int64_t)ddp_pyrandom_below(r, (uint64_t)best);
    do pick[1] = (int64_t)ddp_pyrandom_below(r, (uint64_t)best);
    while (pick[1] == pick[0]);
  }
  const double *p1 = values[order[pick[0]]], *p2 = values[order[pick[1]]];
  /* CrossoverUniform(crossover_prob) at probability 1: one draw for the
   * probability, then per trait in order: parent 2's when a draw exceeds
   * crossover_prob. */
  memcpy(child, p1, (size_t)traits * sizeof *child);
  if (ddp_pyrandom_random(r) < 1.0)
    for (int i = 0; i < traits; i++)
      if (ddp_pyrandom_random(r) > o->crossover_prob) child[i] = p2[i];
  /* PointMutation(points 1): one trait of the names sorted, redrawn.
   * random.sample(keys, 1) is one randbelow(len) in both of CPython's
   * methods. */
  if (ddp_pyrandom_random(r) < o->mutation_prob) {
    int t = ddp__hpo_space_sorted(s)[ddp_pyrandom_below(r, (uint64_t)traits)];
    child[t] = draw_trait(ddp_hpo_space_trait(s, t), r);
  }
  /* IntervalMutationNormal(sigma_factor, probability 1), when the space
   * has a float trait: one of them, x <- clamp(gauss(x, sigma)). */
  int n_intervals;
  const int *intervals = ddp__hpo_space_intervals(s, &n_intervals);
  if (n_intervals > 0 && ddp_pyrandom_random(r) < 1.0) {
    int t = intervals[ddp_pyrandom_below(r, (uint64_t)n_intervals)];
    const ddp_hpo_trait *tr = ddp_hpo_space_trait(s, t);
    if (tr->kind == DDP_HPO_FLOAT) {
      double sigma = (tr->hi - tr->lo) * o->sigma_factor;
      double x = ddp_pyrandom_gauss(r, child[t], sigma);
      x = fmin(tr->hi, x); /* min(max_val, x), then max(min_val, x), as Propulate */
      child[t] = fmax(tr->lo, x);
    } else { /* logfloat: the same in log(x) */
      double sigma = (log(tr->hi) - log(tr->lo)) * o->sigma_factor;
      double x = ddp_pyrandom_gauss(r, log(child[t]), sigma);
      child[t] = log_to_bounds(tr, x);
    }
  }
  /* InitUniform(parents 1, probability random_init_prob). */
  init_uniform(s, r, o->random_init_prob, child);
}
