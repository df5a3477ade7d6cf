/* ddp zero: ZeRO stages 1, 2 and 3 (DeepSpeed's names; PyTorch's
 * ZeroRedundancyOptimizer is stage 1, FSDP's FULL_SHARD stage 3) on top of
 * the data-parallel wrapper.
 * The flat parameter buffer of n floats is cut into one contiguous range
 * per rank, balanced ([n*r/W, n*(r+1)/W)), and each rank keeps the
 * optimizer's state of its own range only: with Adam, 8 bytes per
 * parameter become 8/W. docs/sharding.md has the rules and the reasons.
 *
 *   stage 1: gradients are allreduced in buckets as under plain data
 *            parallelism; each rank steps its range; then every range is
 *            broadcast from its owner (an allgather of the parameters).
 *   stage 2: each bucket's gradients are reduced (summed) to the ranks
 *            owning its floats while backward runs, so a rank ends with
 *            the averaged gradients of its range only; then as stage 1.
 *            After the relayout backward writes into a ring of two
 *            bucket-sized slots and a rank keeps only its range of the
 *            gradient buffer (ddp_zero_backward).
 *   stage 3: as stage 2, and each rank keeps only its range of the
 *            parameters: the other pages of the flat parameter buffer are
 *            given back to the system, and each top-level module's
 *            parameters are gathered before its forward and again before
 *            its backward, then released (docs/sharding.md, "Stage 3"),
 *            the next one's gather in flight while one computes
 *            (prefetch). No gather after the step. The wrapper does not
 *            re-lay out.
 *
 * The model of use (one replica per rank; the optimizer over the model's
 * whole flat buffers, which ddp_zero_create narrows to this rank's range):
 *
 *   ddp_optimizer *opt;   // over ddp_model_params_flat / grads_flat, n floats
 *   ddp_zero *z;
 *   ddp_zero_options zo = ddp_zero_defaults(2);
 *   DDP_TRY(ddp_zero_create(&z, model, pg, opt, &zo));  // collective
 *   for (each batch) {
 *     ddp_zero_zero_grad(z);           // stage 2: this rank's range
 *     ddp_tape_reset(tape);
 *     DDP_TRY(ddp_zero_forward(z, tape, x, &out));  // parameters complete first
 *     DDP_TRY(ddp_model_loss(model, tape, out, y, &loss));
 *     DDP_TRY(ddp_zero_backward(z, tape, loss));    // this rank's range averaged
 *     DDP_TRY(ddp_zero_step(z));                    // own range, then gathered
 *   }
 *   ddp_zero_destroy(z);   // before the optimizer
 *
 * Equality: stage 1 computes what plain data parallelism computes, bit for
 * bit (the same allreduce, and the optimizers are elementwise). Stage 2's
 * sums are the reduce's instead of the allreduce's: at two ranks every
 * order of a sum of two is the same addition, so it is bitwise equal too;
 * from three ranks up the backend may add the ranks' gradients in another
 * order (docs/comm.md), a rounding of the gradient's last bit.
 *
 * Every rank makes the same sequence of calls (they are collectives on the
 * group). One thread at a time. CPU only. */
#ifndef DDP_ZERO_H
#define DDP_ZERO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_zero ddp_zero;

typedef struct ddp_zero_options {
  int32_t stage;     /* 1, 2 or 3 */
  /* Stage 3: gather each unit only when it is needed, no prefetch of the
   * next one (docs/sharding.md, "Prefetch"; FSDP's forward_prefetch=False,
   * backward_prefetch=None). For measuring what prefetch gains. (false) */
  bool no_prefetch;
  uint8_t reserved8[3];
  ddp_dp_options dp; /* the wrapper's: buckets, relayout (ddp_dp_defaults()) */
  uint64_t reserved[4]; /* zero */
} ddp_zero_options;
DDP_STRUCT_SIZE(ddp_zero_options, 128);

/* stage as given, the wrapper's defaults. */
ddp_zero_options ddp_zero_defaults(int stage);

/* Wraps `model` for ZeRO over `pg` (a ddp_dp inside: the same shape check
 * and broadcast from rank 0) and narrows `opt` (created over the model's
 * whole flat buffers, on the CPU) to this rank's range
 * (ddp_optimizer_narrow; state it already holds is kept for that range).
 * Collective. model, pg and opt are borrowed and must outlive the zero.
 * DDP_ERR_INVALID for a stage other than 1, 2 or 3, an optimizer over other
 * buffers, or a model with fewer floats than ranks; DDP_ERR_UNSUPPORTED at
 * stage 3 for a model whose top-level modules' parameters are not
 * registered together. Stage 3 installs the model's forward hook (removed
 * by destroy) and gives back the pages outside this rank's range: read the
 * parameters only after ddp_zero_sync_params. *out NULL on failure
 * (opt may then be narrowed already). */
ddp_status ddp_zero_create(ddp_zero **out, ddp_model *model, ddp_process_group *pg,
                           ddp_optimizer *opt, const ddp_zero_options *options);
/* NULL ok. Leaves the optimizer narrowed. */
void ddp_zero_destroy(ddp_zero *z);

/* The wrapper inside (buckets, trace); owned by the zero. */
ddp_dp *ddp_zero_dp(ddp_zero *z);
int ddp_zero_stage(const ddp_zero *z);

/* Floats [*offset, *offset + *numel) of the flat buffers are rank's. */
void ddp_zero_range(const ddp_zero *z, int rank, int64_t *offset, int64_t *numel);

/* no_sync for gradient accumulation, as ddp_dp_set_no_sync, except under
 * stage 2's gradient ring (below, ddp_zero_backward), where every backward
 * reduces and adds into this rank's range (DeepSpeed's stage 2 under
 * accumulation) and no_sync only spares the parameters' gather. */
void ddp_zero_set_no_sync(ddp_zero *z, bool no_sync);

/* zero_grad for a ZeRO run: under stage 2's gradient ring this rank's
 * range of the gradient buffer (the rest is not kept), else
 * ddp_model_zero_grad. ddp_model_zero_grad stays correct under the ring but
 * writes the whole buffer, whose pages then come back. */
ddp_status ddp_zero_zero_grad(ddp_zero *z);

/* Completes the parameters (ddp_zero_sync_params) if an update may have
 * changed them since, then ddp_dp_forward. Stage 3: gathers each
 * top-level module before its forward instead, releasing it when the next
 * one begins, with the next one's gather in flight meanwhile (from the
 * second forward on: the previous forward's order). */
ddp_status ddp_zero_forward(ddp_zero *z, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
/* ddp_dp_backward with the stage's reduction. On return (synced) this
 * rank's range of the gradient buffer holds the average over ranks; under
 * stage 1 the whole buffer does, under stage 2 the rest holds this rank's
 * own gradients or nothing (not to be used). Marks the parameters to be
 * gathered before the next forward. After the wrapper's one relayout,
 * moves the optimizer state that has values to the new owners
 * (collective).
 * Stage 2's gradient ring (docs/sharding.md, "Gradient memory under stage
 * 2"): from the first backward after the relayout is decided (and with no
 * unreduced gradient left by no_sync), each parameter's `grad` points
 * into a ring of two bucket-sized slots during backward (back into the
 * flat buffer on return), every backward reduces, and this rank's part is
 * added into its range (assigned after ddp_zero_zero_grad); the flat
 * buffer's pages outside the range are given back. Not with
 * find_unused_parameters or static_graph, at one rank, or when the first
 * such backward's graph writes a bucket before the one two earlier is
 * final (tied weights): the whole buffer is then kept. A later backward
 * whose graph does not fit is DDP_ERR_UNSUPPORTED, before it runs. With
 * the ring, micro-batches are reduced one by one: the sums' order is not
 * plain data parallelism's accumulate-then-reduce (equal within rounding,
 * not bit for bit). */
ddp_status ddp_zero_backward(ddp_zero *z, ddp_tape *tape, ddp_tensor *loss);

/* torch.nn.utils.clip_grad_norm_ over the whole model from the shards:
 * each rank sums the squares of its range (double), one allreduce gives
 * the total, and each rank scales its range by max_norm / (norm + 1e-6)
 * when that is < 1, as ddp_model_clip_grad_norm. *total_norm (may be NULL)
 * gets the norm on every rank. A non-finite norm is DDP_ERR_RANGE on every
 * rank, gradients unchanged. Collective; call between backward and step. */
ddp_status ddp_zero_clip_grad_norm(ddp_zero *z, double max_norm, double *total_norm);

/* The optimizer's step on this rank's range, then ddp_zero_sync_params
 * (not at stage 3: the next forward gathers module by module). */
ddp_status ddp_zero_step(ddp_zero *z);

/* Every range broadcast from its owner, so every rank holds the whole
 * updated model. Does nothing when no backward ran since the last sync
 * (and, at stage 3, the whole model is here). Collective. Call it before
 * reading the parameters (evaluation, checkpoints) when the optimizer was
 * stepped directly, and at stage 3 always (FSDP's summon_full_params; the
 * next forward gives the other ranges back). */
ddp_status ddp_zero_sync_params(ddp_zero *z);

/* ---- Stage 3's prefetch -----------------------------------------------------
 * While unit i (a top-level module) computes its forward, the gather of the
 * unit that ran after it in the previous forward is in flight (FSDP's
 * forward_prefetch: from the second forward on); while unit i's backward
 * runs, the gather of the unit before it is (backward_prefetch=
 * BACKWARD_PRE). At most two units are gathered or in flight at once. */

/* What happened to the units since the last training forward began, in
 * order, for tests and debugging. */
typedef enum ddp_zero_event_kind {
  DDP_ZERO_EVENT_GATHER_ISSUED = 1, /* the unit's gather was enqueued */
  DDP_ZERO_EVENT_GATHER_NEEDED = 2, /* its forward or backward is next: gather waited for */
  DDP_ZERO_EVENT_FORWARD_DONE = 3,  /* its forward returned */
  DDP_ZERO_EVENT_BACKWARD_DONE = 4, /* its last gradient is final */
  DDP_ZERO_EVENT_RELEASED = 5,      /* its pages outside this rank's range given back */
} ddp_zero_event_kind;
typedef struct ddp_zero_event {
  int32_t kind; /* ddp_zero_event_kind */
  int32_t unit; /* 0.. in the flat buffer's order */
} ddp_zero_event;
/* Copies up to cap events into out; returns how many there are (none
 * below stage 3). */
int ddp_zero_events(const ddp_zero *z, ddp_zero_event *out, int cap);

typedef struct ddp_zero_prefetch_stats {
  int64_t gathers;           /* since create: unit gathers enqueued */
  int64_t prefetched;        /* of them, ahead of need */
  int64_t ready_when_needed; /* prefetches already complete when needed */
  int32_t max_units_held;    /* since the last forward began: most units gathered or in flight */
  int32_t events_lost;       /* events past the log's room (ten per unit) */
  bool enabled;
  uint8_t reserved8[7];
  uint64_t reserved[3];
} ddp_zero_prefetch_stats;
DDP_STRUCT_SIZE(ddp_zero_prefetch_stats, 64);
/* Zeros below stage 3. */
void ddp_zero_get_prefetch_stats(const ddp_zero *z, ddp_zero_prefetch_stats *out);

/* ---- State for checkpoints -----------------------------------------------
 * A checkpoint of a ZeRO run is the ordinary one (docs/io.md): the whole
 * optimizer state, by parameter name, which loads at any world size, any
 * stage and without ZeRO. */

/* Collective: root's `full` (an optimizer of the same options over the
 * model's whole flat buffers; ignored, may be NULL, on other ranks) gets
 * every rank's range of every state buffer, the step and the lr; with no
 * state yet (no step, no load) it is left without state, as PyTorch's
 * state_dict. Point-to-point to root: no rank but root holds more than
 * its range. */
ddp_status ddp_zero_gather_state(ddp_zero *z, ddp_optimizer *full, int root);
/* Local: this rank's range of `full`'s state (an optimizer as above,
 * loaded from a checkpoint), its step and lr into the narrowed optimizer.
 * Nothing when full has no state. */
ddp_status ddp_zero_load_state(ddp_zero *z, ddp_optimizer *full);

/* ---- Memory ---------------------------------------------------------------- */

/* Bytes this rank holds for training state. param: the model's flat
 * buffer at stages 1 and 2; at stage 3 this rank's range and at most two
 * top-level modules gathered (the one running and the one prefetched; one
 * with no_prefetch): the range plus the two largest modules' parts outside
 * it. grad: the whole gradient buffer (the tape accumulates into it),
 * except under stage 2's gradient ring: this rank's range plus the ring;
 * grad_ring: the ring (0 without); grad_owned: the part of the buffer that
 * holds reduced values (all of it at stage 1, this rank's range at stages 2
 * and 3); optim_state: the narrowed optimizer's state buffers;
 * optim_state_unsharded: what they would be unsharded. */
typedef struct ddp_zero_memory {
  int64_t param_bytes, grad_bytes, grad_ring_bytes, grad_owned_bytes;
  int64_t optim_state_bytes, optim_state_unsharded_bytes;
} ddp_zero_memory;
void ddp_zero_get_memory(const ddp_zero *z, ddp_zero_memory *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_ZERO_H */
