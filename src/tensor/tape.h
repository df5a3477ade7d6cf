/* Internal contract between the tape and the ops that record on it.
 *
 * An op, after validating its inputs:
 *   1. allocates its output with ddp__tape_output();
 *   2. computes the forward through the device's kernel table;
 *   3. if ddp__tape_wants_grad() says so, saves what backward needs (in tape
 *      scratch memory) and calls ddp__tape_record().
 * Its backward function reads node->out->grad (d loss / d out) and, for each
 * input that requires grad, adds d loss / d input into ddp__tape_grad(tape, in).
 * Gradients accumulate (+=): an input may feed several ops. An op that writes
 * every element of an input's gradient may take it from ddp__tape_grad_out
 * instead and assign when it is the first to write it.
 *
 * Also tensor's one internal header for the layers above (docs/
 * architecture.md): what nn, parallel, pipeline, rpc and train reach below
 * tensor.h is here (the tape's internals, and a device's basic kernels). */
#ifndef DDP__TENSOR_TAPE_H
#define DDP__TENSOR_TAPE_H

#include "ddp/tensor.h"
#include "tensor/kernels_basic.h"

#define DDP__NODE_MAX_INPUTS 5

typedef struct ddp__node ddp__node;
typedef ddp_status (*ddp__backward_fn)(ddp_tape *tape, ddp__node *node);

struct ddp__node {
  const char *op;             /* "conv2d": names the op in errors and traces */
  ddp__backward_fn backward;
  ddp_tensor *out;
  int n_inputs;
  ddp_tensor *in[DDP__NODE_MAX_INPUTS]; /* NULL entries allowed (absent bias) */
  int32_t leaf[DDP__NODE_MAX_INPUTS]; /* in[i]'s index among the tape's leaves; -1 if
                                       * not a leaf requiring grad */
  void *ctx;                  /* op-specific saved state, tape scratch memory */
};

/* Allocates an op's output (struct and data, data not zeroed) in the tape's
 * arenas: the struct on the host, the data on `device` (its inputs').
 * Returns DDP_ERR_NOMEM with a message naming `op`. */
ddp_status ddp__tape_output(ddp_tape *tape, const char *op, ddp_dtype dtype, int ndim,
                            const int64_t *shape, ddp_device device, ddp_tensor **out);
/* The tape's arena for memory on `device`: the host arena for the CPU (the
 * one ddp_tape_scratch and ddp__tape_arena use), a device arena for a GPU
 * (created on first use, reset and freed with the tape). Kernels take their
 * scratch from the arena of the device they compute on, and an op keeps
 * there what only kernels read (saved statistics, argmax); what the host
 * reads (a backward's context) stays in ddp_tape_scratch. NULL, with the
 * error set, when the device has no backend in this build. */
ddp_arena *ddp__tape_arena_on(ddp_tape *tape, ddp_device device);
/* Scratch memory on `device` from ddp__tape_arena_on; NULL with the error
 * set when it cannot be had. */
void *ddp__tape_scratch_on(ddp_tape *tape, ddp_device device, size_t bytes);
/* Gives y the low-precision mark x carries under autocast (ddp/tensor.h,
 * "Autocast": a float32 tensor holding bfloat16 / float16 values), for an
 * op outside the tensor layer that copies x's values into y unchanged (a
 * gather of replicas' outputs). Nothing when x has none. */
void ddp__tape_mark_like(ddp_tensor *y, const ddp_tensor *x);
/* An output that shares `data` with an input (reshape/flatten views). */
ddp_status ddp__tape_view(ddp_tape *tape, const char *op, ddp_tensor *x, int ndim,
                          const int64_t *shape, ddp_tensor **out);
/* A view op complete: checks x, makes the view (ddp__tape_view) and records a
 * backward that passes the gradient straight through. Reshape, flatten and
 * the identity cases of other ops (dropout in eval) are this. */
ddp_status ddp__tape_make_view(ddp_tape *tape, const char *op, ddp_tensor *x, int ndim,
                              const int64_t *shape, ddp_tensor **out);
/* "(8,3,28,28)" for t, or "NULL"; buf is a char array of DDP_SHAPE_STR_BYTES. */
#define DDP__SHAPE(t, buf) ((t) ? ddp_tensor_shape_str((t), (buf), sizeof(buf)) : "NULL")
/* True when grad is enabled and any of the (possibly NULL) inputs requires it. */
bool ddp__tape_wants_grad(const ddp_tape *tape, int n_inputs, ddp_tensor *const *inputs);
/* Records a node producing `out` from `inputs`; marks `out` as requiring grad.
 * `ctx` must live in tape scratch memory (or be NULL). */
ddp_status ddp__tape_record(ddp_tape *tape, const char *op, ddp__backward_fn backward,
                            ddp_tensor *out, int n_inputs, ddp_tensor *const *inputs, void *ctx);
/* The gradient buffer to accumulate into for `t`, creating it zeroed when
 * absent (tape scratch for intermediates, heap for leaves). NULL when `t` is
 * NULL or does not require grad; callers skip that input. On allocation
 * failure returns NULL and sets *status. */
float *ddp__tape_grad(ddp_tape *tape, ddp_tensor *t, ddp_status *status);
/* The gradient buffer for `t` of an op that can write all of it. When `t` is
 * an intermediate whose gradient no other op has written yet, the buffer is
 * new tape scratch that is NOT zeroed, and *accumulate is false: the op must
 * assign every element (=), which saves zeroing the buffer and reading it
 * back, the largest memory traffic of a convolutional backward. Otherwise
 * (a leaf's persistent gradient, or one already written by another consumer)
 * *accumulate is true and the op adds (+=) as with ddp__tape_grad. NULL as
 * for ddp__tape_grad. Debug builds (DDP_POISON_FRESH_GRADS) fill a new
 * buffer with NaN, so an element the op fails to write shows in every
 * gradient test. */
float *ddp__tape_grad_out(ddp_tape *tape, ddp_tensor *t, bool *accumulate, ddp_status *status);
/* Marks an intermediate whose data nothing reads once its last consumer's
 * backward begins: its producer's backward never reads it (conv2d's, max
 * pooling's) and whoever made it keeps it to itself (nn's layer runner, for
 * a convolution's output it passes on to batch norm and a pooling's it
 * passes on to a convolution, or, flattened, to a linear layer). Such a
 * tensor's gradient may take over its data (ddp__tape_grad_reusing_data). */
#define DDP__TENSOR_REUSABLE 0x100u
/* ddp__tape_grad_out for an op that reads t's data only element by
 * element, each before writing that element's gradient: when t is marked
 * DDP__TENSOR_REUSABLE and this op is the last of its consumers to run
 * backward, the gradient is t's own data (*accumulate false; the op
 * assigns in place), which saves a new buffer of t's size and the memory
 * traffic of filling it. */
float *ddp__tape_grad_reusing_data(ddp_tape *tape, ddp_tensor *t, bool *accumulate,
                                   ddp_status *status);
/* Backward from any tensor with the given seed gradient (numel floats, in
 * host memory or on out's device: a pipeline stage's received gradient).
 * Used by ddp_backward (seed 1), by gradient checks (random projections)
 * and by the pipeline's stages. */
ddp_status ddp__backward_from(ddp_tape *tape, ddp_tensor *out, const float *seed);
/* Uses of leaf t recorded on this tape whose backward has not run yet (0
 * when t is not one of its leaves). A leaf's counts are the tape's own, so
 * tapes recording on the same leaves from different threads share no
 * writes; an intermediate's count is its ddp_tensor.pending. */
int32_t ddp__tape_leaf_pending(const ddp_tape *tape, const ddp_tensor *t);
/* The leaves requiring grad that this tape's recorded ops use, in order of
 * first use: i in [0, ddp__tape_num_leaves). Valid until the tape resets. */
int ddp__tape_num_leaves(const ddp_tape *tape);
ddp_tensor *ddp__tape_leaf(const ddp_tape *tape, int i);
/* The tape's host arena (scratch memory for CPU kernels and host-side
 * state; reset with the tape). */
ddp_arena *ddp__tape_arena(ddp_tape *tape);
/* The node that produced intermediate t (t->node >= 0). Node pointers move
 * as the tape grows: keep t->node, resolve when needed. */
ddp__node *ddp__tape_node(ddp_tape *tape, const ddp_tensor *t);

/* The basic kernels (copy, fill, scale, sum of squares, ...) of a device's
 * table, for layers above that keep float32 buffers on the device (nn's flat
 * gradients): ddp__kernels_for(device)->basic, or NULL when this build has
 * no backend for the device. */
const ddp__basic_kernels *ddp__basic_kernels_for(ddp_device device);

#endif /* DDP__TENSOR_TAPE_H */
