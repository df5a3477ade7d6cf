/* The loader: batches in sampler order, converted (uint8 -> float32, scale
 * 1/255, optional normalisation) into preallocated buffers, filled ahead of
 * the consumer by background threads.
 *
 * The ring: batch b of an epoch lives in slot b % num_slots. A worker may
 * claim batch b only when b < released + num_slots, where `released` counts
 * the batches the consumer has handed back, so the slot it writes is never
 * the one the consumer is reading. Workers finish out of order; the consumer
 * takes batches in order, waiting for its slot to be READY (or filling it
 * itself when no worker has claimed it yet). Everything shared
 * is guarded by one mutex; the data in a slot is handed over by its state
 * change under that mutex, and the epoch's indices are rewritten only while
 * no worker is busy. */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "data/dataset_internal.h"

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_READY = 2 };

/* Workers re-check the shutdown flag at least this often even if no one
 * signals them (belt and braces: shutdown also broadcasts). */
#define WORKER_WAIT_NS 200000000LL

typedef struct loader_slot {
  float *x;      /* (batch_size, input_numel) */
  void *y;       /* (batch_size, target_numel) of target_dtype */
  int64_t batch; /* batch index held, valid when not FREE */
  int state;
} loader_slot;

struct ddp_loader {
  const ddp_dataset *ds;
  ddp_loader_config cfg;
  ddp_sampler *sampler;
  bool owns_sampler;
  int64_t num_samples; /* per epoch: the sampler's length */
  int64_t num_batches;
  int64_t capacity; /* indices the buffer holds: the first epoch's length */
  int64_t *indices;    /* (num_samples) the running epoch's order */
  float lut[256];      /* uint8 -> delivered float */
  float mean, std;     /* for float inputs; 0 and 1 without normalisation */

  int num_slots;
  loader_slot *slots;
  pthread_t *threads;
  int num_threads;

  pthread_mutex_t mu;
  pthread_cond_t work_cv;  /* workers: a batch may be claimable */
  pthread_cond_t ready_cv; /* consumer: a slot became READY */
  pthread_cond_t idle_cv;  /* start_epoch: busy dropped to 0 */
  bool shutdown;
  bool epoch_started;      /* a start_epoch has succeeded */
  bool claims_open;        /* workers may claim batches of this epoch */
  int64_t next_claim;      /* next batch a worker will fill */
  int64_t released;        /* batches [0, released) handed back by the consumer */
  int64_t next_consume;    /* next batch ddp_loader_next returns */
  int64_t held;            /* batch the consumer holds, -1 for none */
  int busy;                /* workers filling a slot now */
};

ddp_loader_config ddp_loader_defaults(void) {
  ddp_loader_config c;
  memset(&c, 0, sizeof c);
  c.batch_size = 1;
  c.std = 1.0f;
  c.timeout_s = 60.0;
  return c;
}

static struct timespec deadline_after_ns(int64_t ns) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ns += ts.tv_nsec;
  ts.tv_sec += (time_t)(ns / 1000000000LL);
  ts.tv_nsec = (long)(ns % 1000000000LL);
  return ts;
}

/* Batch b's first position in the epoch's order (*first) and its size (the
 * last batch may be short). */
static int64_t batch_rows(const ddp_loader *l, int64_t b, int64_t *first) {
  *first = b * l->cfg.batch_size;
  int64_t count = l->num_samples - *first;
  return count < l->cfg.batch_size ? count : l->cfg.batch_size;
}

static void fill_slot(ddp_loader *l, loader_slot *slot, int64_t batch) {
  int64_t first;
  const int64_t count = batch_rows(l, batch, &first);
  ddp__dataset_gather(l->ds, l->indices + first, count, l->lut, l->mean, l->std, slot->x,
                      slot->y);
}

/* A worker claims the next batch whose slot is free, fills it outside the
 * lock, and marks it READY. */

/* Fills batch b, just claimed (next_claim moved past it), into its free slot.
 * Called and returns with l->mu held; the filling itself runs unlocked. */
static void fill_claimed(ddp_loader *l, loader_slot *slot, int64_t b) {
  DDP_ASSERT(slot->state == SLOT_FREE);
  slot->state = SLOT_FILLING;
  slot->batch = b;
  l->busy++;
  pthread_mutex_unlock(&l->mu);
  fill_slot(l, slot, b);
  pthread_mutex_lock(&l->mu);
  slot->state = SLOT_READY;
  l->busy--;
  if (l->busy == 0) pthread_cond_broadcast(&l->idle_cv);
}

static void *worker_main(void *arg) {
  ddp_loader *l = arg;
  pthread_mutex_lock(&l->mu);
  while (!l->shutdown) {
    if (l->claims_open && l->next_claim < l->num_batches &&
        l->next_claim < l->released + l->num_slots) {
      const int64_t b = l->next_claim++;
      fill_claimed(l, &l->slots[b % l->num_slots], b);
      pthread_cond_signal(&l->ready_cv);
      continue;
    }
    struct timespec ts = deadline_after_ns(WORKER_WAIT_NS);
    pthread_cond_timedwait(&l->work_cv, &l->mu, &ts);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

static void stop_workers(ddp_loader *l) {
  pthread_mutex_lock(&l->mu);
  l->shutdown = true;
  pthread_cond_broadcast(&l->work_cv);
  pthread_mutex_unlock(&l->mu);
  for (int i = 0; i < l->num_threads; i++) pthread_join(l->threads[i], NULL);
  l->num_threads = 0;
}

static ddp_status init_sync(ddp_loader *l) {
  pthread_condattr_t attr;
  if (pthread_condattr_init(&attr) != 0) return ddp_error(DDP_ERR_SYS, "loader: condattr");
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->work_cv, &attr);
  pthread_cond_init(&l->ready_cv, &attr);
  pthread_cond_init(&l->idle_cv, &attr);
  pthread_condattr_destroy(&attr);
  return DDP_OK;
}

void ddp_loader_destroy(ddp_loader *l) {
  if (!l) return;
  stop_workers(l);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->work_cv);
  pthread_cond_destroy(&l->ready_cv);
  pthread_cond_destroy(&l->idle_cv);
  if (l->slots)
    for (int i = 0; i < l->num_slots; i++) {
      ddp_free(l->slots[i].x);
      ddp_free(l->slots[i].y);
    }
  ddp_free(l->slots);
  ddp_free(l->threads);
  ddp_free(l->indices);
  if (l->owns_sampler) ddp_sampler_destroy(l->sampler);
  ddp_free(l);
}

ddp_status ddp_loader_create(ddp_loader **out, const ddp_dataset *ds,
                             const ddp_loader_config *config) {
  *out = NULL;
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  const ddp_loader_config c = *config;
  if (c.batch_size < 1)
    return ddp_error(DDP_ERR_INVALID, "loader: batch_size %lld < 1", (long long)c.batch_size);
  if (c.num_workers < 0 || c.num_workers > 256)
    return ddp_error(DDP_ERR_INVALID, "loader: num_workers %d outside [0, 256]", c.num_workers);
  if (c.prefetch < 0 || c.prefetch > 1024)
    return ddp_error(DDP_ERR_INVALID, "loader: prefetch %d outside [0, 1024]", c.prefetch);
  if (c.normalize && !(c.std > 0.0f))
    return ddp_error(DDP_ERR_INVALID, "loader: normalisation needs std > 0, got %g", c.std);
  if (info->input_ndim + 1 > DDP_MAX_DIMS)
    return ddp_error(DDP_ERR_SHAPE, "loader: samples of %d dimensions leave no room for the batch",
                     info->input_ndim);
  if (!(c.timeout_s > 0.0))
    return ddp_error(DDP_ERR_INVALID, "loader: timeout_s must be > 0, got %g", c.timeout_s);

  ddp_loader *l = ddp_calloc(1, sizeof *l);
  if (!l) return ddp_error(DDP_ERR_NOMEM, "loader: cannot allocate");
  l->ds = ds;
  l->cfg = c;
  l->held = -1;
  ddp_status status = init_sync(l);
  if (status != DDP_OK) {
    ddp_free(l);
    return status;
  }
  if (c.sampler) {
    l->sampler = c.sampler;
  } else {
    status = c.shuffle ? ddp_sampler_create_random(&l->sampler, info->num_samples, c.seed)
                       : ddp_sampler_create_sequential(&l->sampler, info->num_samples);
    if (status != DDP_OK) goto err;
    l->owns_sampler = true;
  }
  l->num_samples = ddp_sampler_length(l->sampler);
  l->capacity = l->num_samples;
  l->num_batches = c.drop_last ? l->num_samples / c.batch_size
                               : (l->num_samples + c.batch_size - 1) / c.batch_size;
  l->mean = c.normalize ? c.mean : 0.0f;
  l->std = c.normalize ? c.std : 1.0f;
  for (int v = 0; v < 256; v++) l->lut[v] = ((float)v / 255.0f - l->mean) / l->std;

  l->indices = ddp_alloc((size_t)(l->num_samples ? l->num_samples : 1) * sizeof(int64_t));
  l->num_slots = c.num_workers == 0 ? 1 : (c.prefetch ? c.prefetch : 2 * c.num_workers + 1);
  l->slots = ddp_calloc((size_t)l->num_slots, sizeof *l->slots);
  if (!l->indices || !l->slots) goto nomem;
  const size_t x_bytes = (size_t)c.batch_size * (size_t)info->input_numel * sizeof(float);
  const size_t y_bytes = (size_t)c.batch_size * (size_t)info->target_numel *
                         ddp_dtype_size(info->target_dtype);
  for (int i = 0; i < l->num_slots; i++) {
    l->slots[i].x = ddp_alloc(x_bytes);
    l->slots[i].y = ddp_alloc(y_bytes);
    if (!l->slots[i].x || !l->slots[i].y) goto nomem;
  }
  if (c.num_workers > 0) {
    l->threads = ddp_calloc((size_t)c.num_workers, sizeof *l->threads);
    if (!l->threads) goto nomem;
    for (int i = 0; i < c.num_workers; i++) {
      int rc = pthread_create(&l->threads[i], NULL, worker_main, l);
      if (rc != 0) {
        status = ddp_error(DDP_ERR_SYS, "loader: cannot start worker %d of %d: %s", i,
                           c.num_workers, strerror(rc));
        goto err;
      }
      l->num_threads++;
    }
  }
  *out = l;
  return DDP_OK;

nomem:
  status = ddp_error(DDP_ERR_NOMEM, "loader: cannot allocate %d batch buffers of %lld samples",
                     l->num_slots, (long long)c.batch_size);
err:
  ddp_loader_destroy(l);
  return status;
}

int64_t ddp_loader_num_batches(const ddp_loader *l) { return l->num_batches; }

int64_t ddp_loader_num_samples(const ddp_loader *l) { return l->num_samples; }

/* Waits until no worker is filling a slot; called with mu held. */
static ddp_status wait_idle(ddp_loader *l) {
  struct timespec ts = deadline_after_ns((int64_t)(l->cfg.timeout_s * 1e9));
  while (l->busy > 0) {
    int rc = pthread_cond_timedwait(&l->idle_cv, &l->mu, &ts);
    if (rc == ETIMEDOUT && l->busy > 0)
      return ddp_error(DDP_ERR_TIMEOUT, "loader: %d workers still busy after %.1f s", l->busy,
                       l->cfg.timeout_s);
  }
  return DDP_OK;
}

ddp_status ddp_loader_start_epoch(ddp_loader *l, int64_t epoch) {
  pthread_mutex_lock(&l->mu);
  /* Stop claims for the old epoch and let the batches in flight finish, so
   * nothing reads the indices while the sampler rewrites them. */
  l->claims_open = false;
  l->epoch_started = false;
  ddp_status status = wait_idle(l);
  if (status != DDP_OK) goto out;
  const char *name = l->sampler->ops->name;
  /* An epoch may be shorter than the first (a resumed one,
   * ddp_sampler_distributed_resume), never longer: the index buffer was
   * sized at creation. */
  ddp_sampler_set_epoch(l->sampler, epoch);
  const int64_t length = ddp_sampler_length(l->sampler);
  if (length < 0 || length > l->capacity) {
    status = ddp_error(DDP_ERR_STATE, "loader: sampler %s gives %lld indices in epoch %lld, more than the %lld "
                       "of its first epoch", name, (long long)length, (long long)epoch,
                       (long long)l->capacity);
    goto out;
  }
  l->num_samples = length;
  l->num_batches = l->cfg.drop_last ? length / l->cfg.batch_size
                                    : (length + l->cfg.batch_size - 1) / l->cfg.batch_size;
  status = ddp_sampler_fill(l->sampler, l->indices);
  if (status != DDP_OK) {
    status = ddp_error_wrap(status, "loader: sampler %s, epoch %lld", name, (long long)epoch);
    goto out;
  }
  const int64_t n = ddp_dataset_size(l->ds);
  for (int64_t i = 0; i < l->num_samples; i++)
    if (l->indices[i] < 0 || l->indices[i] >= n) {
      status = ddp_error(DDP_ERR_RANGE,
                         "loader: sampler %s gave index %lld at position %lld of epoch %lld, "
                         "outside the dataset's [0, %lld)",
                         name, (long long)l->indices[i], (long long)i, (long long)epoch,
                         (long long)n);
      goto out;
    }
  for (int i = 0; i < l->num_slots; i++) l->slots[i].state = SLOT_FREE;
  l->next_claim = 0;
  l->released = 0;
  l->next_consume = 0;
  l->held = -1;
  l->epoch_started = true;
  l->claims_open = true;
  pthread_cond_broadcast(&l->work_cv);
out:
  pthread_mutex_unlock(&l->mu);
  return status;
}

static ddp_status make_views(ddp_loader *l, loader_slot *slot, int64_t b, ddp_batch *batch) {
  const ddp_dataset_info *info = ddp_dataset_get_info(l->ds);
  int64_t first;
  const int64_t size = batch_rows(l, b, &first);
  int64_t shape[DDP_MAX_DIMS];
  shape[0] = size;
  for (int d = 0; d < info->input_ndim; d++) shape[1 + d] = info->input_shape[d];
  DDP_TRY(ddp_tensor_wrap(&batch->x, DDP_FLOAT32, 1 + info->input_ndim, shape, slot->x));
  shape[1] = info->target_numel;
  if (info->target_dtype == DDP_INT64 && info->target_numel == 1)
    DDP_TRY(ddp_tensor_wrap(&batch->y, DDP_INT64, 1, shape, slot->y));
  else
    DDP_TRY(ddp_tensor_wrap(&batch->y, info->target_dtype, 2, shape, slot->y));
  batch->size = size;
  batch->index = b;
  batch->indices = l->indices + first;
  return DDP_OK;
}

static void end_of_epoch(ddp_batch *batch) {
  memset(batch, 0, sizeof *batch);
  batch->index = -1;
}

ddp_status ddp_loader_next(ddp_loader *l, ddp_batch *batch) {
  pthread_mutex_lock(&l->mu);
  if (!l->epoch_started) {
    pthread_mutex_unlock(&l->mu);
    return ddp_error(DDP_ERR_STATE, "loader: no epoch running: call ddp_loader_start_epoch first");
  }
  if (l->num_threads == 0) {
    /* Synchronous: fill the one slot on the caller's thread. */
    const int64_t b = l->next_consume;
    if (b >= l->num_batches) {
      pthread_mutex_unlock(&l->mu);
      end_of_epoch(batch);
      return DDP_OK;
    }
    l->next_consume++;
    pthread_mutex_unlock(&l->mu);
    fill_slot(l, &l->slots[0], b);
    return make_views(l, &l->slots[0], b, batch);
  }
  if (l->held >= 0) {
    /* The caller is done with the batch it held: its slot may be refilled. */
    l->slots[l->held % l->num_slots].state = SLOT_FREE;
    l->released = l->held + 1;
    l->held = -1;
    pthread_cond_signal(&l->work_cv);
  }
  const int64_t b = l->next_consume;
  if (b >= l->num_batches) {
    pthread_mutex_unlock(&l->mu);
    end_of_epoch(batch);
    return DDP_OK;
  }
  loader_slot *slot = &l->slots[b % l->num_slots];
  if (l->next_claim == b) {
    /* No worker has started the batch we need (they are descheduled on a
     * busy machine, or fewer than the consumer's pace): fill it here rather
     * than wait, so workers never make the loader slower than none. */
    l->next_claim++;
    fill_claimed(l, slot, b);
  }
  struct timespec ts = deadline_after_ns((int64_t)(l->cfg.timeout_s * 1e9));
  while (!(slot->state == SLOT_READY && slot->batch == b)) {
    int rc = pthread_cond_timedwait(&l->ready_cv, &l->mu, &ts);
    if (rc == ETIMEDOUT && !(slot->state == SLOT_READY && slot->batch == b)) {
      pthread_mutex_unlock(&l->mu);
      return ddp_error(DDP_ERR_TIMEOUT, "loader: batch %lld of %lld not ready after %.1f s",
                       (long long)b, (long long)l->num_batches, l->cfg.timeout_s);
    }
  }
  l->next_consume++;
  l->held = b;
  pthread_mutex_unlock(&l->mu);
  return make_views(l, slot, b, batch);
}
