/* Autocast regions (a per-thread stack of precisions), the marks on tensors
 * holding low-precision values, and the cast cache of rounded parameters
 * (docs/tensor.md, "Mixed precision"; the ops' rules are in the ops). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/autocast.h"
#include "tensor/device_internal.h"
#include "tensor/kernels.h"
#include "tensor/tape.h"

/* ---- regions ---- */

static _Thread_local struct {
  int depth;
  ddp_precision stack[DDP_AUTOCAST_MAX_DEPTH];
} region;

ddp_status ddp_autocast_enter(ddp_precision precision) {
  if ((unsigned)precision >= DDP_PRECISION_COUNT)
    return ddp_error(DDP_ERR_INVALID, "autocast_enter: precision %d is not a ddp_precision",
                     (int)precision);
  if (region.depth >= DDP_AUTOCAST_MAX_DEPTH)
    return ddp_error(DDP_ERR_STATE,
                     "autocast_enter: %d regions are open on this thread already (the most); "
                     "is an autocast_exit missing?",
                     region.depth);
  region.stack[region.depth++] = precision;
  return DDP_OK;
}

ddp_precision ddp_autocast_precision(void) {
  return region.depth ? region.stack[region.depth - 1] : DDP_PRECISION_FP32;
}

int ddp_autocast_depth(void) { return region.depth; }

/* ---- the cast cache ---- */

typedef struct cache_entry {
  const ddp_tensor *tensor; /* the key: a leaf parameter... */
  const void *data;         /* ...with this data... */
  int64_t numel;            /* ...and size... */
  ddp_dtype low;            /* ...rounded to this */
  int form;                 /* ...in this form (FORM_*) */
  bool valid;               /* buf holds the copy for this region */
  ddp_device device;        /* where buf lives: t's device (a GPU's cache) */
  float *buf;
  size_t capacity; /* bytes */
} cache_entry;

typedef struct cast_cache {
  cache_entry *entries;
  int count, capacity;
  ddp__autocast_cache_stats stats;
} cast_cache;

static _Thread_local cast_cache *thread_cache;
static pthread_key_t cache_key;
static pthread_once_t cache_key_once = PTHREAD_ONCE_INIT;

/* An entry's copy: host memory for a CPU tensor, the device's caching
 * allocator for a GPU tensor's (ddp__device_calloc). */
static void entry_free(cache_entry *e) {
  if (e->device.type == DDP_DEVICE_CPU) ddp_free(e->buf);
  else ddp__device_free(e->device, e->buf);
  e->buf = NULL;
  e->capacity = 0;
}

static void cache_destroy(void *p) {
  cast_cache *c = p;
  if (!c) return;
  for (int i = 0; i < c->count; i++) entry_free(&c->entries[i]);
  ddp_free(c->entries);
  ddp_free(c);
}

static void make_cache_key(void) { (void)pthread_key_create(&cache_key, cache_destroy); }

static cast_cache *cache_get(void) {
  if (thread_cache) return thread_cache;
  cast_cache *c = ddp_calloc(1, sizeof *c);
  if (!c) return NULL;
  (void)pthread_once(&cache_key_once, make_cache_key);
  (void)pthread_setspecific(cache_key, c); /* freed at thread exit */
  thread_cache = c;
  return c;
}

void ddp_autocast_cache_clear(void) {
  cast_cache *c = thread_cache;
  if (!c) return;
  for (int i = 0; i < c->count; i++) c->entries[i].valid = false;
}

void ddp_autocast_cache_free(void) {
  cast_cache *c = thread_cache;
  if (!c) return;
  (void)pthread_setspecific(cache_key, NULL);
  thread_cache = NULL;
  cache_destroy(c);
}

ddp__autocast_cache_stats ddp__autocast_cache_counters(void) {
  return thread_cache ? thread_cache->stats : (ddp__autocast_cache_stats){0};
}

ddp_status ddp_autocast_exit(void) {
  if (region.depth == 0)
    return ddp_error(DDP_ERR_STATE, "autocast_exit: no autocast region is open on this thread");
  if (--region.depth == 0) ddp_autocast_cache_clear();
  return DDP_OK;
}

/* What a cache entry holds for its tensor. */
enum { FORM_ROUNDED = 0,  /* float32 of the low dtype's values, t's shape */
       FORM_PACKED = 1,   /* op(t) packed for the bf16 GEMM (ddp__dense_kernels) */
       FORM_PACKED_T = 2,
       FORM_HALF = 3 };   /* the 16-bit values themselves (a GPU's GEMM operand) */

/* t's entry of `form`, with room for `bytes`; *fill true when the caller
 * must (re)make its contents (and then set valid), false on a hit. */
static cache_entry *cache_entry_for(ddp_tensor *t, ddp_dtype low, int form, size_t bytes,
                                    bool *fill, ddp_status *status) {
  cast_cache *c = cache_get();
  if (!c) goto nomem;
  cache_entry *e = NULL;
  for (int i = 0; i < c->count && !e; i++)
    if (c->entries[i].tensor == t && c->entries[i].form == form) e = &c->entries[i];
  if (e && e->valid && e->data == t->data && e->numel == t->numel && e->low == low) {
    c->stats.hits++;
    *fill = false;
    return e;
  }
  if (!e) {
    if (c->count == c->capacity) {
      const int cap = c->capacity ? 2 * c->capacity : 16;
      cache_entry *grown = ddp_realloc(c->entries, (size_t)c->capacity * sizeof *grown,
                                        (size_t)cap * sizeof *grown);
      if (!grown) goto nomem;
      c->entries = grown;
      c->capacity = cap;
    }
    e = &c->entries[c->count++];
    *e = (cache_entry){.tensor = t, .form = form, .device = t->device};
  }
  e->valid = false;
  if (e->capacity < bytes || !ddp_device_equal(e->device, t->device)) {
    /* the old contents are not needed: the caller makes them again */
    entry_free(e);
    e->device = t->device;
    if (e->device.type == DDP_DEVICE_CPU) {
      e->buf = ddp_alloc(bytes);
    } else {
      void *p = NULL;
      if (ddp__device_calloc(e->device, bytes, &p) != DDP_OK) p = NULL;
      e->buf = p;
    }
    e->capacity = e->buf ? bytes : 0;
    if (!e->buf) goto nomem;
    c->stats.allocations++;
  }
  e->data = t->data;
  e->numel = t->numel;
  e->low = low;
  c->stats.fills++;
  *fill = true;
  return e;
nomem:
  *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate the cast cache's copy of a "
                      "parameter of %lld elements", (long long)t->numel);
  return NULL;
}

/* dst = src (n floats on `device`) rounded to `low`, by the device's kernel. */
static void round_on(ddp_device device, float *dst, const float *src, int64_t n, ddp_dtype low) {
  ddp__basic_kernels_for(device)->round_low(dst, src, n, low == DDP_BFLOAT16);
}

/* The cached rounded copy of t, made now if the region has none. */
static const float *cache_lookup(ddp_tensor *t, ddp_dtype low, ddp_status *status) {
  bool fill;
  cache_entry *e =
      cache_entry_for(t, low, FORM_ROUNDED, (size_t)t->numel * sizeof(float), &fill, status);
  if (!e) return NULL;
  if (fill) round_on(t->device, e->buf, t->data, t->numel, low);
  e->valid = true;
  return e->buf;
}

static bool cacheable(const ddp_tensor *t) {
  return t->node < 0 && (t->flags & DDP_TENSOR_REQUIRES_GRAD) && ddp_autocast_depth() > 0;
}

const uint16_t *ddp__autocast_packed(ddp_tape *tape, ddp_tensor *t, bool trans, int64_t k,
                                     int64_t n, bool cache, ddp_status *status) {
  const ddp__dense_kernels *dk = ddp__kernels_for(t->device)->dense;
  const size_t bytes = dk->bf16_pack_bytes(k, n);
  const int64_t ld = trans ? k : n;
  if (cache && cacheable(t)) {
    bool fill;
    cache_entry *e = cache_entry_for(t, DDP_BFLOAT16, trans ? FORM_PACKED_T : FORM_PACKED,
                                     bytes, &fill, status);
    if (!e) return NULL;
    if (fill) dk->bf16_pack_b((uint16_t *)e->buf, trans, k, n, t->data, ld);
    e->valid = true;
    return (const uint16_t *)e->buf;
  }
  uint16_t *packed = ddp_tape_scratch(tape, bytes);
  if (!packed) {
    *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate a packed copy of %lld "
                        "elements", (long long)t->numel);
    return NULL;
  }
  dk->bf16_pack_b(packed, trans, k, n, t->data, ld);
  return packed;
}

/* ---- the ops' helpers ---- */

ddp_dtype ddp__autocast_op_dtype(const ddp_tensor *x) {
  if (!x) return DDP_FLOAT32;
  switch (ddp_autocast_precision()) {
  case DDP_PRECISION_BF16: return DDP_BFLOAT16;
  case DDP_PRECISION_FP16: return DDP_FLOAT16;
  default: return DDP_FLOAT32;
  }
}

ddp_dtype ddp__autocast_promote(int n, ddp_tensor *const *inputs) {
  ddp_dtype low = DDP_FLOAT32;
  bool first = true;
  for (int i = 0; i < n; i++) {
    if (!inputs[i]) continue;
    const ddp_dtype d = ddp__low_dtype(inputs[i]);
    if (first) low = d;
    else if (d != low) return DDP_FLOAT32; /* bf16 with fp32 (or fp16) promotes to fp32 */
    first = false;
  }
  return low;
}

void ddp__autocast_mark(ddp_tensor *y, ddp_dtype low, bool round) {
  if (low == DDP_FLOAT32) return;
  if (round) round_on(y->device, y->data, y->data, y->numel, low);
  y->flags |= low == DDP_BFLOAT16 ? DDP__TENSOR_BF16_VALUES : DDP__TENSOR_F16_VALUES;
}

void ddp__tape_mark_like(ddp_tensor *y, const ddp_tensor *x) {
  ddp__autocast_mark(y, ddp__low_dtype(x), false);
}

const float *ddp__autocast_operand(ddp_tape *tape, ddp_tensor *t, ddp_dtype low, bool cache,
                                   ddp_status *status) {
  if (!t) return NULL;
  if (low == DDP_FLOAT32 || ddp__low_dtype(t) == low) return t->data;
  if (cache && cacheable(t)) return cache_lookup(t, low, status);
  float *copy = ddp__tape_scratch_on(tape, t->device, (size_t)t->numel * sizeof(float));
  if (!copy) {
    *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate a rounded copy of %lld "
                        "elements", (long long)t->numel);
    return NULL;
  }
  round_on(t->device, copy, t->data, t->numel, low);
  return copy;
}

const uint16_t *ddp__autocast_half(ddp_tape *tape, ddp_tensor *t, const float *data,
                                   ddp_dtype low, bool cache, ddp_status *status) {
  if (!t) return NULL;
  const ddp__basic_kernels *k = ddp__basic_kernels_for(t->device);
  const size_t bytes = (size_t)t->numel * sizeof(uint16_t);
  const bool bf16 = low == DDP_BFLOAT16;
  if (!data && cache && cacheable(t)) {
    bool fill;
    cache_entry *e = cache_entry_for(t, low, FORM_HALF, bytes ? bytes : 1, &fill, status);
    if (!e) return NULL;
    if (fill) k->to_half((uint16_t *)e->buf, t->data, 1.0f, t->numel, bf16);
    e->valid = true;
    return (const uint16_t *)e->buf;
  }
  uint16_t *half = ddp__tape_scratch_on(tape, t->device, bytes ? bytes : 1);
  if (!half) {
    *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate a 16-bit copy of %lld "
                        "elements", (long long)t->numel);
    return NULL;
  }
  k->to_half(half, data ? data : t->data, 1.0f, t->numel, bf16);
  return half;
}

ddp_dtype ddp_tensor_values_dtype(const ddp_tensor *t) {
  const ddp_dtype low = ddp__low_dtype(t);
  return low != DDP_FLOAT32 ? low : t ? t->dtype : DDP_FLOAT32;
}

/* ---- backward helpers ---- */

const float *ddp__autocast_round_grad(ddp_tape *tape, const ddp_tensor *out, ddp_dtype low,
                                      ddp_status *status) {
  float *dy = ddp__tape_scratch_on(tape, out->device, (size_t)out->numel * sizeof(float));
  if (!dy) {
    *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate a rounded gradient of %lld "
                        "elements", (long long)out->numel);
    return NULL;
  }
  round_on(out->device, dy, out->grad, out->numel, low);
  return dy;
}

float *ddp__autocast_grad_scratch(ddp_tape *tape, const ddp_tensor *t, bool zero,
                                  ddp_status *status) {
  if (!t || !(t->flags & DDP_TENSOR_REQUIRES_GRAD)) return NULL;
  float *g = ddp__tape_scratch_on(tape, t->device, (size_t)t->numel * sizeof(float));
  if (!g) {
    *status = ddp_error(DDP_ERR_NOMEM, "autocast: cannot allocate a gradient of %lld elements",
                        (long long)t->numel);
    return NULL;
  }
  if (zero) ddp__basic_kernels_for(t->device)->fill(g, 0.0f, t->numel);
  return g;
}

ddp_status ddp__autocast_grad_deliver(ddp_tape *tape, ddp_tensor *t, float *grad,
                                      ddp_dtype low) {
  if (!grad) return DDP_OK;
  round_on(t->device, grad, grad, t->numel, low);
  ddp_status s = DDP_OK;
  bool accumulate;
  float *dst = ddp__tape_grad_out(tape, t, &accumulate, &s);
  if (s != DDP_OK || !dst) return s;
  const ddp__basic_kernels *k = ddp__basic_kernels_for(t->device);
  if (accumulate)
    k->axpy(dst, 1.0f, grad, t->numel);
  else
    k->copy(dst, grad, t->numel);
  return DDP_OK;
}

const char *ddp__autocast_kernels(void) {
  const ddp__dense_kernels *dk = ddp__kernels_for(DDP_CPU)->dense;
  if (!dk->has_bf16_dot())
    return "bf16 and fp16: operands rounded (vectorised conversion), float32 kernels with "
           "float32 accumulation";
  /* DDP_CONV_BF16=0 keeps conv2d on the float32 kernels (cpu/conv.c) */
  const char *conv = getenv("DDP_CONV_BF16");
  return conv && strcmp(conv, "0") == 0
             ? "bf16 linear: AVX512_BF16 dot products (vdpbf16ps), float32 accumulation; bf16 "
               "conv2d (DDP_CONV_BF16=0) and matmul, fp16: operands rounded, float32 kernels"
             : "bf16 linear, and conv2d's direct stride-1 kernels for rows up to 32 wide "
               "(forward, dX, dW; docs/tensor.md): AVX512_BF16 dot products (vdpbf16ps), "
               "float32 accumulation; other bf16 conv2d, matmul, fp16: operands rounded, "
               "float32 kernels";
}
