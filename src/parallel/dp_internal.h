/* Internals of the data-parallel wrapper, shared by its files: dp.c (the
 * object and one iteration), buckets.c (bucket assignment and the relayout),
 * hooks.c (the built-in communication hooks), join.c (uneven inputs) and
 * verify.c (the construction-time check that every rank has the same
 * parameters). Not installed. */
#ifndef DDP__PARALLEL_DP_INTERNAL_H
#define DDP__PARALLEL_DP_INTERNAL_H

#include "ddp/parallel.h"
#include "tensor/tape.h" /* ddp__basic_kernels_for: the hooks' device kernels */

struct ddp_dp {
  ddp_model *model;
  ddp_process_group *pg;
  /* Host-side collectives (counters, join's census, the shape check, the
   * relayout order): pg when it takes host buffers, else its host group
   * (ddp_process_group_host_group: an nccl pg refuses host memory). */
  ddp_process_group *host_pg;
  /* Where the model's flat buffers are, and that device's basic kernels
   * for the hooks' arithmetic on them (NULL on the CPU: the host loops). */
  ddp_device device;
  const ddp__basic_kernels *kernels;
  ddp_tensor *scratch_dev; /* on a GPU: the compressed copies' memory (dp->scratch points in) */
  ddp_optimizer *opt; /* follows a relayout; may be NULL */
  ddp_dp_options options;
  int rank, world;
  int n_params;

  /* Bucket order: parameters in the order their buckets are filled and
   * launched (reverse registration order until a relayout). Consecutive
   * entries sit back to back in the flat buffer with decreasing offsets, so
   * every run of them is one contiguous range. */
  int *order;     /* (n_params) */
  int *bucket_of; /* (n_params) bucket of each parameter */
  int n_buckets;
  ddp_dp_bucket *buckets;      /* (n_params) room for one bucket per parameter */
  ddp_dp_bucket_trace *trace;  /* (n_params) */
  uint16_t *scratch;           /* (n_param_elems) compressed copies, per bucket a slice,
                                * on the model's device (scratch_dev's memory on a GPU) */

  /* This backward's progress. */
  bool armed;         /* prepare_backward ran; finalize is due */
  bool syncing;       /* this backward reduces (not under no_sync) */
  ddp_tape *tape;     /* the tape the hook is installed on */
  bool *param_ready;  /* (n_params) */
  int n_ready;
  int *bucket_pending; /* (n_params) parameters of each bucket not yet ready */
  ddp_work **works;    /* (n_params) per bucket, NULL when none is in flight */
  int next_launch;     /* buckets [0, next_launch) have been launched */
  int hook_calls;
  int traced_buckets;      /* n_buckets when this backward began (for the trace) */
  ddp_status launch_error; /* first launch failure inside the grad hook */
  int *ready_order;        /* (n_params) parameters in the order they became ready */
  int n_ready_order;
  bool *got_grad;          /* (n_params) its grad hook fired in this backward */
  /* static_graph: which parameters got a gradient in the first synced
   * backward (got_grad then); later ones must match. */
  bool *first_got_grad;    /* (n_params) */
  bool graph_recorded;

  /* Communication hook. */
  ddp_dp_hook_kind hook_kind;
  ddp_dp_comm_hook hook;

  bool no_sync;
  float loss_scale; /* ddp_dp_set_loss_scale: backward's seed (1) */
  bool marked_model;  /* set the model's wrapped_by (cleared at destroy) */
  bool forward_param_sync; /* PyTorch's require_forward_param_sync: buffers are
                            * broadcast in a forward only if the last one synced */
  double divisor;          /* this iteration's averaging divisor */
  int buffer_root;         /* rank the buffers come from this iteration */

  /* Join. */
  bool join_enabled;
  bool join_divide_initial;
  int32_t *join_gather; /* (2 * world) [training, syncing] of every rank */

  /* Relayout and trace. */
  bool relayout_done;   /* decided (relaid out or found unnecessary) */
  bool relaid_out;
  int64_t iterations;   /* synced backwards (and shadowed ones) so far */
  int64_t backward_start_ns, backward_end_ns, finalize_end_ns;
};

/* ---- buckets.c ---------------------------------------------------------- */
/* Fills dp->buckets from dp->order with PyTorch's size rule (a bucket closes
 * once it reaches the current limit: first_bucket_mb, then bucket_cap_mb),
 * and dp->bucket_of. Checks the contiguity invariant. */
void ddp__dp_assign_buckets(ddp_dp *dp);
/* DDP_DEBUG=info or detail (or DDP_LOG_LEVEL=info): logs the wrapper's
 * layout on rank 0, as torch's DDP logs its reducer under
 * TORCH_DISTRIBUTED_DEBUG=INFO: the options, then each bucket's size and
 * parameters in launch order. `when` says why ("created", "re-laid out"). */
void ddp__dp_log_layout(const ddp_dp *dp, const char *when);
/* Reserves the group's work handles for every bucket's allreduce in flight
 * at once, plus the loss's and join's, so no step allocates one later. */
ddp_status ddp__dp_reserve_works(ddp_dp *dp);
/* After the first synced iteration: rank 0's observed ready order is
 * broadcast; if it differs from the bucket order, the model's buffers (and
 * the attached optimizer's state) are re-laid out so that it becomes the
 * bucket order, and the buckets are rebuilt. Collective. */
ddp_status ddp__dp_maybe_relayout(ddp_dp *dp);

/* ---- hooks.c ------------------------------------------------------------ */
/* The built-in hook of `kind` (state: the dp). */
ddp_dp_comm_hook ddp__dp_builtin_hook(ddp_dp *dp, ddp_dp_hook_kind kind);

/* ---- dp.c --------------------------------------------------------------- */
/* Marks parameter i ready and launches every bucket that is now next in
 * line and complete. */
void ddp__dp_mark_ready(ddp_dp *dp, int i);
/* The wrapper's tape grad hook (user: the dp), for a hook that chains it
 * (ZeRO-3's). */
void ddp__dp_grad_ready(ddp_tensor *param, void *user);
/* Resets this backward's progress (every parameter not ready). */
void ddp__dp_arm(ddp_dp *dp, bool syncing);
/* Waits for every launched bucket and finishes it; see finalize_backward. */
ddp_status ddp__dp_complete(ddp_dp *dp);
/* After a failed backward: unhooks the tape, waits for every launched
 * bucket (nothing left in flight on the gradient buffer) and disarms;
 * returns `failure`. */
ddp_status ddp__dp_abandon_backward(ddp_dp *dp, ddp_tape *tape, ddp_status failure);
/* Broadcasts parameters, buffers and counters from `root`. */
ddp_status ddp__dp_broadcast_state(ddp_dp *dp, int root, bool params);

/* ---- verify.c ----------------------------------------------------------- */
/* Every rank has the same number of parameters with the same shapes
 * (DDP_ERR_SHAPE naming the first difference and the rank otherwise). */
ddp_status ddp__dp_verify_params(ddp_dp *dp);

#endif /* DDP__PARALLEL_DP_INTERNAL_H */
