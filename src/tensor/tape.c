/* The autograd tape: a list of recorded ops walked in reverse by backward, and
 * the arena that holds one step's tensors. Node and leaf lists are heap arrays
 * that only grow, so after the first step nothing here allocates.
 *
 * A leaf's count of pending uses lives in the tape (a table keyed by the
 * leaf), not in the tensor: one leaf (a parameter server's weight) may be
 * recorded on several tapes at once, on different threads, and a tape writes
 * nothing that another tape shares while it records, runs backward or
 * resets. An intermediate belongs to the tape that made it and keeps its
 * count in ddp_tensor.pending. */
#include <math.h>
#include <string.h>

#include "tensor/kernels.h"
#include "tensor/tape.h"
#include "tensor/autocast.h"
#ifdef DDP_HAVE_CUDA
#include "tensor/cuda/runtime.h"
#endif

/* GPUs a tape can hold memory on (cuda:0 .. cuda:7). */
#define TAPE_DEVICES 8

/* A leaf requiring grad that this tape's ops use. */
typedef struct {
  ddp_tensor *t;
  int32_t pending; /* recorded uses whose backward has not run */
  uint32_t slot;   /* its entry in leaf_index, cleared on reset */
} tape_leaf;

struct ddp_tape {
  ddp_arena arena;                       /* the host's */
  ddp_arena device_arena[TAPE_DEVICES];  /* cuda:i's, when device_used[i] */
  bool device_used[TAPE_DEVICES];
  ddp__node *nodes;
  int n_nodes, cap_nodes;
  tape_leaf *leaves; /* in order of first use; node->leaf[] indexes it */
  int n_leaves, cap_leaves;
  int32_t *leaf_index; /* open addressing, leaf pointer -> index in leaves; -1 empty */
  uint32_t index_cap;  /* a power of two, at least twice cap_leaves (0: none yet) */
  bool grad_enabled;
  bool backward_done; /* a second backward would double-count intermediates */
  ddp_grad_hook_fn hook;
  void *hook_user;
};

ddp_status ddp_tape_create(ddp_tape **out, size_t arena_bytes) {
  ddp_tape *t = ddp_calloc(1, sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "tape: out of memory");
  ddp_arena_init(&t->arena, arena_bytes);
  t->grad_enabled = true;
  *out = t;
  return DDP_OK;
}

/* Resets (or frees) each device arena with its device current: their
 * backing allocates and frees on the current device. */
static void device_arenas_reset(ddp_tape *tape, bool free_them) {
#ifdef DDP_HAVE_CUDA
  for (int i = 0; i < TAPE_DEVICES; i++) {
    if (!tape->device_used[i] || ddp__cuda_set_device(i) != DDP_OK) continue;
    if (free_them) {
      ddp_arena_free(&tape->device_arena[i]);
      tape->device_used[i] = false;
    } else {
      ddp_arena_reset(&tape->device_arena[i]);
    }
  }
#else
  (void)tape, (void)free_them;
#endif
}

void ddp_tape_destroy(ddp_tape *tape) {
  if (!tape) return;
  ddp_tape_reset(tape);
  device_arenas_reset(tape, true);
  ddp_arena_free(&tape->arena);
  ddp_free(tape->nodes);
  ddp_free(tape->leaves);
  ddp_free(tape->leaf_index);
  ddp_free(tape);
}

void ddp_tape_reset(ddp_tape *tape) {
  /* Only the entries this step used: the table itself is sized once. */
  for (int i = 0; i < tape->n_leaves; i++) tape->leaf_index[tape->leaves[i].slot] = -1;
  tape->n_leaves = 0;
  tape->n_nodes = 0;
  tape->backward_done = false;
  ddp_arena_reset(&tape->arena);
  device_arenas_reset(tape, false);
}

void ddp_tape_set_grad_enabled(ddp_tape *tape, bool enabled) { tape->grad_enabled = enabled; }
bool ddp_tape_grad_enabled(const ddp_tape *tape) { return tape->grad_enabled; }

void ddp_tape_set_grad_hook(ddp_tape *tape, ddp_grad_hook_fn fn, void *user) {
  tape->hook = fn;
  tape->hook_user = user;
}

int ddp_tape_num_nodes(const ddp_tape *tape) { return tape->n_nodes; }

ddp_arena *ddp__tape_arena(ddp_tape *tape) { return &tape->arena; }

ddp_arena *ddp__tape_arena_on(ddp_tape *tape, ddp_device device) {
  if (device.type == DDP_DEVICE_CPU) return &tape->arena;
#ifdef DDP_HAVE_CUDA
  if (device.type == DDP_DEVICE_CUDA && device.index >= 0 && device.index < TAPE_DEVICES) {
    if (ddp__cuda_set_device(device.index) != DDP_OK) return NULL;
    int i = device.index;
    if (!tape->device_used[i]) {
      /* Starts small: the first step grows it to the step's high-water mark. */
      ddp_arena_init_backed(&tape->device_arena[i], (size_t)1 << 20, ddp__cuda_arena_backing());
      tape->device_used[i] = true;
    }
    return &tape->device_arena[i];
  }
#endif
  char name[DDP_DEVICE_STR_BYTES];
  ddp_error(DDP_ERR_UNSUPPORTED, "tape: no memory on %s in this build (%s)",
            ddp_device_str(device, name, sizeof name),
            device.type == DDP_DEVICE_CUDA && ddp_cuda_built() ? "at most cuda:7"
                                                               : "no backend for it");
  return NULL;
}

void *ddp__tape_scratch_on(ddp_tape *tape, ddp_device device, size_t bytes) {
  ddp_arena *arena = ddp__tape_arena_on(tape, device);
  return arena ? ddp_arena_alloc(arena, bytes) : NULL;
}

ddp__node *ddp__tape_node(ddp_tape *tape, const ddp_tensor *t) { return &tape->nodes[t->node]; }

void *ddp_tape_scratch(ddp_tape *tape, size_t bytes) {
  return ddp_arena_alloc(&tape->arena, bytes);
}

ddp_status ddp__tape_output(ddp_tape *tape, const char *op, ddp_dtype dtype, int ndim,
                            const int64_t *shape, ddp_device device, ddp_tensor **out) {
  ddp_tensor *t = ddp_arena_alloc(&tape->arena, sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate the output", op);
  ddp_status s = ddp_tensor_wrap(t, dtype, ndim, shape, NULL);
  if (s != DDP_OK) return ddp_error_wrap(s, "%s", op);
  t->device = device;
  ddp_arena *arena = ddp__tape_arena_on(tape, device);
  t->data = arena ? ddp_arena_alloc(arena, (size_t)t->numel * ddp_dtype_size(dtype)) : NULL;
  if (!t->data)
    return ddp_error_wrap(DDP_ERR_NOMEM, "%s: cannot allocate an output of %lld elements", op,
                          (long long)t->numel);
  *out = t;
  return DDP_OK;
}

ddp_status ddp__tape_view(ddp_tape *tape, const char *op, ddp_tensor *x, int ndim,
                          const int64_t *shape, ddp_tensor **out) {
  ddp_tensor *t = ddp_arena_alloc(&tape->arena, sizeof *t);
  if (!t) return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate the output", op);
  ddp_status s = ddp_tensor_wrap(t, x->dtype, ndim, shape, x->data);
  if (s != DDP_OK) return ddp_error_wrap(s, "%s", op);
  t->device = x->device;
  t->flags |= x->flags & DDP__TENSOR_LOW_VALUES; /* the same values: autocast's mark too */
  *out = t;
  return DDP_OK;
}

bool ddp__tape_wants_grad(const ddp_tape *tape, int n_inputs, ddp_tensor *const *inputs) {
  if (!tape->grad_enabled) return false;
  for (int i = 0; i < n_inputs; i++)
    if (inputs[i] && (inputs[i]->flags & DDP_TENSOR_REQUIRES_GRAD)) return true;
  return false;
}

/* Grows a heap array to hold at least `need` elements. */
static ddp_status grow(void **array, int *cap, int need, size_t elem) {
  if (need <= *cap) return DDP_OK;
  int fresh = *cap ? *cap * 2 : 64;
  while (fresh < need) fresh *= 2;
  void *p = ddp_alloc((size_t)fresh * elem);
  if (!p) return ddp_error(DDP_ERR_NOMEM, "tape: cannot grow to %d entries", fresh);
  if (*array) memcpy(p, *array, (size_t)*cap * elem);
  ddp_free(*array);
  *array = p;
  *cap = fresh;
  return DDP_OK;
}

/* The first slot of a leaf's probe sequence (Fibonacci hashing of the
 * pointer; its low bits are alignment). */
static uint32_t leaf_hash(const ddp_tensor *t, uint32_t cap) {
  return (uint32_t)(((uint64_t)(uintptr_t)t * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

/* The slot of leaf t in the index: its own, or the empty one where it
 * belongs. The index is never full (at most half used). */
static uint32_t leaf_slot(const ddp_tape *tape, const ddp_tensor *t) {
  uint32_t i = leaf_hash(t, tape->index_cap);
  while (tape->leaf_index[i] >= 0 && tape->leaves[tape->leaf_index[i]].t != t)
    i = (i + 1) & (tape->index_cap - 1);
  return i;
}

/* Room for one more leaf: grows the list, and the index to keep it at most
 * half full (rehashing the leaves of this step). Allocates only while a
 * step uses more leaves than any before it. */
static ddp_status leaf_room(ddp_tape *tape) {
  DDP_TRY(grow((void **)&tape->leaves, &tape->cap_leaves, tape->n_leaves + 1, sizeof(tape_leaf)));
  if ((uint32_t)tape->cap_leaves * 2 <= tape->index_cap) return DDP_OK;
  uint32_t cap = tape->index_cap ? tape->index_cap : 128;
  while (cap < (uint32_t)tape->cap_leaves * 2) cap *= 2;
  int32_t *index = ddp_alloc((size_t)cap * sizeof *index);
  if (!index) return ddp_error(DDP_ERR_NOMEM, "tape: cannot grow the leaf index to %u entries", cap);
  for (uint32_t i = 0; i < cap; i++) index[i] = -1;
  ddp_free(tape->leaf_index);
  tape->leaf_index = index;
  tape->index_cap = cap;
  for (int k = 0; k < tape->n_leaves; k++) {
    uint32_t slot = leaf_slot(tape, tape->leaves[k].t);
    index[slot] = k;
    tape->leaves[k].slot = slot;
  }
  return DDP_OK;
}

/* Counts one more use of leaf t on this tape; *out is its index in leaves. */
static ddp_status leaf_use(ddp_tape *tape, ddp_tensor *t, int32_t *out) {
  if (tape->index_cap) {
    uint32_t slot = leaf_slot(tape, t);
    int32_t k = tape->leaf_index[slot];
    if (k >= 0) {
      tape->leaves[k].pending++;
      *out = k;
      return DDP_OK;
    }
  }
  DDP_TRY(leaf_room(tape));
  uint32_t slot = leaf_slot(tape, t);
  int32_t k = tape->n_leaves++;
  tape->leaves[k] = (tape_leaf){.t = t, .pending = 1, .slot = slot};
  tape->leaf_index[slot] = k;
  *out = k;
  return DDP_OK;
}

int32_t ddp__tape_leaf_pending(const ddp_tape *tape, const ddp_tensor *t) {
  if (!tape->index_cap) return 0;
  int32_t k = tape->leaf_index[leaf_slot(tape, t)];
  return k >= 0 ? tape->leaves[k].pending : 0;
}

int ddp__tape_num_leaves(const ddp_tape *tape) { return tape->n_leaves; }

ddp_tensor *ddp__tape_leaf(const ddp_tape *tape, int i) { return tape->leaves[i].t; }

ddp_status ddp__tape_record(ddp_tape *tape, const char *op, ddp__backward_fn backward,
                            ddp_tensor *out, int n_inputs, ddp_tensor *const *inputs,
                            void *ctx) {
  DDP_ASSERT(n_inputs <= DDP__NODE_MAX_INPUTS);
  DDP_TRY(grow((void **)&tape->nodes, &tape->cap_nodes, tape->n_nodes + 1, sizeof(ddp__node)));
  ddp__node *node = &tape->nodes[tape->n_nodes];
  node->op = op;
  node->backward = backward;
  node->out = out;
  node->n_inputs = n_inputs;
  node->ctx = ctx;
  for (int i = 0; i < n_inputs; i++) {
    ddp_tensor *in = inputs[i];
    node->in[i] = in;
    node->leaf[i] = -1;
    if (in && in->node < 0 && (in->flags & DDP_TENSOR_REQUIRES_GRAD)) {
      DDP_TRY(leaf_use(tape, in, &node->leaf[i]));
    } else if (in && in->node >= 0) {
      in->pending++; /* an intermediate lives in the arena: no reset needed */
    }
  }
  out->flags |= DDP_TENSOR_REQUIRES_GRAD;
  out->node = tape->n_nodes++;
  return DDP_OK;
}

/* An intermediate's gradient in tape memory, zeroed or not. */
static float *new_intermediate_grad(ddp_tape *tape, ddp_tensor *t, bool zeroed,
                                    ddp_status *status) {
  size_t bytes = (size_t)t->numel * sizeof(float);
  ddp_arena *arena = ddp__tape_arena_on(tape, t->device);
  t->grad = !arena ? NULL : zeroed ? ddp_arena_calloc(arena, bytes) : ddp_arena_alloc(arena, bytes);
  if (!t->grad)
    *status = ddp_error_wrap(DDP_ERR_NOMEM, "backward: cannot allocate a gradient of %lld elements",
                             (long long)t->numel);
  return t->grad;
}

float *ddp__tape_grad(ddp_tape *tape, ddp_tensor *t, ddp_status *status) {
  if (!t || !(t->flags & DDP_TENSOR_REQUIRES_GRAD)) return NULL;
  if (t->grad) return t->grad;
  if (t->node < 0) {
    ddp_status s = ddp_tensor_ensure_grad(t);
    if (s != DDP_OK) *status = s;
    return t->grad;
  }
  return new_intermediate_grad(tape, t, true, status);
}

float *ddp__tape_grad_out(ddp_tape *tape, ddp_tensor *t, bool *accumulate, ddp_status *status) {
  *accumulate = true;
  if (!t || !(t->flags & DDP_TENSOR_REQUIRES_GRAD)) return NULL;
  if (t->grad || t->node < 0) return ddp__tape_grad(tape, t, status);
  if (!new_intermediate_grad(tape, t, false, status)) return NULL;
#ifdef DDP_POISON_FRESH_GRADS
  if (t->device.type == DDP_DEVICE_CPU)
    for (int64_t i = 0; i < t->numel; i++) t->grad[i] = NAN;
#endif
  *accumulate = false;
  return t->grad;
}

float *ddp__tape_grad_reusing_data(ddp_tape *tape, ddp_tensor *t, bool *accumulate,
                                   ddp_status *status) {
  if (t && !t->grad && t->node >= 0 && (t->flags & DDP__TENSOR_REUSABLE) &&
      (t->flags & DDP_TENSOR_REQUIRES_GRAD) && t->dtype == DDP_FLOAT32 && t->pending == 1) {
    *accumulate = false;
    t->grad = t->data;
    return t->grad;
  }
  return ddp__tape_grad_out(tape, t, accumulate, status);
}

ddp_status ddp__backward_from(ddp_tape *tape, ddp_tensor *out, const float *seed) {
  if (!(out->flags & DDP_TENSOR_REQUIRES_GRAD) || out->node < 0)
    return ddp_error(DDP_ERR_STATE,
                     "backward: the loss does not depend on anything that requires grad "
                     "(was it computed with grad disabled?)");
  if (tape->backward_done)
    return ddp_error(DDP_ERR_STATE,
                     "backward: already ran on this tape; call ddp_tape_reset before the next step");
  tape->backward_done = true;
  ddp_status s = DDP_OK;
  if (out->device.type != DDP_DEVICE_CPU && out->numel == 1) {
    /* A scalar seed (ddp_backward's 1) is a kernel argument, not a copy
     * from pageable host memory: nothing waits, and a CUDA graph can
     * capture it. A fresh gradient is assigned (0 + seed, as the add
     * below would give), an existing one adds a filled scratch. */
    const ddp__kernels *k;
    DDP_TRY(ddp__kernels_check("backward", 1, &out, &k));
    bool accumulate;
    float *g = ddp__tape_grad_out(tape, out, &accumulate, &s);
    if (!g) return s;
    if (!accumulate) {
      k->basic->fill(g, 0.0f + seed[0], 1);
    } else {
      float *one = ddp__tape_scratch_on(tape, out->device, sizeof(float));
      if (!one) return ddp_error_wrap(DDP_ERR_NOMEM, "backward: no room for the seed");
      k->basic->fill(one, seed[0], 1);
      k->basic->add(g, g, one, 1);
    }
  } else if (out->device.type == DDP_DEVICE_CPU) {
    float *g = ddp__tape_grad(tape, out, &s);
    if (!g) return s;
    for (int64_t i = 0; i < out->numel; i++) g[i] += seed[i];
  } else if (ddp_device_equal(ddp_pointer_device(seed), out->device)) {
    /* A seed already on out's device (a pipeline stage's gradient received
     * into device memory) adds there as it is. */
    float *g = ddp__tape_grad(tape, out, &s);
    if (!g) return s;
    const ddp__kernels *k;
    DDP_TRY(ddp__kernels_check("backward", 1, &out, &k));
    k->basic->add(g, g, seed, out->numel);
  } else { /* a seed of several values goes to the device, then adds there */
    float *g = ddp__tape_grad(tape, out, &s);
    if (!g) return s;
    const ddp__kernels *k;
    DDP_TRY(ddp__kernels_check("backward", 1, &out, &k));
    ddp_tensor host, dev;
    DDP_TRY(ddp_tensor_wrap(&host, DDP_FLOAT32, 1, &out->numel, (void *)seed));
    DDP_TRY(ddp_tensor_wrap(&dev, DDP_FLOAT32, 1, &out->numel,
                            ddp__tape_scratch_on(tape, out->device, (size_t)out->numel * 4)));
    if (!dev.data) return ddp_error_wrap(DDP_ERR_NOMEM, "backward: no room for the seed");
    dev.device = out->device;
    DDP_TRY(ddp_tensor_copy(&dev, &host));
    k->basic->add(g, g, dev.data, out->numel);
  }

  for (int i = out->node; i >= 0; i--) {
    ddp__node *node = &tape->nodes[i];
    if (node->out->grad) {
      s = node->backward(tape, node);
      if (s != DDP_OK) return ddp_error_wrap(s, "backward of %s (op #%d)", node->op, i);
    }
    /* A leaf's gradient is final once every op that used it has run. */
    for (int j = 0; j < node->n_inputs; j++) {
      ddp_tensor *in = node->in[j];
      if (in && in->node >= 0) in->pending--;
      if (node->leaf[j] < 0) continue;
      tape_leaf *leaf = &tape->leaves[node->leaf[j]];
      if (--leaf->pending == 0 && (in->flags & DDP_TENSOR_PARAM) && tape->hook)
        tape->hook(in, tape->hook_user);
    }
  }
  /* Ops recorded after `out` never reach it; their leaves' counts are
   * cleared on reset. */
  return DDP_OK;
}

ddp_status ddp_backward(ddp_tape *tape, ddp_tensor *loss) {
  if (loss->numel != 1 || loss->dtype != DDP_FLOAT32) {
    char buf[DDP_SHAPE_STR_BYTES];
    return ddp_error(DDP_ERR_SHAPE, "backward: the loss must be one float32 value, got %s %s",
                     ddp_dtype_name(loss->dtype), ddp_tensor_shape_str(loss, buf, sizeof buf));
  }
  static const float one = 1.0f;
  return ddp__backward_from(tape, loss, &one);
}
