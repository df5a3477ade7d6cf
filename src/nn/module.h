/* Internal layout of models and modules, shared by the nn layer's files
 * (module.c builds and lays out the tree, forward.c runs it, models.c holds
 * the seeds' builders). */
#ifndef DDP__NN_MODULE_H
#define DDP__NN_MODULE_H

#include "ddp/nn.h"

struct ddp_module {
  ddp_module_kind kind;
  char *name;  /* attribute name in the parent ("layer1", "0"); "" for the root */
  char *path;  /* dotted prefix of its state ("layer1.0"); "" for the root */
  ddp_module *parent, *first_child, *last_child, *next_sibling;
  int n_children;

  /* Configuration (which fields mean something depends on kind). */
  int64_t in_features;  /* Linear in, Conv2d in_channels, BatchNorm2d num_features */
  int64_t out_features; /* Linear out, Conv2d out_channels */
  int kernel, stride, padding;
  bool has_bias;
  float p;              /* dropout probability */
  int start_dim;        /* Flatten */
  float momentum, eps;  /* BatchNorm2d */

  /* State, set by ddp_model_finalize (views into the model's flat buffers). */
  ddp_tensor *weight, *bias;             /* parameters or NULL */
  ddp_tensor *running_mean, *running_var; /* float buffers or NULL */
  int64_t *num_batches_tracked;           /* counter or NULL */
};

/* What a state-dict entry refers to. */
typedef enum {
  DDP__STATE_PARAM,
  DDP__STATE_BUFFER,
  DDP__STATE_COUNTER,
} ddp__state_kind;

typedef struct ddp__state_rec {
  char *name;
  ddp__state_kind kind;
  int index; /* into params, buffers or counters */
} ddp__state_rec;

#define DDP__MODEL_NAME_BYTES 32

struct ddp_model {
  ddp_module *root;
  bool finalized;
  bool training;
  ddp_loss_kind loss;
  char name[DDP__MODEL_NAME_BYTES];
  int sample_ndim;
  int64_t sample_shape[DDP_MAX_DIMS];
  int64_t num_outputs;
  ddp_rng dropout_rng;
  /* SyncBatchNorm: BatchNorm2d modules synchronize through bn_sync when set. */
  bool bn_synced;
  ddp_batch_norm_sync bn_sync;
  /* The root's forward: these children in this order, or (NULL) all of them
   * in registration order. */
  ddp_module **forward_order;
  int n_forward;
  /* ddp_model_set_forward_hook: around each top-level child's forward. */
  ddp_module_forward_hook forward_hook;
  void *forward_hook_user;

  /* Parameters: tensors viewing params_flat / grads_flat, in registration order. */
  int n_params;
  ddp_tensor *params;
  char **param_names; /* aliases of the state records' names */
  int64_t *param_offsets;
  float *params_flat, *grads_flat;
  int64_t n_param_elems;

  /* Float buffers (running stats) viewing buffers_flat; int64 counters. */
  int n_buffers;
  ddp_tensor *buffers;
  float *buffers_flat;
  int64_t n_buffer_elems;
  int n_counters;
  int64_t *counters;

  /* The state dict, in PyTorch's order. */
  int n_state;
  ddp__state_rec *state;

  /* Where params_flat, grads_flat and buffers_flat live (ddp_model_to);
   * counters and everything else stay on the host. Off the CPU the three
   * are the data of these device tensors, which own them. */
  ddp_device device;
  ddp_tensor *device_flat[3];

  /* A replica (replica.c): params_flat is another model's, read in place
   * and never freed, moved or re-laid out from here. has_replicas: some
   * replica reads this model's params_flat, which must then stay where it
   * is and as it is laid out (ddp_model_to, ddp_model_relayout refuse). */
  bool params_borrowed;
  ddp_model *replica_of; /* whose params_flat (NULL unless params_borrowed) */
  int has_replicas;
  /* The wrapper that holds this model ("DistributedDataParallel",
   * "DataParallel") or NULL: set and cleared by the parallel layer, which
   * refuses a second wrapper (a replica reads the parameters in place, so
   * a relayout or a move under it would leave it reading freed memory). */
  const char *wrapped_by;
};

/* ddp_model_state_entry for a model on any device: entry->data is where
 * the entry lives, on the model's device for parameters and buffers (the
 * counters stay on the host); *on_device says which. For io's checkpoint
 * code, which copies through the host (docs/cuda.md, "Memory"). */
ddp_status ddp__model_state_entry_any(const ddp_model *model, int index, ddp_state_entry *entry,
                                      bool *on_device);

/* Runs one module (recursively for containers) on x. */
ddp_status ddp__module_forward(ddp_model *model, ddp_module *m, ddp_tape *tape, ddp_tensor *x,
                               ddp_tensor **out);
/* "Linear", "Conv2d", ...: the PyTorch class name of a kind. */
const char *ddp__module_kind_name(ddp_module_kind kind);

#endif /* DDP__NN_MODULE_H */
