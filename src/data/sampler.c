/* Samplers: the order in which an epoch visits a dataset. Each kind is a
 * table of functions (ddp_sampler_ops) behind the ddp_sampler handle; the
 * distributed ones (sampler_distributed.c) plug in the same way. */
#include <string.h>

#include "ddp/data.h"
#include "data/torch_random.h"

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
 * Both keep the dataset size; random also its seed and a generator it keeps
 * between epochs (see random_fill). */
typedef struct simple_sampler {
  ddp_sampler base;
  int64_t num_samples;
  uint64_t seed;
  int64_t epoch;
  /* The generator as it stands before epoch gen_epoch's permutation: a
   * training loop's next epoch continues from it instead of replaying. */
  ddp__torch_generator gen;
  int64_t gen_epoch;
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

/* PyTorch's RandomSampler(data, generator=g) with g = torch.Generator() seeded
 * once with `seed`: each pass draws torch.randperm(n, generator=g) from the
 * same generator. A pass of torch 1.13's RandomSampler.__iter__ draws two
 * randperms: one per whole multiple of num_samples (here exactly one) and
 * one more for the remainder, num_samples % n = 0 of whose elements it
 * yields; a DataLoader runs the iterator to its end, so both are drawn.
 * One randperm uses n - 1 outputs, so epoch e's order is the randperm that
 * starts 2 e (n - 1) outputs into the stream. Jumping to any epoch costs a
 * discard of that many outputs (cheap; whole blocks skip the tempering); the
 * next epoch in order costs one discarded randperm's worth. */
static ddp_status random_fill(ddp_sampler *sampler, int64_t *indices) {
  simple_sampler *s = (simple_sampler *)sampler;
  if (s->epoch < 0)
    return ddp_error(DDP_ERR_INVALID, "sampler random: epoch %lld < 0", (long long)s->epoch);
  if (s->epoch < s->gen_epoch) {
    ddp__torch_generator_seed(&s->gen, s->seed);
    s->gen_epoch = 0;
  }
  uint64_t per_perm = s->num_samples > 1 ? (uint64_t)(s->num_samples - 1) : 0;
  ddp__torch_generator_discard(&s->gen, (uint64_t)(s->epoch - s->gen_epoch) * 2 * per_perm);
  ddp__torch_randperm(&s->gen, s->num_samples, indices);
  ddp__torch_generator_discard(&s->gen, per_perm); /* the remainder's randperm */
  s->gen_epoch = s->epoch + 1;
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
  ddp__torch_generator_seed(&s->gen, seed);
  *out = &s->base;
  return DDP_OK;
}

ddp_status ddp_sampler_create_sequential(ddp_sampler **out, int64_t num_samples) {
  return simple_create(out, &sequential_ops, num_samples, 0);
}

ddp_status ddp_sampler_create_random(ddp_sampler **out, int64_t num_samples, uint64_t seed) {
  return simple_create(out, &random_ops, num_samples, seed);
}

ddp_status ddp_randperm(int64_t n, uint64_t seed, int64_t *out) {
  if (n < 0) return ddp_error(DDP_ERR_INVALID, "randperm: n %lld < 0", (long long)n);
  ddp__torch_generator mt;
  ddp__torch_generator_seed(&mt, seed);
  ddp__torch_randperm(&mt, n, out);
  return DDP_OK;
}
