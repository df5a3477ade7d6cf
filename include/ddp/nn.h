/* ddp nn: models as trees of modules with PyTorch's names, their parameters
 * and gradients in flat buffers, PyTorch's initialisation, the forward pass
 * through the tensor ops, and ready builders for the seeds' models.
 *
 * The model of use (one training step, see docs/nn.md):
 *
 *   ddp_model *model;
 *   ddp_model_build("convnet", NULL, 42, &model);  // or create + add_* + finalize
 *   ddp_model_zero_grad(model);
 *   ddp_tape_reset(tape);
 *   ddp_model_forward(model, tape, x, &logits);    // x (N, 1, 28, 28)
 *   ddp_model_loss(model, tape, logits, labels, &loss);
 *   ddp_backward(tape, loss);                      // grads land in the flat buffer
 *   // optimizer: one loop over ddp_model_params_flat / ddp_model_grads_flat
 *
 * A model is built in two phases. First modules are added to the tree (no
 * memory for parameters yet); ddp_model_finalize() then lays out every
 * parameter in one float32 allocation (and every gradient in another of the
 * same layout), every float buffer (BN running stats) in a third, and
 * initialises them as PyTorch does. After finalize the tree is frozen. */
#ifndef DDP_NN_H
#define DDP_NN_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ddp_model ddp_model;   /* opaque; ddp_model_create / ddp_model_destroy */
typedef struct ddp_module ddp_module; /* opaque; owned by its model */

typedef enum ddp_module_kind {
  DDP_MODULE_SEQUENTIAL = 0, /* runs its children in order (also the root) */
  DDP_MODULE_LINEAR,
  DDP_MODULE_CONV2D,
  DDP_MODULE_BATCHNORM2D,
  DDP_MODULE_RELU,
  DDP_MODULE_SIGMOID,
  DDP_MODULE_TANH,
  DDP_MODULE_MAXPOOL2D,
  DDP_MODULE_DROPOUT,
  DDP_MODULE_DROPOUT2D,
  DDP_MODULE_FLATTEN,
  DDP_MODULE_LOGSOFTMAX,
  DDP_MODULE_KIND_COUNT
} ddp_module_kind;

/* The loss ddp_model_loss applies to the forward's output. */
typedef enum ddp_loss_kind {
  DDP_LOSS_NONE = 0,          /* ddp_model_loss refuses: set one first */
  DDP_LOSS_MSE = 1,           /* target float32, the output's shape */
  DDP_LOSS_CROSS_ENTROPY = 2, /* output (N, C) logits, target (N) int64 */
  DDP_LOSS_NLL = 3,           /* output (N, C) log-probabilities, target (N) int64 */
} ddp_loss_kind;

/* ---- Building a model ----------------------------------------------------
 * ddp_model_create makes an empty model whose root is a Sequential with the
 * empty name, so its children's names are the first component of every
 * state-dict name ("layer1", "fc"). The add_* functions append a module to
 * `parent` (a Sequential of this model; NULL means the root) and return it in
 * *out (out may be NULL). `name` is the attribute name PyTorch would use; NULL
 * gives the child's index in its parent ("0", "1", ...), as nn.Sequential
 * does. Names must be unique among siblings and may not contain '.'.
 * Parameterless modules (ReLU, ...) contribute no state, so their names only
 * matter for readability. Adding after ddp_model_finalize is DDP_ERR_STATE. */
ddp_status ddp_model_create(ddp_model **out);
/* Frees the model, its modules and every buffer. NULL ok. Tensors obtained
 * from the model become invalid. */
void ddp_model_destroy(ddp_model *model);
ddp_module *ddp_model_root(ddp_model *model);

ddp_status ddp_module_add_sequential(ddp_model *model, ddp_module *parent, const char *name,
                                     ddp_module **out);
/* weight (out_features, in_features), bias (out_features) when `bias`. */
ddp_status ddp_module_add_linear(ddp_model *model, ddp_module *parent, const char *name,
                                 int64_t in_features, int64_t out_features, bool bias,
                                 ddp_module **out);
/* weight (out_channels, in_channels, kernel, kernel), bias (out_channels). */
ddp_status ddp_module_add_conv2d(ddp_model *model, ddp_module *parent, const char *name,
                                 int64_t in_channels, int64_t out_channels, int kernel,
                                 int stride, int padding, bool bias, ddp_module **out);
/* BatchNorm2d(num_features): affine, tracking running stats, momentum 0.1,
 * eps 1e-5 (PyTorch's defaults). State: weight, bias, running_mean,
 * running_var (float32, (num_features)), num_batches_tracked (int64, ()). */
ddp_status ddp_module_add_batchnorm2d(ddp_model *model, ddp_module *parent, const char *name,
                                      int64_t num_features, ddp_module **out);
ddp_status ddp_module_add_relu(ddp_model *model, ddp_module *parent, const char *name,
                               ddp_module **out);
ddp_status ddp_module_add_sigmoid(ddp_model *model, ddp_module *parent, const char *name,
                                  ddp_module **out);
ddp_status ddp_module_add_tanh(ddp_model *model, ddp_module *parent, const char *name,
                               ddp_module **out);
/* MaxPool2d(kernel, stride); stride 0 means stride = kernel (PyTorch's default). */
ddp_status ddp_module_add_maxpool2d(ddp_model *model, ddp_module *parent, const char *name,
                                    int kernel, int stride, ddp_module **out);
/* Dropout(p) / Dropout2d(p), p in [0, 1); active only in training mode. */
ddp_status ddp_module_add_dropout(ddp_model *model, ddp_module *parent, const char *name,
                                  float p, ddp_module **out);
ddp_status ddp_module_add_dropout2d(ddp_model *model, ddp_module *parent, const char *name,
                                    float p, ddp_module **out);
/* Flatten(start_dim): dims [start_dim, ndim) into one (nn.Flatten uses 1). */
ddp_status ddp_module_add_flatten(ddp_model *model, ddp_module *parent, const char *name,
                                  int start_dim, ddp_module **out);
/* LogSoftmax over dim 1 of (N, C). */
ddp_status ddp_module_add_log_softmax(ddp_model *model, ddp_module *parent, const char *name,
                                      ddp_module **out);

/* The order the root runs its children in. By default the root runs them in
 * the order they were added, like nn.Sequential. A PyTorch model's forward
 * may call its children in another order than it registered them (Propulate's
 * Net assigns self.fc before self.conv_layers but runs conv_layers first), and
 * registration order is what fixes state_dict() and parameters() order; this
 * keeps both. `modules` are children of the root; one may appear more than
 * once (a stateless ReLU reused). Copied; call before or after finalize. */
ddp_status ddp_model_set_forward_order(ddp_model *model, int n, ddp_module *const *modules);

/* Lays out and initialises every parameter and buffer (see the top of this
 * file) and freezes the tree. Initialisation is PyTorch's: Linear and Conv2d
 * weights and biases uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)) (what
 * kaiming_uniform_(a=sqrt(5)) gives), drawn in parameter order from a ddp_rng
 * seeded with `seed`; BatchNorm weight 1, bias 0, running_mean 0,
 * running_var 1, num_batches_tracked 0. The dropout generator is seeded from
 * `seed` too (ddp_model_seed_dropout reseeds it). The model starts in
 * training mode with every gradient zero. A model with no parameters is
 * fine. Finalizing twice is DDP_ERR_STATE. */
ddp_status ddp_model_finalize(ddp_model *model, uint64_t seed);

/* ---- The seeds' models ---------------------------------------------------
 * Builds, finalizes and initialises one of the ready models (docs/nn.md has
 * the table), with PyTorch's names and the model's loss kind set:
 *   "toy"        seed 001's ToyModel: net1 Linear(10,10), relu, net2 Linear(10,5); MSE
 *   "headtail"   seed 000's ToyModel: head Linear(32,32), tail Linear(32,10); cross-entropy
 *   "convnet"    seed 001's MNIST ConvNet (layer1, layer2 with BN; fc 1568->10); cross-entropy
 *   "psnet"      the RPC parameter-server tutorial Net (conv1, conv2, fc1, fc2); NLL
 *   "convnet-N"  Propulate's Net with N in 2..10 conv blocks (conv_layers.i.0, fc); NLL
 * `activation` ("relu", "sigmoid", "tanh") applies to convnet-N only, where
 * NULL or "" means "relu"; the other models take NULL or "". Unknown names,
 * N out of range or a bad activation are DDP_ERR_INVALID with a message that
 * lists the valid choices. On error *out is NULL. */
ddp_status ddp_model_build(const char *name, const char *activation, uint64_t seed,
                           ddp_model **out);
/* "toy, headtail, convnet, psnet, convnet-N (N in 2..10)": for usage text. */
const char *ddp_model_names(void);
/* The name the model was built under ("convnet-3"), or "custom". */
const char *ddp_model_name(const ddp_model *model);

/* The shape of one input sample ((1, 28, 28) for the MNIST models, (10) for
 * toy) written into shape; returns its number of dimensions (0 when unknown,
 * e.g. for a custom model that never set it). */
int ddp_model_sample_shape(const ddp_model *model, int64_t shape[DDP_MAX_DIMS]);
void ddp_model_set_sample_shape(ddp_model *model, int ndim, const int64_t *shape);
/* For classification losses: the number of classes (output width); for MSE
 * the output width. 0 when unknown. */
int64_t ddp_model_num_outputs(const ddp_model *model);

/* ---- Parameters and flat buffers ----------------------------------------
 * Parameters are numbered in registration order, which is PyTorch's
 * model.parameters() order. Each is a float32 ddp_tensor with flags
 * DDP_TENSOR_PARAM | DDP_TENSOR_REQUIRES_GRAD, param_index = i, data at
 * params_flat + offset and grad at grads_flat + offset. The tensors and the
 * flat buffers are owned by the model (valid until ddp_model_destroy). All
 * of these require a finalized model (NULL / 0 before). */
int ddp_model_num_params(const ddp_model *model);
ddp_tensor *ddp_model_param(ddp_model *model, int index);
const char *ddp_model_param_name(const ddp_model *model, int index); /* "layer1.0.weight" */
int64_t ddp_model_param_offset(const ddp_model *model, int index);   /* in floats */
/* The parameter named `name`, or NULL. */
ddp_tensor *ddp_model_find_param(ddp_model *model, const char *name);
float *ddp_model_params_flat(ddp_model *model);
float *ddp_model_grads_flat(ddp_model *model);
int64_t ddp_model_num_param_elements(const ddp_model *model); /* floats in each flat buffer */
/* Re-lays out the flat buffers: parameter order[k] is placed k-th, its data
 * and gradient moved along (order: a permutation of 0..num_params-1,
 * DDP_ERR_INVALID otherwise). The flat allocations keep their addresses;
 * each parameter tensor's data / grad and ddp_model_param_offset change, its
 * index and name do not. Data parallelism calls it once, after the first
 * iteration, to make buckets contiguous in gradient-ready order; anything
 * holding per-parameter state laid out like the flat buffers (an optimizer:
 * ddp_optimizer_relayout) must move with it. Allocates a temporary. */
ddp_status ddp_model_relayout(ddp_model *model, const int *order);
/* Float buffers (BN running_mean, running_var) in one allocation, in
 * state-dict order; num_batches_tracked counters (one int64 per BN) in another.
 * DDP broadcasts these from rank 0. */
float *ddp_model_buffers_flat(ddp_model *model);
int64_t ddp_model_num_buffer_elements(const ddp_model *model);
int64_t *ddp_model_counters(ddp_model *model);
int ddp_model_num_counters(const ddp_model *model);

/* ---- State dict ----------------------------------------------------------
 * Every parameter and buffer in PyTorch's state_dict() order (per module: its
 * parameters, then its buffers, then its children's, depth first). `data`
 * points into the model's memory: writing through it changes the model. */
typedef struct ddp_state_entry {
  const char *name;   /* "layer1.1.running_mean"; owned by the model */
  ddp_dtype dtype;    /* DDP_FLOAT32, or DDP_INT64 for num_batches_tracked */
  int32_t ndim;       /* 0 for num_batches_tracked (a scalar, as in PyTorch) */
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  void *data;
  bool is_param;      /* a parameter (vs a buffer) */
  int32_t param_index; /* its ddp_model_param index; -1 for buffers */
} ddp_state_entry;

int ddp_model_state_count(const ddp_model *model);
/* Fills *entry for index in [0, count); DDP_ERR_RANGE otherwise. */
ddp_status ddp_model_state_entry(const ddp_model *model, int index, ddp_state_entry *entry);
/* Looks an entry up by name; DDP_ERR_NOTFOUND (naming it) when absent. */
ddp_status ddp_model_state_find(const ddp_model *model, const char *name, ddp_state_entry *entry);
/* Copies `data` into the entry named `name` after checking that dtype and
 * shape match exactly (DDP_ERR_NOTFOUND / DDP_ERR_SHAPE / DDP_ERR_INVALID
 * with the name and both shapes otherwise). load_state_dict, one tensor. */
ddp_status ddp_model_load_tensor(ddp_model *model, const char *name, ddp_dtype dtype, int ndim,
                                 const int64_t *shape, const void *data);

/* ---- Training ------------------------------------------------------------ */
/* Training mode (the default after finalize): BN normalises with batch
 * statistics and updates its running stats, dropout is active. Evaluation
 * mode: BN uses running stats, dropout is the identity. model.train(mode). */
void ddp_model_train(ddp_model *model, bool training);
bool ddp_model_is_training(const ddp_model *model);
/* Reseeds the generator dropout draws from. */
void ddp_model_seed_dropout(ddp_model *model, uint64_t seed);
/* The dropout generator itself (checkpoints save its state). */
ddp_rng *ddp_model_dropout_rng(ddp_model *model);

/* SyncBatchNorm for the whole model (PyTorch's
 * SyncBatchNorm.convert_sync_batchnorm): every BatchNorm2d computes its
 * training-mode statistics over all participants' batches through `sync`
 * (see ddp_sync_batch_norm; copied, sync->user borrowed until the model is
 * destroyed or unsynced). NULL makes them plain BatchNorm2d again. Names,
 * parameters, buffers and the state dict do not change, so checkpoints are
 * the same either way. Every participant must set it alike: its forward and
 * backward are collectives then. The nn layer is below comm; parallel.h's
 * ddp_model_convert_sync_batchnorm wires a process group in. */
void ddp_model_set_batch_norm_sync(ddp_model *model, const ddp_batch_norm_sync *sync);
bool ddp_model_batch_norm_synced(const ddp_model *model);

/* Called around the forward of each child of the root Sequential (the
 * model's top-level modules, PyTorch's `named_children()`), in order:
 * before it (after = false) and after it (after = true), with the child's
 * name ("conv1", "layer1"). A non-OK status stops the forward with it.
 * Children the forward fuses with the one before (a BatchNorm2d's ReLU and
 * MaxPool2d) get no call of their own: they have no parameters. FSDP's
 * per-module gather uses it (ddp/zero.h, stage 3); NULL removes it. One
 * hook per model; the hook must not run a forward itself. */
typedef ddp_status (*ddp_module_forward_hook)(ddp_model *model, const char *child, bool after,
                                              void *user);
void ddp_model_set_forward_hook(ddp_model *model, ddp_module_forward_hook fn, void *user);

/* Moves the model's parameters, gradients and buffers (running stats) to
 * `device` (model.to(device)): the flat buffers are copied there and every
 * parameter and buffer tensor views the new ones; the old ones are freed.
 * Counters stay on the host. A no-op on the model's own device. The input
 * of ddp_model_forward must then be on that device (ddp_to). Functions
 * that hand out host pointers into the state (the state dict, checkpoints,
 * data parallelism's buckets) need the model on the CPU: move it back
 * first (they say so when it is not). */
ddp_status ddp_model_to(ddp_model *model, ddp_device device);
ddp_device ddp_model_device(const ddp_model *model);

/* A replica of a finalized CPU model, for data parallelism in one process
 * (PyTorch's replicate(), which DataParallel runs every forward; here once,
 * by ddp_data_parallel_create): the same modules, names, loss, sample shape
 * and mode, whose parameter tensors view `model`'s flat parameter buffer in
 * place (no copy: what an optimizer step writes there, every replica reads)
 * with a gradient buffer of its own (zero, in model's layout) and buffers
 * and counters of its own (a copy of model's; the caller keeps them in
 * step). A replica's forward and backward may run on another thread than
 * model's and other replicas' while nothing writes the parameters. model
 * must outlive its replicas, and while it has any, ddp_model_to and
 * ddp_model_relayout refuse it (and a replica) with DDP_ERR_STATE. Free a
 * replica with ddp_model_destroy. *out NULL on failure. */
ddp_status ddp_model_replicate(ddp_model *model, ddp_model **out);

/* Zeroes the whole flat gradient buffer (optimizer.zero_grad(set_to_none=False)). */
void ddp_model_zero_grad(ddp_model *model);

/* torch.nn.utils.clip_grad_norm_(params, max_norm) with the L2 norm: computes
 * the total norm over all gradients (the squares summed in double) and
 * multiplies every gradient by ddp_clip_coefficient(norm, max_norm) when
 * that is below 1. Writes the norm before clipping to *total_norm (may be
 * NULL). A non-finite norm leaves the gradients unchanged and returns
 * DDP_ERR_RANGE (PyTorch's error_if_nonfinite=True), still writing the
 * norm. max_norm must be >= 0. */
ddp_status ddp_model_clip_grad_norm(ddp_model *model, double max_norm, double *total_norm);

/* The factor clip_grad_norm_ multiplies the gradients by, in PyTorch's
 * float32 order of operations: total_norm is a float32 tensor there, and
 * `max_norm / (total_norm + 1e-6)` is Tensor.__rtruediv__, i.e.
 * reciprocal(total_norm + 1e-6) * max_norm, each step rounded to float32,
 * then clamped to at most 1. `total_norm` here is the norm computed in
 * double; rounding it to float32 first is where PyTorch's float32 norm
 * (a float32 sum of squares per tensor, then the norm of those norms) can
 * differ: by a few units in its last place, so the factor differs by the
 * same relative amount (docs/nn.md, "Gradient clipping"). */
float ddp_clip_coefficient(double total_norm, double max_norm);

/* Runs the module tree on x (the root Sequential's forward), recording on
 * `tape`. *out is tape-owned (valid until ddp_tape_reset). In training mode
 * BatchNorm updates the running stats in place (once per call). */
ddp_status ddp_model_forward(ddp_model *model, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
/* The model's loss of the forward's output against target (mean reduction). */
ddp_status ddp_model_loss(ddp_model *model, ddp_tape *tape, ddp_tensor *output,
                          ddp_tensor *target, ddp_tensor **loss);
void ddp_model_set_loss(ddp_model *model, ddp_loss_kind kind);
ddp_loss_kind ddp_model_loss_kind(const ddp_model *model);
const char *ddp_loss_name(ddp_loss_kind kind); /* "mse", "cross_entropy", "nll", "none" */

/* ---- Introspection ------------------------------------------------------- */
/* Writes the module tree, one module per line with its PyTorch-style repr
 * ("(layer1): Sequential", "  (0): Conv2d(1, 16, kernel_size=5, stride=1, padding=2)"),
 * into buf (truncated, always NUL-terminated). Returns the length needed. */
size_t ddp_model_describe(const ddp_model *model, char *buf, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif /* DDP_NN_H */
