/* Distributed samplers: each rank's share of an epoch. The training one is
 * PyTorch's torch.utils.data.distributed.DistributedSampler, index order
 * included; the evaluation one visits every sample exactly once across the
 * ranks (no padding), so metrics reduced over ranks count the test set once. */
#include <string.h>

#include "ddp/data.h"
#include "data/torch_random.h"

typedef struct dist_sampler {
  ddp_sampler base;
  int64_t num_samples;  /* N: the dataset's size */
  int64_t replicas;     /* R */
  int64_t rank;
  bool shuffle;
  bool drop_last;
  bool pad;             /* false for the evaluation sampler */
  uint64_t seed;
  int64_t epoch;
  int64_t length;       /* this rank's indices per epoch */
  /* A resumed epoch (ddp_sampler_distributed_resume): in epoch
   * resume_epoch the first `consumed` positions of the extended order are
   * skipped and the rest dealt out; -1: none. */
  int64_t resume_epoch;
  int64_t consumed;
  int64_t resume_length;
  int64_t *order;       /* N: the epoch's full order (shuffle only), owned */
} dist_sampler;

static void dist_set_epoch(ddp_sampler *sampler, int64_t epoch) {
  ((dist_sampler *)sampler)->epoch = epoch;
}

static int64_t dist_length(const ddp_sampler *sampler) {
  const dist_sampler *s = (const dist_sampler *)sampler;
  return s->epoch == s->resume_epoch ? s->resume_length : s->length;
}

static void dist_destroy(ddp_sampler *sampler) {
  dist_sampler *s = (dist_sampler *)sampler;
  ddp_free(s->order);
  ddp_free(s);
}

/* DistributedSampler.__iter__: the full order (randperm from a generator
 * seeded with seed + epoch, or 0..N-1), extended to total_size by repeating
 * it from the start (as many times as needed, also when the padding exceeds
 * N) or cut to total_size with drop_last, then every R-th element from rank.
 * Position j of the extended list is order[j % N], so rank's k-th index is
 * order[(rank + k R) % N]. The evaluation sampler stops at N instead. In
 * a resumed epoch the positions start at `consumed`. */
static ddp_status dist_fill(ddp_sampler *sampler, int64_t *indices) {
  dist_sampler *s = (dist_sampler *)sampler;
  if (s->shuffle) {
    ddp__torch_generator mt;
    ddp__torch_generator_seed(&mt, s->seed + (uint64_t)s->epoch);
    ddp__torch_randperm(&mt, s->num_samples, s->order);
  }
  const int64_t first = s->epoch == s->resume_epoch ? s->consumed : 0;
  const int64_t length = dist_length(sampler);
  for (int64_t k = 0; k < length; k++) {
    int64_t j = (first + s->rank + k * s->replicas) % s->num_samples;
    indices[k] = s->shuffle ? s->order[j] : j;
  }
  return DDP_OK;
}

static const ddp_sampler_ops distributed_ops = {
    .name = "distributed",
    .set_epoch = dist_set_epoch,
    .length = dist_length,
    .fill = dist_fill,
    .destroy = dist_destroy,
};

static const ddp_sampler_ops distributed_eval_ops = {
    .name = "distributed-eval",
    .set_epoch = dist_set_epoch,
    .length = dist_length,
    .fill = dist_fill,
    .destroy = dist_destroy,
};

ddp_distributed_sampler_options ddp_distributed_sampler_defaults(int64_t num_replicas,
                                                                 int64_t rank) {
  ddp_distributed_sampler_options o;
  memset(&o, 0, sizeof o);
  o.num_replicas = num_replicas;
  o.rank = rank;
  o.shuffle = true;
  o.seed = 0;
  o.drop_last = false;
  return o;
}

/* PyTorch's num_samples: with drop_last and N not divisible by R,
 * ceil((N - R) / R) (the tail is dropped so every rank gets as many), else
 * ceil(N / R) (the tail is padded). */
static int64_t per_rank(int64_t n, int64_t r, bool drop_last) {
  if (drop_last && n % r != 0) {
    /* ceil((n - r) / r) for n - r possibly negative: floor division + 1,
     * and 0 when n < r (math.ceil of a value in (-1, 0) is 0). */
    if (n < r) return 0;
    return (n - r + r - 1) / r;
  }
  return (n + r - 1) / r;
}

static ddp_status create(ddp_sampler **out, const ddp_sampler_ops *ops, int64_t num_samples,
                         const ddp_distributed_sampler_options *o, bool pad) {
  *out = NULL;
  if (num_samples < 0)
    return ddp_error(DDP_ERR_INVALID, "sampler %s: num_samples %lld < 0", ops->name,
                     (long long)num_samples);
  if (o->num_replicas < 1)
    return ddp_error(DDP_ERR_INVALID, "sampler %s: num_replicas %lld < 1", ops->name,
                     (long long)o->num_replicas);
  if (o->rank < 0 || o->rank >= o->num_replicas)
    return ddp_error(DDP_ERR_INVALID,
                     "sampler %s: invalid rank %lld, rank should be in the interval [0, %lld]",
                     ops->name, (long long)o->rank, (long long)o->num_replicas - 1);
  dist_sampler *s = ddp_calloc(1, sizeof *s);
  if (!s) return ddp_error(DDP_ERR_NOMEM, "sampler %s: cannot allocate", ops->name);
  s->base.ops = ops;
  s->num_samples = num_samples;
  s->replicas = o->num_replicas;
  s->rank = o->rank;
  s->shuffle = o->shuffle;
  s->drop_last = o->drop_last;
  s->pad = pad;
  s->seed = o->seed;
  s->resume_epoch = -1;
  if (pad)
    s->length = per_rank(num_samples, s->replicas, s->drop_last);
  else /* ranks rank, rank + R, ... below N */
    s->length = num_samples > s->rank ? (num_samples - s->rank + s->replicas - 1) / s->replicas : 0;
  if (s->shuffle && num_samples > 0) {
    s->order = ddp_alloc((size_t)num_samples * sizeof *s->order);
    if (!s->order) {
      ddp_free(s);
      return ddp_error(DDP_ERR_NOMEM, "sampler %s: cannot allocate the order of %lld samples",
                       ops->name, (long long)num_samples);
    }
  }
  *out = &s->base;
  return DDP_OK;
}

ddp_status ddp_sampler_create_distributed(ddp_sampler **out, int64_t num_samples,
                                          const ddp_distributed_sampler_options *options) {
  return create(out, &distributed_ops, num_samples, options, true);
}

ddp_status ddp_sampler_create_distributed_eval(ddp_sampler **out, int64_t num_samples,
                                               int64_t num_replicas, int64_t rank) {
  ddp_distributed_sampler_options o = ddp_distributed_sampler_defaults(num_replicas, rank);
  o.shuffle = false;
  return create(out, &distributed_eval_ops, num_samples, &o, false);
}

/* Positions consumed + rank + k R of the order extended as PyTorch's
 * (position j is order[j mod N]: the padding repeats the order's start),
 * for k < ceil((N - consumed) / R): the rest of the epoch, dealt over this
 * world. With consumed a multiple of R it is the uninterrupted epoch's tail. */
ddp_status ddp_sampler_distributed_resume(ddp_sampler *sampler, int64_t epoch, int64_t consumed) {
  if (!sampler || sampler->ops != &distributed_ops)
    return ddp_error(DDP_ERR_INVALID, "sampler %s: only the distributed training sampler resumes an epoch "
                     "at another world size", sampler ? sampler->ops->name : "(null)");
  dist_sampler *s = (dist_sampler *)sampler;
  if (epoch < 0 || consumed < 0)
    return ddp_error(DDP_ERR_INVALID, "sampler %s: resume at epoch %lld, %lld samples consumed: both must be >= 0",
                     sampler->ops->name, (long long)epoch, (long long)consumed);
  if (s->drop_last)
    return ddp_error(DDP_ERR_UNSUPPORTED, "sampler %s: resuming an epoch at another world size with drop_last "
                     "(the dropped tail depends on the world size)", sampler->ops->name);
  s->resume_epoch = epoch;
  s->consumed = consumed;
  s->resume_length = consumed >= s->num_samples ? 0 : (s->num_samples - consumed + s->replicas - 1) / s->replicas;
  return DDP_OK;
}
