/* Samplers: the order in which an epoch visits a dataset. Each kind is a
 * table of functions (ddp_sampler_ops) behind the ddp_sampler handle; the
 * distributed sampler plugs in the same way. */
#include <string.h>

#include "ddp/data.h"

void ddp_sampler_set_epoch(ddp_sampler *sampler, int64_t epoch) {
  if (sampler->ops->set_epoch) sampler->ops->set_epoch(sampler, epoch);
}

int64_t ddp_sampler_length(const ddp_sampler *sampler) { return sampler->ops->length(sampler); }

ddp_status ddp_sampler_fill(ddp_sampler *sampler, int64_t *indices) {
  return sampler->ops->fill(sampler, indices);
}

void ddp_sampler_destroy(ddp_sampler *sampler) {
  if (sampler) sampler->ops->destroy(sampler);
}

/* ---- Sequential and random ------------------------------------------------
 * Both keep the dataset size; random also the seed and the epoch. */
typedef struct simple_sampler {
  ddp_sampler base;
  int64_t num_samples;
  uint64_t seed;
  int64_t epoch;
} simple_sampler;

static void simple_set_epoch(ddp_sampler *sampler, int64_t epoch) {
  ((simple_sampler *)sampler)->epoch = epoch;
}

static int64_t simple_length(const ddp_sampler *sampler) {
  return ((const simple_sampler *)sampler)->num_samples;
}

static void simple_destroy(ddp_sampler *sampler) { ddp_free(sampler); }

static ddp_status sequential_fill(ddp_sampler *sampler, int64_t *indices) {
  const simple_sampler *s = (const simple_sampler *)sampler;
  for (int64_t i = 0; i < s->num_samples; i++) indices[i] = i;
  return DDP_OK;
}

/* Fisher-Yates from the identity with ddp_rng seeded by seed + epoch: every
 * permutation equally likely, the same one for the same seed and epoch. */
static ddp_status random_fill(ddp_sampler *sampler, int64_t *indices) {
  const simple_sampler *s = (const simple_sampler *)sampler;
  ddp_rng rng;
  ddp_rng_seed(&rng, s->seed + (uint64_t)s->epoch);
  for (int64_t i = 0; i < s->num_samples; i++) indices[i] = i;
  for (int64_t i = s->num_samples - 1; i > 0; i--) {
    int64_t j = (int64_t)ddp_rng_below(&rng, (uint64_t)i + 1);
    int64_t t = indices[i];
    indices[i] = indices[j];
    indices[j] = t;
  }
  return DDP_OK;
}

static const ddp_sampler_ops sequential_ops = {
    .name = "sequential",
    .set_epoch = simple_set_epoch,
    .length = simple_length,
    .fill = sequential_fill,
    .destroy = simple_destroy,
};

static const ddp_sampler_ops random_ops = {
    .name = "random",
    .set_epoch = simple_set_epoch,
    .length = simple_length,
    .fill = random_fill,
    .destroy = simple_destroy,
};

static ddp_status simple_create(ddp_sampler **out, const ddp_sampler_ops *ops,
                                int64_t num_samples, uint64_t seed) {
  *out = NULL;
  if (num_samples < 0)
    return ddp_error(DDP_ERR_INVALID, "sampler %s: num_samples %lld < 0", ops->name,
                     (long long)num_samples);
  simple_sampler *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "sampler %s: cannot allocate", ops->name);
  s->base.ops = ops;
  s->num_samples = num_samples;
  s->seed = seed;
  *out = &s->base;
  return DDP_OK;
}

ddp_status ddp_sampler_create_sequential(ddp_sampler **out, int64_t num_samples) {
  return simple_create(out, &sequential_ops, num_samples, 0);
}

ddp_status ddp_sampler_create_random(ddp_sampler **out, int64_t num_samples, uint64_t seed) {
  return simple_create(out, &random_ops, num_samples, seed);
}
