/* ZeRO stages 1 and 2 over the data-parallel wrapper (include/ddp/zero.h,
 * docs/sharding.md): the ranks' ranges of the flat buffers, the stage-2
 * communication hook that reduces each bucket to the owners of its floats,
 * the parameters' gather after the update, the optimizer state's move at
 * the wrapper's relayout, and the state's gather and load for checkpoints.
 * Same layer as the wrapper: it reads the wrapper's internals (whether its
 * relayout is still to come) rather than widen the wrapper's API. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ddp/zero.h"
#include "parallel/dp_internal.h"
#include "parallel/zero_prefetch.h"

struct ddp_zero {
  ddp_dp *dp;
  ddp_model *model;
  ddp_process_group *pg;
  ddp_optimizer *opt; /* narrowed to [lo[rank], lo[rank + 1]) */
  int stage, rank, world;
  int64_t n;          /* floats in each flat buffer */
  int64_t *lo;        /* (world + 1) range starts; lo[world] = n */
  int n_params;
  int64_t *offsets;   /* (n_params) parameter offsets as the state was laid out */
  bool params_stale;  /* a backward ran since the last gather: an update may follow */
  bool relayout_seen; /* the wrapper's relayout has been followed */
  /* Stage 2: per bucket, the reduces launched before the one whose work
   * went back to the wrapper (done when it is: one queue, in order). */
  ddp_work **pending;   /* (n_params * world) */
  int *n_pending;       /* (n_params) */
  bool *bucket_full;    /* (n_params) this backward's bucket was allreduced whole */
  /* Stage 3: the model's top-level modules that have parameters ("units"),
   * each a contiguous region [unit_lo, unit_hi) of the flat buffers (no
   * relayout), gathered before its forward and its backward and released
   * after (docs/sharding.md, "Stage 3"). */
  int n_units;
  int64_t *unit_lo, *unit_hi;  /* (n_units) */
  int *unit_name_len;          /* (n_units) the prefix of its parameters' names */
  int *unit_first_param;       /* (n_units) */
  int *unit_params, *unit_pending; /* (n_units) its parameters; those without a final gradient yet */
  int *param_unit;             /* (n_params) */
  bool *gathered;              /* (n_units) its region holds the current parameters */
  /* This forward's units in the order they ran (the forward order, which
   * need not be the registration order: ddp_model_set_forward_order), and
   * each unit's place in it; backward gathers them in reverse. */
  int *fwd_seq, *fwd_pos;      /* (n_units) */
  int n_seq;
  int fwd_held;                /* the unit kept after its forward, until the next one's (-1) */
  bool whole;                  /* every parameter is here (ddp_zero_sync_params) */
  bool in_forward;             /* inside ddp_zero_forward: the forward hook gathers */
  ddp_status backward_error;   /* a gather in the grad hook failed */
  int64_t page_floats;         /* floats in a page */
  int64_t largest_unit;        /* floats */
  bool prefetch;               /* options: not no_prefetch */
  ddp__zero_prefetch *pf;      /* the gathers in flight (zero_prefetch.c) */
  /* Stage 2's gradient ring (docs/sharding.md, "Gradient memory under
   * stage 2"): once the wrapper's relayout is decided, backward writes
   * bucket b's gradients into slot b % RING_SLOTS of `ring` instead of the
   * flat buffer, each bucket is reduced from there and this rank's part
   * is added into its range of the flat buffer, the only part of that
   * buffer kept (the rest's pages are given back). */
  int ring_mode;               /* DDP_ZERO_GRAD_RING: RING_AUTO, RING_ALWAYS, RING_NEVER */
  bool ring_on;                /* backward writes into the ring */
  bool ring_off;               /* ruled out for this run (the first plan failed) */
  bool user_no_sync;           /* ddp_zero_set_no_sync's flag while the ring reduces every backward */
  bool flat_dirty;             /* the flat buffer holds unreduced gradients (a no_sync backward) */
  bool owned_fresh;            /* ddp_zero_zero_grad since the last ring backward: assign, not add */
  float *ring;                 /* ring_floats: min(RING_SLOTS, buckets) slots */
  int64_t slot_floats;         /* the largest bucket */
  int64_t ring_floats;
  int *ring_uses;              /* (n_params) the plan's uses left of each parameter */
  int *ring_bpend;             /* (n_params) the plan's parameters not ready per bucket */
  int *need_ev;                /* (n_params) per bucket: hook calls before its first write */
  int *launch_ev;              /* (n_params) per bucket: the hook call that launches it */
  int *claim_at;               /* (n_params) per bucket: the hook call after which its slot is cleared */
  double *ring_div;            /* (n_params) per bucket: its divisor at launch */
  bool *retired;               /* (n_params) per bucket: reduced and added into the range */
  int ring_ev, next_claim;
  bool in_ring_backward;       /* inside ring_backward: the slots are claimed */
  ddp_status ring_error;       /* first failure inside the grad hook */
};

/* Two slots: bucket b + 2 is written only after bucket b's reduce has
 * completed, which leaves bucket b + 1's backward to overlap it. */
#define RING_SLOTS 2
/* DDP_ZERO_GRAD_RING: "auto" (the default) uses the ring where it holds
 * less than the buffer it replaces; "always" wherever the graph fits it
 * (tests: small models whose largest bucket is half the model); "never"
 * keeps the whole buffer (a comparison). */
enum { RING_AUTO, RING_ALWAYS, RING_NEVER };

ddp_zero_options ddp_zero_defaults(int stage) {
  ddp_zero_options o;
  memset(&o, 0, sizeof o);
  o.stage = stage;
  o.dp = ddp_dp_defaults();
  return o;
}

ddp_dp *ddp_zero_dp(ddp_zero *z) { return z->dp; }
int ddp_zero_stage(const ddp_zero *z) { return z->stage; }

void ddp_zero_range(const ddp_zero *z, int rank, int64_t *offset, int64_t *numel) {
  *offset = z->lo[rank];
  *numel = z->lo[rank + 1] - z->lo[rank];
}

/* Under the ring every backward reduces (DeepSpeed's stage 2 under
 * gradient accumulation): no_sync then only keeps the parameters from
 * being marked for a gather. */
void ddp_zero_set_no_sync(ddp_zero *z, bool no_sync) {
  z->user_no_sync = no_sync;
  if (!z->ring_on) ddp_dp_set_no_sync(z->dp, no_sync);
}

static void free_pending(ddp_zero *z, int b) {
  ddp_work **w = z->pending + (size_t)b * (size_t)z->world;
  for (int k = 0; k < z->n_pending[b]; k++) {
    (void)ddp_work_wait(w[k], -1);
    ddp_work_free(w[k]);
    w[k] = NULL;
  }
  z->n_pending[b] = 0;
}

void ddp_zero_destroy(ddp_zero *z) {
  if (!z) return;
  if (z->pending)
    for (int b = 0; b < z->n_params; b++) free_pending(z, b);
  if (z->stage == 3 && z->model) ddp_model_set_forward_hook(z->model, NULL, NULL);
  ddp__zero_prefetch_destroy(z->pf); /* waits for gathers in flight */
  ddp_dp_destroy(z->dp);
  ddp_free(z->lo);
  ddp_free(z->offsets);
  ddp_free(z->pending);
  ddp_free(z->n_pending);
  ddp_free(z->bucket_full);
  ddp_free(z->unit_lo);
  ddp_free(z->unit_hi);
  ddp_free(z->unit_name_len);
  ddp_free(z->unit_first_param);
  ddp_free(z->unit_params);
  ddp_free(z->unit_pending);
  ddp_free(z->param_unit);
  ddp_free(z->gathered);
  ddp_free(z->fwd_seq);
  ddp_free(z->fwd_pos);
  ddp_free(z->ring);
  ddp_free(z->ring_uses);
  ddp_free(z->ring_bpend);
  ddp_free(z->need_ev);
  ddp_free(z->launch_ev);
  ddp_free(z->claim_at);
  ddp_free(z->ring_div);
  ddp_free(z->retired);
  ddp_free(z);
}

/* ---- Stage 2: reduce each bucket to its floats' owners --------------------
 * A bucket [a, b) of the gradient buffer meets the ranges of one or more
 * ranks; each meeting is one in-place reduce (sum) to that range's owner,
 * so every float is summed once, on the rank that steps it: the traffic of
 * a reduce-scatter, with ranges that need not split the bucket evenly.
 * Until the wrapper has made its relayout (after the first synced
 * backward) the bucket is allreduced whole instead: the relayout moves
 * gradients between ranges, and after it each rank's new range must hold
 * averaged values. */

/* The ring's reduce of bucket b: from its slot, each part to the owner of
 * its floats, as stage2_launch does on the flat buffer. The works are the
 * zero's (ring_retire waits for them); the last bucket is reduced on this
 * thread, as the wrapper's hooks do. */
static float *ring_slot(const ddp_zero *z, int b) {
  return z->ring + (size_t)(b % RING_SLOTS) * (size_t)z->slot_floats;
}

static ddp_status ring_launch(ddp_zero *z, ddp_process_group *pg, ddp_dp_bucket *bucket) {
  const int b = bucket->index;
  if (!z->in_ring_backward)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "zero stage 2 (rank %d): bucket %d reduced outside ddp_zero_backward "
                     "(ddp_dp_join, ddp_dp_reduce_grads on the wrapper inside): the gradient ring "
                     "holds no gradients there; set DDP_ZERO_GRAD_RING=never for this run",
                     z->rank, b);
  z->ring_div[b] = bucket->divisor;
  z->retired[b] = false;
  float *slot = ring_slot(z, b);
  const int64_t a = bucket->offset, e = bucket->offset + (int64_t)bucket->numel;
  ddp_work **pend = z->pending + (size_t)b * (size_t)z->world;
  for (int r = 0; r < z->world; r++) {
    int64_t from = a > z->lo[r] ? a : z->lo[r], to = e < z->lo[r + 1] ? e : z->lo[r + 1];
    if (from >= to) continue;
    if (bucket->last) {
      DDP_TRY(ddp_reduce(pg, slot + (from - a), (size_t)(to - from), DDP_FLOAT32, DDP_REDUCE_SUM, r));
      continue;
    }
    ddp_work *w = NULL;
    DDP_TRY(ddp_reduce_async(pg, slot + (from - a), (size_t)(to - from), DDP_FLOAT32,
                             DDP_REDUCE_SUM, r, &w));
    pend[z->n_pending[b]++] = w;
  }
  return DDP_OK;
}

static ddp_status stage2_launch(void *state, ddp_process_group *pg, ddp_dp_bucket *bucket,
                                ddp_work **work) {
  ddp_zero *z = state;
  const int b = bucket->index;
  *work = NULL;
  free_pending(z, b); /* left by a failed backward */
  if (z->ring_on) return ring_launch(z, pg, bucket);
  z->bucket_full[b] = !z->dp->relayout_done;
  if (z->bucket_full[b]) {
    if (bucket->last) return ddp_allreduce(pg, bucket->grads, bucket->numel, DDP_FLOAT32, DDP_REDUCE_SUM);
    return ddp_allreduce_async(pg, bucket->grads, bucket->numel, DDP_FLOAT32, DDP_REDUCE_SUM, work);
  }
  float *flat = ddp_model_grads_flat(z->model);
  const int64_t a = bucket->offset, e = bucket->offset + (int64_t)bucket->numel;
  ddp_work **pend = z->pending + (size_t)b * (size_t)z->world;
  ddp_work *prev = NULL;
  for (int r = 0; r < z->world; r++) {
    int64_t from = a > z->lo[r] ? a : z->lo[r], to = e < z->lo[r + 1] ? e : z->lo[r + 1];
    if (from >= to) continue;
    if (bucket->last) {
      DDP_TRY(ddp_reduce(pg, flat + from, (size_t)(to - from), DDP_FLOAT32, DDP_REDUCE_SUM, r));
      continue;
    }
    if (prev) pend[z->n_pending[b]++] = prev;
    prev = NULL;
    DDP_TRY(ddp_reduce_async(pg, flat + from, (size_t)(to - from), DDP_FLOAT32, DDP_REDUCE_SUM, r,
                             &prev));
  }
  *work = prev;
  return DDP_OK;
}

/* The same division as the wrapper's float32 hook (g / d, rounded once),
 * on the floats this rank owns, or on the whole bucket when it was
 * allreduced whole. */
static ddp_status stage2_finish(void *state, ddp_dp_bucket *bucket) {
  ddp_zero *z = state;
  const int b = bucket->index;
  if (z->ring_on) return DDP_OK; /* retired by the ring (ring_retire) */
  free_pending(z, b);
  int64_t from = bucket->offset, to = bucket->offset + (int64_t)bucket->numel;
  if (!z->bucket_full[b]) {
    if (from < z->lo[z->rank]) from = z->lo[z->rank];
    if (to > z->lo[z->rank + 1]) to = z->lo[z->rank + 1];
  }
  const float d = (float)bucket->divisor;
  if (d == 1.0f || from >= to) return DDP_OK;
  float *restrict g = ddp_model_grads_flat(z->model) + from;
  const size_t n = (size_t)(to - from);
  for (size_t i = 0; i < n; i++) g[i] /= d;
  return DDP_OK;
}

/* ---- Stage 3: parameters gathered per top-level module ----------------------
 * Each rank keeps its range of the flat parameter buffer; the rest of the
 * buffer's pages are given back to the system (madvise MADV_DONTNEED: the
 * address range stays, its memory goes, a later write faults a zeroed page
 * in) except while a unit is gathered: before its forward (the model's
 * forward hook) and before its backward (the grad hook, when the last
 * gradient of the unit that ran after it in forward is final, which in a
 * Sequential is just before the unit's first op in backward). A unit is
 * released when the next one's forward begins (the last one is kept: its
 * backward comes next) and after its backward. Only whole
 * pages inside a unit and outside the rank's range are released: a page
 * shared with a neighbour or with the range stays (at most two per unit). */

static ddp_status gather_region(ddp_zero *z, int64_t a, int64_t b) {
  float *p = ddp_model_params_flat(z->model);
  for (int r = 0; r < z->world; r++) {
    const int64_t from = a > z->lo[r] ? a : z->lo[r], to = b < z->lo[r + 1] ? b : z->lo[r + 1];
    if (from >= to) continue;
    ddp_status s = ddp_broadcast(z->pg, p + from, (size_t)(to - from), DDP_FLOAT32, r);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "zero (rank %d): gathering floats [%lld, %lld) from rank %d",
                            z->rank, (long long)from, (long long)to, r);
  }
  return DDP_OK;
}

static void note_held(ddp_zero *z) {
  int held = 0;
  for (int k = 0; k < z->n_units; k++) held += z->gathered[k];
  ddp__zero_prefetch_note_held(z->pf, held);
}

/* Enqueues unit k's gather unless it is gathered or on its way; `ahead`:
 * a prefetch. gathered[k] from then on means "holds, or will once its
 * work completes, the current parameters". */
static ddp_status start_unit(ddp_zero *z, int k, bool ahead) {
  if (z->gathered[k]) return DDP_OK;
  DDP_TRY(ddp__zero_gather_issue(z->pf, k, ahead));
  z->gathered[k] = true;
  note_held(z);
  return DDP_OK;
}

/* Gives back the whole pages of [from, to) of the parameter buffer. */
static void release_floats(ddp_zero *z, int64_t from, int64_t to) {
  const int64_t pf = z->page_floats;
  float *p = ddp_model_params_flat(z->model);
  const uintptr_t base = (uintptr_t)p, page = (uintptr_t)pf * sizeof(float);
  uintptr_t start = base + (uintptr_t)from * sizeof(float), end = base + (uintptr_t)to * sizeof(float);
  start = (start + page - 1) / page * page;
  end = end / page * page;
  if (end > start) (void)madvise((void *)start, end - start, MADV_DONTNEED);
}

static void release_unit(ddp_zero *z, int k) {
  if (!z->gathered[k]) return;
  /* Never give back pages a gather still writes (its failure is the
   * group's, sticky: the next collective reports it). */
  (void)ddp__zero_gather_wait(z->pf, k, false);
  ddp__zero_prefetch_log(z->pf, DDP_ZERO_EVENT_RELEASED, k);
  const int64_t a = z->unit_lo[k], b = z->unit_hi[k];
  const int64_t own_a = z->lo[z->rank], own_b = z->lo[z->rank + 1];
  /* [a, b) less [own_a, own_b): up to two pieces. */
  release_floats(z, a, b < own_a ? b : own_a);
  release_floats(z, a > own_b ? a : own_b, b);
  z->gathered[k] = false;
}

static void release_all(ddp_zero *z) {
  (void)ddp__zero_gather_drain(z->pf);
  for (int k = 0; k < z->n_units; k++) {
    z->gathered[k] = true; /* whatever it holds goes */
    release_unit(z, k);
  }
  z->whole = false;
}

static int unit_of_child(const ddp_zero *z, const char *child) {
  for (int k = 0; k < z->n_units; k++) {
    const char *name = ddp_model_param_name(z->model, z->unit_first_param[k]);
    const int len = z->unit_name_len[k];
    if (!strncmp(name, child, (size_t)len) && child[len] == '\0') return k;
  }
  return -1;
}

/* A unit is kept after its forward until the next unit's forward begins:
 * the one kept when the forward ends is the last, whose backward comes
 * first. Before a unit's forward the one before it is released, the unit
 * after it (in the previous forward's order) is prefetched and the unit
 * itself is waited for: at most two units are gathered or in flight. */
static ddp_status forward_hook(ddp_model *model, const char *child, bool after, void *user) {
  (void)model;
  ddp_zero *z = user;
  if (!z->in_forward) return DDP_OK; /* an evaluation on the whole model */
  const int k = unit_of_child(z, child);
  if (k < 0) return DDP_OK; /* no parameters */
  if (after) {
    z->fwd_held = k;
    ddp__zero_prefetch_log(z->pf, DDP_ZERO_EVENT_FORWARD_DONE, k);
    return DDP_OK;
  }
  /* A unit entered again after another one (a block reused in the
   * forward, A B A) would be backpropagated with the other released: its
   * gradients complete only after both uses' backward, so the release-
   * and-gather chain of stage3_grad_ready cannot order them. Refused, not
   * computed on released (zeroed) pages. */
  if (z->fwd_pos[k] >= 0 && z->fwd_seq[z->n_seq - 1] != k)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "zero stage 3: top-level module '%s' runs a second time in one forward, "
                     "after another module; stage 3 gathers each module once per forward in "
                     "the order they ran. Use stage 1 or 2 for a model that reuses a module",
                     child);
  if (z->fwd_held >= 0 && z->fwd_held != k) release_unit(z, z->fwd_held);
  z->fwd_held = -1;
  if (z->fwd_pos[k] < 0) {
    z->fwd_pos[k] = z->n_seq;
    z->fwd_seq[z->n_seq++] = k;
  }
  /* k's own gather first (the queue runs in order), then the next unit's,
   * so that it moves while k computes; then k is waited for. */
  DDP_TRY(start_unit(z, k, false));
  const int next = ddp__zero_prefetch_forward_next(z->pf, k, z->fwd_pos[k]);
  if (next >= 0 && next != k && z->fwd_pos[next] < 0) DDP_TRY(start_unit(z, next, true));
  return ddp__zero_gather_wait(z->pf, k, true);
}

/* Backward prefetch (FSDP's BACKWARD_PRE): as unit fwd_seq[at]'s backward
 * begins, the gather of the unit before it is enqueued, to move while
 * fwd_seq[at] computes. */
static ddp_status backward_prefetch(ddp_zero *z, int at) {
  if (!ddp__zero_prefetch_enabled(z->pf) || at < 1) return DDP_OK;
  return start_unit(z, z->fwd_seq[at - 1], true);
}

/* The tape's grad hook under stage 3: the wrapper's (when it reduces this
 * backward: stage 2's reduces, enqueued as buckets fill, overlap the rest
 * of backward), then, when a unit's last gradient is final, that unit is
 * released, the one before it waited for (prefetched as this one's
 * backward began, or gathered now) and the one before that prefetched. */
static void stage3_grad_ready(ddp_tensor *param, void *user) {
  ddp_zero *z = user;
  if (z->dp->syncing) ddp__dp_grad_ready(param, z->dp);
  const int i = param->param_index;
  if (i < 0 || i >= z->n_params || ddp_model_param(z->model, i) != param) return;
  const int k = z->param_unit[i];
  if (--z->unit_pending[k] != 0) return;
  ddp__zero_prefetch_log(z->pf, DDP_ZERO_EVENT_BACKWARD_DONE, k);
  release_unit(z, k);
  const int at = z->fwd_pos[k];
  if (at <= 0 || z->backward_error != DDP_OK) return;
  const int before = z->fwd_seq[at - 1];
  ddp_status s = start_unit(z, before, false);
  if (s == DDP_OK) s = backward_prefetch(z, at - 1);
  if (s == DDP_OK) s = ddp__zero_gather_wait(z->pf, before, true);
  z->backward_error = s;
}

/* The units from the parameters' names (the first component is the
 * top-level module), in registration order, which without a relayout is
 * the flat buffer's. */
static ddp_status make_units(ddp_zero *z) {
  const int np = z->n_params;
  size_t slots = (size_t)(np ? np : 1);
  z->unit_lo = ddp_calloc(slots, sizeof(int64_t));
  z->unit_hi = ddp_calloc(slots, sizeof(int64_t));
  z->unit_name_len = ddp_calloc(slots, sizeof(int));
  z->unit_first_param = ddp_calloc(slots, sizeof(int));
  z->unit_params = ddp_calloc(slots, sizeof(int));
  z->unit_pending = ddp_calloc(slots, sizeof(int));
  z->param_unit = ddp_calloc(slots, sizeof(int));
  z->gathered = ddp_calloc(slots, sizeof(bool));
  z->fwd_seq = ddp_calloc(slots, sizeof(int));
  z->fwd_pos = ddp_calloc(slots, sizeof(int));
  if (!z->unit_lo || !z->unit_hi || !z->unit_name_len || !z->unit_first_param ||
      !z->unit_params || !z->unit_pending || !z->param_unit || !z->gathered || !z->fwd_seq ||
      !z->fwd_pos)
    return ddp_error(DDP_ERR_NOMEM, "zero: stage 3: out of memory for %d parameters", np);
  long page = sysconf(_SC_PAGESIZE);
  z->page_floats = (page > 0 ? page : 4096) / (long)sizeof(float);
  int64_t end = 0;
  for (int i = 0; i < np; i++) {
    const char *name = ddp_model_param_name(z->model, i);
    const char *dot = strchr(name, '.');
    const int len = dot ? (int)(dot - name) : (int)strlen(name);
    const int64_t off = ddp_model_param_offset(z->model, i);
    const int64_t numel = ddp_model_param(z->model, i)->numel;
    int k = z->n_units - 1;
    if (k < 0 || len != z->unit_name_len[k] ||
        strncmp(name, ddp_model_param_name(z->model, z->unit_first_param[k]), (size_t)len)) {
      for (int j = 0; j < z->n_units; j++)
        if (len == z->unit_name_len[j] &&
            !strncmp(name, ddp_model_param_name(z->model, z->unit_first_param[j]), (size_t)len))
          return ddp_error(DDP_ERR_UNSUPPORTED, "zero: stage 3: parameter '%s' comes after "
                           "another module's: each top-level module's parameters must be "
                           "registered together", name);
      k = z->n_units++;
      z->unit_name_len[k] = len;
      z->unit_first_param[k] = i;
      z->unit_lo[k] = off;
    }
    if (off != end)
      return ddp_error(DDP_ERR_UNSUPPORTED, "zero: stage 3: parameter '%s' is at float %lld of "
                       "the flat buffer, not %lld: the buffer must be in registration order",
                       name, (long long)off, (long long)end);
    end = off + numel;
    z->unit_hi[k] = end;
    z->unit_params[k]++;
    z->param_unit[i] = k;
  }
  for (int k = 0; k < z->n_units; k++)
    if (z->unit_hi[k] - z->unit_lo[k] > z->largest_unit) z->largest_unit = z->unit_hi[k] - z->unit_lo[k];
  return DDP_OK;
}

/* ---- Construction ------------------------------------------------------------ */

static void snapshot_offsets(ddp_zero *z) {
  for (int i = 0; i < z->n_params; i++) z->offsets[i] = ddp_model_param_offset(z->model, i);
}

ddp_status ddp_zero_create(ddp_zero **out, ddp_model *model, ddp_process_group *pg,
                           ddp_optimizer *opt, const ddp_zero_options *options) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "zero: create: out is NULL");
  *out = NULL;
  if (!model || !pg || !opt)
    return ddp_error(DDP_ERR_INVALID, "zero: create: model, group and optimizer are required");
  ddp_zero_options o = options ? *options : ddp_zero_defaults(1);
  const bool prefetch = !o.no_prefetch;
  if (o.stage != 1 && o.stage != 2 && o.stage != 3)
    return ddp_error(DDP_ERR_INVALID, "zero: stage %d: stages 1, 2 and 3 are implemented", o.stage);
  /* Stage 3 gathers a module's contiguous region: the buffer keeps the
   * registration (forward) order. */
  if (o.stage == 3) o.dp.relayout = false;
  /* Stage 3 re-gathers a module for its backward when the module after it
   * has every gradient final, counted by the tape's grad hook; a parameter
   * the wrapper marks ready without a gradient (find_unused_parameters,
   * static_graph) never counts, and the module before it would run its
   * backward released. */
  if (o.stage == 3 && (o.dp.find_unused_parameters || o.dp.static_graph))
    return ddp_error(DDP_ERR_UNSUPPORTED, "zero stage 3: not with find_unused_parameters or "
                                          "static_graph (every parameter must get a gradient in "
                                          "each backward); use stage 1 or 2");
  const int64_t n = ddp_model_num_param_elements(model);
  const int world = ddp_process_group_size(pg), rank = ddp_process_group_rank(pg);
  if (ddp_optimizer_options(opt)->device.type != DDP_DEVICE_CPU ||
      ddp_optimizer_numel(opt) != (size_t)n)
    return ddp_error(DDP_ERR_INVALID,
                     "zero (rank %d): the optimizer covers %zu floats, the model's flat buffers "
                     "%lld: create it over ddp_model_params_flat / ddp_model_grads_flat, on "
                     "the CPU", rank, ddp_optimizer_numel(opt), (long long)n);
  if (n < world)
    return ddp_error(DDP_ERR_INVALID, "zero: the model has %lld floats, fewer than the %d ranks",
                     (long long)n, world);

  ddp_zero *z = ddp_calloc(1, sizeof *z);
  if (!z) return ddp_error(DDP_ERR_NOMEM, "zero: create: out of memory");
  z->model = model;
  z->pg = pg;
  z->opt = opt;
  z->stage = o.stage;
  z->rank = rank;
  z->world = world;
  z->n = n;
  z->n_params = ddp_model_num_params(model);
  size_t slots = (size_t)(z->n_params ? z->n_params : 1);
  z->lo = ddp_calloc((size_t)world + 1, sizeof(int64_t));
  z->offsets = ddp_calloc(slots, sizeof(int64_t));
  z->pending = ddp_calloc(slots * (size_t)world, sizeof(ddp_work *));
  z->n_pending = ddp_calloc(slots, sizeof(int));
  z->bucket_full = ddp_calloc(slots, sizeof(bool));
  z->ring_uses = ddp_calloc(slots, sizeof(int));
  z->ring_bpend = ddp_calloc(slots, sizeof(int));
  z->need_ev = ddp_calloc(slots, sizeof(int));
  z->launch_ev = ddp_calloc(slots, sizeof(int));
  z->claim_at = ddp_calloc(slots, sizeof(int));
  z->ring_div = ddp_calloc(slots, sizeof(double));
  z->retired = ddp_calloc(slots, sizeof(bool));
  ddp_status s;
  if (!z->lo || !z->offsets || !z->pending || !z->n_pending || !z->bucket_full ||
      !z->ring_uses || !z->ring_bpend || !z->need_ev || !z->launch_ev || !z->claim_at ||
      !z->ring_div || !z->retired) {
    s = ddp_error(DDP_ERR_NOMEM, "zero: create: out of memory for %d ranks", world);
    goto err;
  }
  const char *ring = getenv("DDP_ZERO_GRAD_RING");
  if (!ring || !*ring || !strcmp(ring, "auto")) {
    z->ring_mode = RING_AUTO;
  } else if (!strcmp(ring, "always")) {
    z->ring_mode = RING_ALWAYS;
  } else if (!strcmp(ring, "never")) {
    z->ring_mode = RING_NEVER;
  } else {
    s = ddp_error(DDP_ERR_INVALID, "zero: DDP_ZERO_GRAD_RING='%s': auto, always or never", ring);
    goto err;
  }
  /* Balanced: sizes differ by at most one float. */
  for (int r = 0; r <= world; r++) z->lo[r] = n * r / world;
  snapshot_offsets(z);
  if (z->stage == 3) {
    s = make_units(z);
    if (s != DDP_OK) goto err;
    z->prefetch = prefetch;
    ddp__zero_prefetch_config pc = {
        .pg = pg, .params = ddp_model_params_flat(model), .lo = z->lo, .world = world,
        .rank = rank, .unit_lo = z->unit_lo, .unit_hi = z->unit_hi, .n_units = z->n_units,
        .enabled = prefetch};
    s = ddp__zero_prefetch_create(&z->pf, &pc);
    if (s != DDP_OK) goto err;
  }
  s = ddp_dp_create(&z->dp, model, pg, &o.dp);
  if (s != DDP_OK) goto err;
  if (z->stage >= 2) {
    ddp_dp_comm_hook h = {stage2_launch, stage2_finish, z};
    s = ddp_dp_set_comm_hook_fn(z->dp, &h);
    if (s != DDP_OK) goto err;
    /* A bucket meets at most world ranges: room for every reduce in flight,
     * and at stage 3 for two units' gathers (a broadcast per owner). */
    s = ddp_process_group_reserve_works(pg, ddp_dp_num_buckets(z->dp) + world + 2 +
                                                (z->stage == 3 ? 2 * world : 0));
    if (s != DDP_OK) goto err;
  }
  s = ddp_optimizer_narrow(opt, (size_t)z->lo[rank], (size_t)(z->lo[rank + 1] - z->lo[rank]));
  if (s != DDP_OK) goto err;
  if (z->dp->relayout_done) z->relayout_seen = true; /* none will come */
  if (z->stage == 3) {
    /* The wrapper broadcast rank 0's parameters: each rank keeps its range. */
    release_all(z);
    ddp_model_set_forward_hook(model, forward_hook, z);
  }
  *out = z;
  return DDP_OK;
err:
  ddp_zero_destroy(z);
  return ddp_error_wrap(s, "zero: create (rank %d)", rank);
}

/* ---- Following the wrapper's relayout ---------------------------------------
 * The relayout (once, after the first synced backward) moves parameters
 * within the flat buffers; the ranges stay where they are, so the floats of
 * a range now belong to other parameters. State without values needs
 * nothing. State with values (a resumed run) is put together whole in a
 * temporary on every rank (each range broadcast from its owner), moved as
 * the parameters moved, and each rank takes its new range: once per run,
 * allocating n floats twice. */
static ddp_status move_state(ddp_zero *z) {
  const size_t n = (size_t)z->n;
  float *whole = ddp_alloc(2 * n * sizeof(float));
  if (!whole) return ddp_error(DDP_ERR_NOMEM, "zero: relayout: cannot allocate %zu floats", 2 * n);
  float *moved = whole + n;
  const int64_t own = z->lo[z->rank], own_n = z->lo[z->rank + 1] - own;
  ddp_status s = DDP_OK;
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt) && s == DDP_OK; k++) {
    ddp_optim_state st;
    s = ddp_optimizer_state_get(z->opt, k, &st);
    if (s != DDP_OK || st.is_scalar) continue;
    memcpy(whole + own, st.data, (size_t)own_n * sizeof(float));
    for (int r = 0; r < z->world && s == DDP_OK; r++)
      s = ddp_broadcast(z->pg, whole + z->lo[r], (size_t)(z->lo[r + 1] - z->lo[r]), DDP_FLOAT32, r);
    if (s != DDP_OK) break;
    for (int i = 0; i < z->n_params; i++)
      memcpy(moved + ddp_model_param_offset(z->model, i), whole + z->offsets[i],
             (size_t)ddp_model_param(z->model, i)->numel * sizeof(float));
    s = ddp_optimizer_state_load(z->opt, st.name, moved + own, (size_t)own_n);
  }
  ddp_free(whole);
  if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): moving the optimizer state at the relayout", z->rank);
  return DDP_OK;
}

static ddp_status follow_relayout(ddp_zero *z) {
  if (z->relayout_seen || !z->dp->relayout_done) return DDP_OK;
  z->relayout_seen = true;
  if (!z->dp->relaid_out) return DDP_OK; /* the layout was kept */
  if (ddp_optimizer_has_state(z->opt)) DDP_TRY(move_state(z));
  snapshot_offsets(z);
  if (z->stage == 2)
    DDP_TRY(ddp_process_group_reserve_works(z->pg, ddp_dp_num_buckets(z->dp) + z->world + 2));
  return DDP_OK;
}

/* ---- Stage 2: the gradient ring -----------------------------------------------
 * After the wrapper's relayout the flat buffer is in backward order and
 * the buckets fill in index order, so backward needs only a few buckets'
 * room at a time: bucket b's parameters get their `grad` in ring slot
 * b % RING_SLOTS for the backward (moved back to the flat buffer after
 * it), each bucket is reduced from its slot, and this rank's part of it is
 * added, divided, into its range of the flat buffer, which is all of the
 * flat buffer a rank keeps. A slot is cleared for bucket b + RING_SLOTS
 * once bucket b's reduce has completed and been added, before backward
 * writes any of bucket b + RING_SLOTS's gradients. When that is must be
 * known in terms of the tape's grad hook, the only place this code runs
 * during backward: ring_plan walks the recorded tape as backward will,
 * noting for each bucket how many hook calls come before its first write
 * and at which hook call it launches. A graph that writes a bucket before
 * the one RING_SLOTS earlier has launched (a parameter used early and
 * late in backward: tied weights) cannot use the ring: the first plan
 * decides (the run keeps the whole buffer, as stage 1), a later one
 * refuses the backward. */

static bool own_param(const ddp_zero *z, const ddp_tensor *t) {
  const int i = t ? t->param_index : -1;
  return i >= 0 && i < z->n_params && ddp_model_param(z->model, i) == t;
}

static ddp_status ring_plan(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  const ddp_dp *dp = z->dp;
  const int nb = dp->n_buckets, np = z->n_params;
  if (loss->node < 0)
    return ddp_error(DDP_ERR_STATE, "backward: the loss does not depend on anything that "
                     "requires grad (was it computed with grad disabled?)");
  for (int i = 0; i < np; i++) z->ring_uses[i] = ddp__tape_leaf_pending(tape, ddp_model_param(z->model, i));
  for (int b = 0; b < nb; b++) {
    z->ring_bpend[b] = dp->buckets[b].n_params;
    z->need_ev[b] = -1;
    z->launch_ev[b] = INT32_MAX;
  }
  int ev = 0, launched = 0;
  for (int k = loss->node; k >= 0; k--) {
    const ddp__node *node = ddp__tape_node_at(tape, k);
    /* The node's backward writes its leaves' gradients, then the tape
     * counts their uses down and calls the hook for each one that is done. */
    for (int j = 0; j < node->n_inputs; j++) {
      if (node->leaf[j] < 0 || !own_param(z, node->in[j])) continue;
      const int b = dp->bucket_of[node->in[j]->param_index];
      if (z->need_ev[b] < 0) z->need_ev[b] = ev;
    }
    for (int j = 0; j < node->n_inputs; j++) {
      if (node->leaf[j] < 0 || !own_param(z, node->in[j])) continue;
      const int i = node->in[j]->param_index;
      if (--z->ring_uses[i] != 0) continue;
      z->ring_bpend[dp->bucket_of[i]]--;
      while (launched < nb && z->ring_bpend[launched] == 0) z->launch_ev[launched++] = ev;
      ev++;
    }
  }
  if (launched < nb) {
    const int i = dp->buckets[launched].params[0];
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "zero stage 2 (rank %d): bucket %d (parameter '%s' and others) gets no "
                     "final gradient in this backward; every parameter must take part in the loss",
                     z->rank, launched, ddp_model_param_name(z->model, i));
  }
  /* Bucket m's slot is cleared at the last hook call before its first
   * write, or earlier to keep the clears in bucket order; it must come
   * at or after bucket m - RING_SLOTS's launch. */
  for (int m = nb - 1; m >= 0; m--) {
    if (m < RING_SLOTS) {
      z->claim_at[m] = -1; /* cleared before backward */
      continue;
    }
    int at = (z->need_ev[m] < 0 ? ev : z->need_ev[m]) - 1;
    if (m + 1 < nb && z->claim_at[m + 1] < at) at = z->claim_at[m + 1];
    z->claim_at[m] = at;
  }
  for (int m = RING_SLOTS; m < nb; m++)
    if (z->claim_at[m] < z->launch_ev[m - RING_SLOTS])
      return ddp_error(DDP_ERR_UNSUPPORTED,
                       "zero stage 2 (rank %d): backward writes bucket %d's gradients (parameter "
                       "'%s' and others) before bucket %d's are final: the gradient ring of %d "
                       "buckets cannot hold this graph (a parameter used both early and late in "
                       "backward, as tied weights are); a larger bucket_cap_mb may fit it, "
                       "else stage 1", z->rank, m, ddp_model_param_name(z->model, dp->buckets[m].params[0]),
                       m - RING_SLOTS, RING_SLOTS);
  return DDP_OK;
}

static void ring_point_grads(ddp_zero *z) {
  const ddp_dp *dp = z->dp;
  for (int b = 0; b < dp->n_buckets; b++) {
    float *slot = ring_slot(z, b);
    for (int k = 0; k < dp->buckets[b].n_params; k++) {
      const int i = dp->buckets[b].params[k];
      ddp_model_param(z->model, i)->grad = slot + (ddp_model_param_offset(z->model, i) - dp->buckets[b].offset);
    }
  }
}

static void ring_restore_grads(ddp_zero *z) {
  float *flat = ddp_model_grads_flat(z->model);
  for (int i = 0; i < z->n_params; i++)
    ddp_model_param(z->model, i)->grad = flat + ddp_model_param_offset(z->model, i);
}

/* Waits for bucket b's reduces and adds this rank's part, divided as the
 * wrapper's float32 hook divides (g / d, rounded once), into its range of
 * the flat buffer: assigned after a zero_grad, which is what plain data
 * parallelism's buffer then holds bit for bit. */
static ddp_status ring_retire(ddp_zero *z, int b) {
  if (z->retired[b]) return DDP_OK;
  z->retired[b] = true;
  ddp_status first = DDP_OK;
  ddp_work **w = z->pending + (size_t)b * (size_t)z->world;
  for (int k = 0; k < z->n_pending[b]; k++) {
    ddp_status s = ddp_work_wait(w[k], -1);
    if (s != DDP_OK && first == DDP_OK) first = s;
    ddp_work_free(w[k]);
    w[k] = NULL;
  }
  z->n_pending[b] = 0;
  if (first != DDP_OK)
    return ddp_error_wrap(first, "zero stage 2 (rank %d): reducing bucket %d", z->rank, b);
  const ddp_dp_bucket *bucket = &z->dp->buckets[b];
  int64_t from = bucket->offset, to = bucket->offset + (int64_t)bucket->numel;
  if (from < z->lo[z->rank]) from = z->lo[z->rank];
  if (to > z->lo[z->rank + 1]) to = z->lo[z->rank + 1];
  if (from >= to) return DDP_OK;
  float *restrict g = ddp_model_grads_flat(z->model) + from;
  const float *restrict src = ring_slot(z, b) + (from - bucket->offset);
  const size_t n = (size_t)(to - from);
  const float d = (float)z->ring_div[b];
  if (z->owned_fresh) {
    if (d == 1.0f) memcpy(g, src, n * sizeof(float));
    else for (size_t i = 0; i < n; i++) g[i] = src[i] / d;
  } else {
    if (d == 1.0f) for (size_t i = 0; i < n; i++) g[i] += src[i];
    else for (size_t i = 0; i < n; i++) g[i] += src[i] / d;
  }
  return DDP_OK;
}

/* Bucket m's slot made ready for its gradients: bucket m - RING_SLOTS's
 * reduce retired, the slot zeroed (backward accumulates into it). */
static ddp_status ring_claim(ddp_zero *z, int m) {
  if (m >= RING_SLOTS) {
    const int prev = m - RING_SLOTS;
    if (prev >= z->dp->next_launch)
      return ddp_error(DDP_ERR_STATE, "zero stage 2 (rank %d): bucket %d's slot is needed before "
                       "bucket %d has launched (the plan of this backward was wrong)", z->rank, m, prev);
    DDP_TRY(ring_retire(z, prev));
  }
  memset(ring_slot(z, m), 0, z->dp->buckets[m].numel * sizeof(float));
  return DDP_OK;
}

/* The tape's grad hook under the ring: the wrapper's (which may launch
 * buckets), then the slots the plan clears at this hook call. */
static void ring_grad_ready(ddp_tensor *param, void *user) {
  ddp_zero *z = user;
  ddp__dp_grad_ready(param, z->dp);
  if (!own_param(z, param)) return;
  const int e = z->ring_ev++;
  while (z->next_claim < z->dp->n_buckets && z->claim_at[z->next_claim] <= e) {
    if (z->ring_error == DDP_OK) z->ring_error = ring_claim(z, z->next_claim);
    z->next_claim++;
  }
}

/* Gives back the whole pages of the gradient buffer outside this rank's
 * range: nothing writes there once the ring is in use. */
static void release_grad_pages(ddp_zero *z) {
  long pg = sysconf(_SC_PAGESIZE);
  const uintptr_t page = (uintptr_t)(pg > 0 ? pg : 4096);
  float *g = ddp_model_grads_flat(z->model);
  const int64_t cut[2][2] = {{0, z->lo[z->rank]}, {z->lo[z->rank + 1], z->n}};
  for (int k = 0; k < 2; k++) {
    uintptr_t start = (uintptr_t)(g + cut[k][0]), end = (uintptr_t)(g + cut[k][1]);
    start = (start + page - 1) / page * page;
    end = end / page * page;
    if (end > start) (void)madvise((void *)start, end - start, MADV_DONTNEED);
  }
}

/* Once the relayout is decided and no unreduced gradient is in the flat
 * buffer: the ring, if this backward's plan fits it (else never). */
static ddp_status ring_try_enable(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  const ddp_dp *dp = z->dp;
  if (z->ring_on || z->ring_off || z->ring_mode == RING_NEVER || z->stage != 2 || z->world < 2 || !z->dp->relayout_done ||
      !z->relayout_seen || z->flat_dirty)
    return DDP_OK;
  if (dp->options.find_unused_parameters || dp->options.static_graph) {
    /* Parameters marked ready without a gradient: the plan cannot see them. */
    z->ring_off = true;
    return DDP_OK;
  }
  ddp_status s = ring_plan(z, tape, loss);
  if (s != DDP_OK) {
    DDP_INFO("zero stage 2 (rank %d): the whole gradient buffer is kept: %s", z->rank,
             ddp_last_error());
    z->ring_off = true;
    return DDP_OK;
  }
  int64_t largest = 0;
  for (int b = 0; b < dp->n_buckets; b++)
    if ((int64_t)dp->buckets[b].numel > largest) largest = (int64_t)dp->buckets[b].numel;
  const int slots = dp->n_buckets < RING_SLOTS ? dp->n_buckets : RING_SLOTS;
  /* Only where it holds less than the whole buffer: a model of one or two
   * buckets (the default 25 MiB cap, 1 MiB first) keeps the buffer. */
  if (z->ring_mode == RING_AUTO && z->lo[z->rank + 1] - z->lo[z->rank] + slots * largest >= z->n) {
    z->ring_off = true;
    return DDP_OK;
  }
  z->slot_floats = largest;
  z->ring_floats = slots * largest;
  z->ring = ddp_alloc((size_t)z->ring_floats * sizeof(float));
  if (!z->ring)
    return ddp_error(DDP_ERR_NOMEM, "zero stage 2 (rank %d): cannot allocate the gradient ring "
                     "of %d x %lld floats", z->rank, slots, (long long)largest);
  /* Every bucket's reduces in flight at once at most (the wrapper's own
   * handles are not used under the ring). */
  DDP_TRY(ddp_process_group_reserve_works(z->pg, dp->n_buckets * z->world + z->world + 2));
  z->ring_on = true;
  ddp_dp_set_no_sync(z->dp, false);
  release_grad_pages(z);
  return DDP_OK;
}

/* ddp_dp_backward with the ring: the wrapper's bookkeeping and launches,
 * the gradients in the ring's slots, the reduced parts added into the
 * range. */
static ddp_status ring_backward(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  ddp_dp *dp = z->dp;
  DDP_TRY(ring_plan(z, tape, loss));
  DDP_TRY(ddp_dp_prepare_backward(dp, tape));
  for (int b = 0; b < dp->n_buckets; b++) z->retired[b] = true; /* nothing launched yet */
  ring_point_grads(z);
  z->ring_error = DDP_OK;
  for (int m = 0; m < RING_SLOTS && m < dp->n_buckets; m++) (void)ring_claim(z, m);
  z->next_claim = RING_SLOTS;
  z->ring_ev = 0;
  ddp_tape_set_grad_hook(tape, ring_grad_ready, z);
  z->in_ring_backward = true;
  dp->backward_start_ns = ddp_time_ns();
  ddp_status s = dp->loss_scale == 1.0f || loss->numel != 1 || loss->dtype != DDP_FLOAT32
                     ? ddp_backward(tape, loss)
                     : ddp__backward_from(tape, loss, &dp->loss_scale);
  dp->backward_end_ns = ddp_time_ns();
  z->in_ring_backward = false;
  if (s == DDP_OK) s = z->ring_error;
  for (int b = 0; b < dp->next_launch; b++) {
    ddp_status r = ring_retire(z, b);
    if (s == DDP_OK) s = r;
  }
  ring_restore_grads(z);
  if (s != DDP_OK) return ddp__dp_abandon_backward(dp, tape, s); /* every launched bucket retired */
  z->owned_fresh = false;
  return ddp_dp_finalize_backward(dp);
}

ddp_status ddp_zero_zero_grad(ddp_zero *z) {
  z->owned_fresh = true;
  if (!z->ring_on) {
    ddp_model_zero_grad(z->model);
    z->flat_dirty = false;
    return DDP_OK;
  }
  memset(ddp_model_grads_flat(z->model) + z->lo[z->rank], 0,
         (size_t)(z->lo[z->rank + 1] - z->lo[z->rank]) * sizeof(float));
  return DDP_OK;
}

/* ---- One iteration --------------------------------------------------------- */

ddp_status ddp_zero_sync_params(ddp_zero *z) {
  if (z->stage == 3) {
    /* The whole model, for whoever reads it (FSDP's summon_full_params);
     * the next forward gives the rest back. */
    if (z->whole && !z->params_stale) return DDP_OK;
    DDP_TRY(ddp__zero_gather_drain(z->pf)); /* none in flight between steps; to be sure */
    DDP_TRY(gather_region(z, 0, z->n));
    for (int k = 0; k < z->n_units; k++) z->gathered[k] = true;
    z->whole = true;
    z->params_stale = false;
    return DDP_OK;
  }
  if (!z->params_stale) return DDP_OK;
  float *p = ddp_model_params_flat(z->model);
  for (int r = 0; r < z->world; r++) {
    ddp_status s = ddp_broadcast(z->pg, p + z->lo[r], (size_t)(z->lo[r + 1] - z->lo[r]),
                                 DDP_FLOAT32, r);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "zero (rank %d): gathering the parameters of rank %d's range", z->rank, r);
  }
  z->params_stale = false;
  return DDP_OK;
}

ddp_status ddp_zero_forward(ddp_zero *z, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  if (z->stage != 3) {
    DDP_TRY(ddp_zero_sync_params(z));
    return ddp_dp_forward(z->dp, tape, x, out);
  }
  /* Updated ranges, or the whole model summoned: every unit is gathered
   * afresh by the forward hook. The last forward's order is the one this
   * forward prefetches by. */
  if (z->params_stale || z->whole) release_all(z);
  /* A unit still held by a forward that had no backward goes too: with it
   * and a prefetch, three would be held. */
  for (int k = 0; k < z->n_units; k++)
    if (z->gathered[k]) release_unit(z, k);
  z->params_stale = false;
  ddp__zero_prefetch_new_forward(z->pf, z->fwd_seq, z->n_seq);
  for (int k = 0; k < z->n_units; k++) z->fwd_pos[k] = -1;
  z->n_seq = 0;
  z->fwd_held = -1;
  z->in_forward = true;
  ddp_status s = ddp_dp_forward(z->dp, tape, x, out);
  z->in_forward = false;
  if (s != DDP_OK) {
    release_all(z); /* nothing left in flight; the next forward gathers afresh */
    return s;
  }
  /* A prefetch the forward did not use (its order changed): given back,
   * so that only the last unit is held for backward. */
  for (int k = 0; k < z->n_units; k++)
    if (k != z->fwd_held && z->gathered[k]) release_unit(z, k);
  return DDP_OK;
}

/* ddp_dp_backward with the stage-3 grad hook in the wrapper's place. */
static ddp_status stage3_backward(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  ddp_dp *dp = z->dp;
  DDP_TRY(ddp_dp_prepare_backward(dp, tape));
  for (int k = 0; k < z->n_units; k++) z->unit_pending[k] = z->unit_params[k];
  /* The last unit of the forward is held; its backward comes first, and
   * the unit before it is prefetched meanwhile. */
  z->backward_error = z->n_seq > 0 ? backward_prefetch(z, z->n_seq - 1) : DDP_OK;
  ddp_tape_set_grad_hook(tape, stage3_grad_ready, z);
  dp->backward_start_ns = ddp_time_ns();
  ddp_status s = z->backward_error == DDP_OK ? ddp_backward(tape, loss) : z->backward_error;
  dp->backward_end_ns = ddp_time_ns();
  if (s == DDP_OK) s = z->backward_error;
  if (s != DDP_OK) {
    /* Leave nothing in flight on the gradient or the parameter buffer. */
    release_all(z);
    return ddp__dp_abandon_backward(dp, tape, s);
  }
  return ddp_dp_finalize_backward(dp);
}

ddp_status ddp_zero_backward(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss) {
  if (z->stage == 2) DDP_TRY(ring_try_enable(z, tape, loss));
  if (z->ring_on) {
    DDP_TRY(ring_backward(z, tape, loss));
    if (z->user_no_sync) return DDP_OK;
    z->params_stale = true;
    return DDP_OK;
  }
  bool syncing = !z->dp->no_sync;
  DDP_TRY(z->stage == 3 ? stage3_backward(z, tape, loss) : ddp_dp_backward(z->dp, tape, loss));
  z->flat_dirty = !syncing;
  if (!syncing) return DDP_OK;
  z->params_stale = true;
  return follow_relayout(z);
}

ddp_status ddp_zero_clip_grad_norm(ddp_zero *z, double max_norm, double *total_norm) {
  if (!(max_norm >= 0) || isinf(max_norm))
    return ddp_error(DDP_ERR_INVALID, "zero: clip_grad_norm: max_norm %g must be finite and >= 0",
                     max_norm);
  float *g = ddp_model_grads_flat(z->model) + z->lo[z->rank];
  const int64_t n = z->lo[z->rank + 1] - z->lo[z->rank];
  double sum = 0;
  for (int64_t i = 0; i < n; i++) sum += (double)g[i] * (double)g[i];
  DDP_TRY(ddp_allreduce(z->pg, &sum, 1, DDP_FLOAT64, DDP_REDUCE_SUM));
  double norm = sqrt(sum);
  if (total_norm) *total_norm = norm;
  if (!isfinite(norm))
    return ddp_error(DDP_ERR_RANGE, "zero: clip_grad_norm: the total gradient norm is %g; "
                     "gradients left as they are", norm);
  const float c = ddp_clip_coefficient(norm, max_norm);
  if (c < 1.0f) {
    for (int64_t i = 0; i < n; i++) g[i] *= c;
  }
  return DDP_OK;
}

ddp_status ddp_zero_step(ddp_zero *z) {
  DDP_TRY(ddp_optimizer_step(z->opt));
  z->params_stale = true;
  /* Stage 3 gathers per unit in the next forward. */
  return z->stage == 3 ? DDP_OK : ddp_zero_sync_params(z);
}

/* ---- State for checkpoints ---------------------------------------------------- */

#define ZERO_STATE_TAG 0x2e50

ddp_status ddp_zero_gather_state(ddp_zero *z, ddp_optimizer *full, int root) {
  if (root < 0 || root >= z->world)
    return ddp_error(DDP_ERR_INVALID, "zero: gather_state: root %d outside the %d ranks", root, z->world);
  if (z->rank == root && (!full || ddp_optimizer_numel(full) != (size_t)z->n ||
                          ddp_optimizer_state_count(full) != ddp_optimizer_state_count(z->opt)))
    return ddp_error(DDP_ERR_INVALID, "zero: gather_state: root's optimizer must be of the same "
                     "options over the model's %lld floats", (long long)z->n);
  /* Whether there is state is the same on every rank (steps and loads are). */
  if (!ddp_optimizer_has_state(z->opt)) {
    if (z->rank == root) DDP_TRY(ddp_optimizer_set_lr(full, ddp_optimizer_get_lr(z->opt)));
    return DDP_OK;
  }
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt); k++) {
    ddp_optim_state mine, whole = {0};
    DDP_TRY(ddp_optimizer_state_get(z->opt, k, &mine));
    if (z->rank == root) DDP_TRY(ddp_optimizer_state_get(full, k, &whole));
    if (mine.is_scalar) {
      if (z->rank == root) DDP_TRY(ddp_optimizer_state_load(full, mine.name, mine.data, 1));
      continue;
    }
    if (z->rank != root) {
      ddp_status s = ddp_send(z->pg, mine.data, mine.numel, DDP_FLOAT32, root, ZERO_STATE_TAG);
      if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): sending state '%s' to rank %d", z->rank, mine.name, root);
      continue;
    }
    for (int r = 0; r < z->world; r++) {
      float *at = whole.data + z->lo[r];
      size_t len = (size_t)(z->lo[r + 1] - z->lo[r]);
      if (r == root) {
        memcpy(at, mine.data, len * sizeof(float));
        continue;
      }
      ddp_status s = ddp_recv(z->pg, at, len, DDP_FLOAT32, r, ZERO_STATE_TAG);
      if (s != DDP_OK) return ddp_error_wrap(s, "zero (rank %d): receiving state '%s' from rank %d", z->rank, mine.name, r);
    }
    /* Marks the state present (the data is already in place). */
    DDP_TRY(ddp_optimizer_state_load(full, whole.name, whole.data, whole.numel));
  }
  if (z->rank == root) DDP_TRY(ddp_optimizer_set_lr(full, ddp_optimizer_get_lr(z->opt)));
  return DDP_OK;
}

ddp_status ddp_zero_load_state(ddp_zero *z, ddp_optimizer *full) {
  if (!full || ddp_optimizer_numel(full) != (size_t)z->n ||
      ddp_optimizer_state_count(full) != ddp_optimizer_state_count(z->opt))
    return ddp_error(DDP_ERR_INVALID, "zero: load_state: the optimizer must be of the same "
                     "options over the model's %lld floats", (long long)z->n);
  DDP_TRY(ddp_optimizer_set_lr(z->opt, ddp_optimizer_get_lr(full)));
  if (!ddp_optimizer_has_state(full)) return DDP_OK;
  const int64_t own = z->lo[z->rank], own_n = z->lo[z->rank + 1] - own;
  for (size_t k = 0; k < ddp_optimizer_state_count(full); k++) {
    ddp_optim_state st;
    DDP_TRY(ddp_optimizer_state_get(full, k, &st));
    DDP_TRY(ddp_optimizer_state_load(z->opt, st.name, st.is_scalar ? st.data : st.data + own,
                                     st.is_scalar ? 1 : (size_t)own_n));
  }
  return DDP_OK;
}

/* ---- Stage 3's prefetch, observed ---------------------------------------------- */

int ddp_zero_events(const ddp_zero *z, ddp_zero_event *out, int cap) {
  return z->pf ? ddp__zero_prefetch_events(z->pf, out, cap) : 0;
}

void ddp_zero_get_prefetch_stats(const ddp_zero *z, ddp_zero_prefetch_stats *out) {
  if (z->pf) ddp__zero_prefetch_stats(z->pf, out);
  else memset(out, 0, sizeof *out);
}

/* ---- Memory ------------------------------------------------------------------ */

void ddp_zero_get_memory(const ddp_zero *z, ddp_zero_memory *out) {
  memset(out, 0, sizeof *out);
  const int64_t f = (int64_t)sizeof(float), own_n = z->lo[z->rank + 1] - z->lo[z->rank];
  /* Stage 3: the range and the largest unit gathered (pages shared at a
   * unit's edges aside). */
  out->param_bytes = z->n * f;
  if (z->stage == 3) {
    /* The range and, at most, two units (the current one and the one
     * prefetched; one without prefetch): the range plus the two largest
     * parts of units outside it, a bound. */
    const int64_t own_a = z->lo[z->rank], own_b = z->lo[z->rank + 1];
    int64_t first = 0, second = 0;
    for (int k = 0; k < z->n_units; k++) {
      const int64_t a = z->unit_lo[k] > own_a ? z->unit_lo[k] : own_a;
      const int64_t b = z->unit_hi[k] < own_b ? z->unit_hi[k] : own_b;
      const int64_t outside = (z->unit_hi[k] - z->unit_lo[k]) - (b > a ? b - a : 0);
      if (outside > first) {
        second = first;
        first = outside;
      } else if (outside > second) {
        second = outside;
      }
    }
    out->param_bytes = (own_n + first + (z->prefetch ? second : 0)) * f;
  }
  out->grad_bytes = z->ring_on ? (own_n + z->ring_floats) * f : z->n * f;
  out->grad_ring_bytes = z->ring_on ? z->ring_floats * f : 0;
  out->grad_owned_bytes = (z->stage >= 2 ? own_n : z->n) * f;
  int64_t buffers = 0;
  for (size_t k = 0; k < ddp_optimizer_state_count(z->opt); k++) {
    ddp_optim_state st;
    if (ddp_optimizer_state_get(z->opt, k, &st) == DDP_OK && !st.is_scalar) {
      out->optim_state_bytes += (int64_t)st.numel * f;
      buffers++;
    }
  }
  out->optim_state_unsharded_bytes = buffers * z->n * f;
}
