/* ddp tensors and autograd: dense contiguous tensors with a device field, ops
 * with forward and backward, and the tape that records them.
 *
 * The model of use (one training step):
 *
 *   ddp_tape_reset(tape);                      // forget last step, keep memory
 *   ddp_conv2d(tape, x, w, b, 1, 2, &y);       // ops allocate outputs from the tape
 *   ...
 *   ddp_cross_entropy(tape, logits, labels, &loss);
 *   ddp_backward(tape, loss);                  // grads accumulate (+=) into leaves
 *
 * Outputs of ops live in the tape's arena until the next ddp_tape_reset, so
 * after the first step a step allocates nothing. Leaf tensors (parameters,
 * inputs) are owned by whoever made them; their `grad` buffers too.
 * Every op validates its inputs and returns DDP_ERR_SHAPE / DDP_ERR_INVALID
 * with a message naming the op and the shapes; it never aborts. */
#ifndef DDP_TENSOR_H
#define DDP_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h> /* memcpy: the dtype conversions */

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. Compute is float32; labels are int64; the others exist for
 * communication and checkpoints. The values are stable (they go on the wire). */
typedef enum ddp_dtype {
  DDP_FLOAT32 = 0,
  DDP_FLOAT64 = 1,
  DDP_INT32 = 2,
  DDP_INT64 = 3,
  DDP_FLOAT16 = 4,
  DDP_BFLOAT16 = 5,
  DDP_UINT8 = 6,
  DDP_DTYPE_COUNT
} ddp_dtype;

size_t ddp_dtype_size(ddp_dtype dtype);
const char *ddp_dtype_name(ddp_dtype dtype); /* "float32", ... */

/* A run's arithmetic precision (ddp-train --precision; issue 42, mixed
 * precision): FP32, every op in float32 (the default); BF16 and FP16,
 * autocast's low-precision ops in that type with float32 accumulation;
 * TF32, float32 storage with the GPU's TF32 matrix math (opt-in only). */
typedef enum ddp_precision {
  DDP_PRECISION_FP32 = 0,
  DDP_PRECISION_BF16 = 1,
  DDP_PRECISION_FP16 = 2,
  DDP_PRECISION_TF32 = 3,
  DDP_PRECISION_COUNT
} ddp_precision;

/* float16 / bfloat16 <-> float32, one value at a time; inline, so that loops
 * over buffers vectorise (comm's reductions compute through them). Bit
 * manipulation after Fabian Giesen's half conversions: exact widening
 * (subnormals included, via one multiply by 2^112), narrowing with round to
 * nearest even; overflow gives infinity; NaNs stay NaN with their sign and
 * top payload bits, quieted (bit for bit what F16C's vcvtph2ps / vcvtps2ph
 * do; tests/comm/test_comm_reduce.c compares). Pure functions: no errors. */
static inline uint32_t ddp__f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float ddp__f32_from(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float ddp_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  /* Exponent rebias by scaling: (em << 13) read as a float is the half value
   * times 2^-112, also for subnormals (they become float subnormals). The
   * factor is 2^112 (0x1p112f, written in decimal for C++). */
  uint32_t scaled = ddp__f32_bits(ddp__f32_from(em << 13) * 5192296858534827628530496329220096.0f);
  /* Inf stays Inf; a NaN keeps its payload and becomes quiet. */
  uint32_t special = (em << 13) | 0x7f800000u | (em > 0x7c00u ? 0x400000u : 0u);
  uint32_t bits = em >= 0x7c00u ? special : scaled;
  return ddp__f32_from(bits | sign);
}

static inline uint16_t ddp_float_to_half(float f) {
  uint32_t u = ddp__f32_bits(f);
  uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= 0x47800000u) { /* >= 65536 (rounds to Inf), Inf or NaN */
    uint32_t nan = 0x7e00u | ((u >> 13) & 0x3ffu);
    out = u > 0x7f800000u ? nan : 0x7c00u;
  } else if (u < 0x38800000u) { /* below the smallest normal half, 2^-14 */
    /* Adding 0.5 makes the FPU round the mantissa (to nearest even) at the
     * subnormal half's last bit; the low bits are then the result. */
    const uint32_t magic = (127u - 15u + 23u - 10u + 1u) << 23;
    out = ddp__f32_bits(ddp__f32_from(u) + ddp__f32_from(magic)) - magic;
  } else {
    uint32_t mant_odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xfffu + mant_odd;
    out = u >> 13; /* a carry into the exponent rounds up to Inf correctly */
  }
  return (uint16_t)(out | (sign >> 16));
}

static inline float ddp_bf16_to_float(uint16_t h) { return ddp__f32_from((uint32_t)h << 16); }

static inline uint16_t ddp_float_to_bf16(float f) {
  uint32_t u = ddp__f32_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* The same conversions over buffers of n elements (src/tensor/convert.c),
 * bit for bit the single-value functions above, vectorised for the CPU
 * kernel family that runs (AVX-512F, F16C, else the plain loop). This is
 * the one implementation: the compression hooks and autocast call it.
 * dst and src must not overlap. Pure functions: no errors. */
void ddp_convert_f32_to_bf16(uint16_t *dst, const float *src, size_t n);
void ddp_convert_bf16_to_f32(float *dst, const uint16_t *src, size_t n);
void ddp_convert_f32_to_f16(uint16_t *dst, const float *src, size_t n);
void ddp_convert_f16_to_f32(float *dst, const uint16_t *src, size_t n);
/* dst[i] = src[i] rounded to `dtype` (DDP_BFLOAT16 or DDP_FLOAT16) and
 * widened back to float32: the float32 that holds the low-precision value
 * exactly. dst may equal src (in place); other dtypes copy. */
void ddp_convert_round_f32(float *dst, const float *src, size_t n, ddp_dtype dtype);

/* The family of CPU kernels this process runs: "avx512", "avx2" or
 * "generic", from the CPU and the environment variable DDP_CPU_KERNELS
 * (auto|generic|avx2|avx512; auto takes the best the CPU has;
 * docs/tensor.md). Decided at the first call or the first kernel, then
 * fixed. */
const char *ddp_cpu_kernels(void);

typedef enum ddp_device_type {
  DDP_DEVICE_CPU = 0,
  DDP_DEVICE_CUDA = 1,
  DDP_DEVICE_TYPE_COUNT
} ddp_device_type;

typedef struct ddp_device {
  ddp_device_type type;
  int32_t index; /* GPU ordinal; 0 for the CPU */
} ddp_device;

#define DDP_CPU ((ddp_device){DDP_DEVICE_CPU, 0})
#define DDP_CUDA(i) ((ddp_device){DDP_DEVICE_CUDA, (i)})

/* ---- Devices (docs/cuda.md) ----------------------------------------------
 * A CUDA build (DDP_CUDA, the toolkit found at build time) runs everywhere:
 * without a driver or a GPU it simply has no CUDA device. */
/* Whether this library was built with the CUDA backend. */
bool ddp_cuda_built(void);
/* CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 without
 * a CUDA build, a driver or a device. Never aborts. */
int ddp_cuda_device_count(void);
/* Why ddp_cuda_device_count() is 0 ("this build has no CUDA backend",
 * "no CUDA device", the driver's message), or NULL when it is not. */
const char *ddp_cuda_unavailable_reason(void);
/* TensorFloat-32 for the float32 matmuls and convolutions of every GPU
 * (ddp-train --precision tf32): torch.backends.cuda.matmul.allow_tf32 and
 * torch.backends.cudnn.allow_tf32 together. Off by default, as in PyTorch
 * 2.x's matmuls: float32 stays float32 unless a run opts in. Process-wide;
 * a GEMM reads it at each call, a convolution when cuDNN first plans its
 * geometry with that setting. Allowing it in a build without CUDA is
 * DDP_ERR_UNSUPPORTED; refusing it always succeeds. */
ddp_status ddp_cuda_allow_tf32(bool allow);
bool ddp_cuda_tf32_allowed(void);
/* Parses "cpu", "cuda" (= cuda:0) or "cuda:N" (as torch.device). Errors
 * name the text. Does not check that the device exists. */
ddp_status ddp_device_parse(const char *text, ddp_device *out);
/* "cpu" or "cuda:N" into buf; returns buf. */
const char *ddp_device_str(ddp_device device, char *buf, size_t bytes);
#define DDP_DEVICE_STR_BYTES 24
static inline bool ddp_device_equal(ddp_device a, ddp_device b) {
  return a.type == b.type && a.index == b.index;
}
/* DDP_OK when `device` exists in this process (the CPU always), else
 * DDP_ERR_UNSUPPORTED (no backend) or DDP_ERR_INVALID (no such ordinal),
 * saying which devices there are. */
ddp_status ddp_device_check(ddp_device device);
/* The device `ptr` points into, for APIs that take raw pointers (comm's:
 * docs/comm.md, "Buffers on devices"): cuda:N for memory of GPU N that
 * this process allocated or mapped (cudaMalloc, managed memory), the CPU
 * for everything else (host memory, pinned or not, and NULL). Asks CUDA
 * only where this process has a CUDA device (about a microsecond); without
 * a CUDA build or a device it is the CPU at once. Never fails. */
ddp_device ddp_pointer_device(const void *ptr);
/* Waits until the work queued on `device` is done; reports a failed kernel
 * or copy (asynchronous on a GPU) with the device's name, and a loss's
 * target out of range found on the GPU since the last synchronize
 * (DDP_ERR_RANGE, "cuda:0: cross_entropy: target[37] = 10 is out of range
 * for 10 classes": the GPU's losses check their targets without waiting,
 * docs/cuda.md). No-op on the CPU. */
ddp_status ddp_device_synchronize(ddp_device device);
/* The device of a rank (torchrun's LOCAL_RANK within LOCAL_WORLD_SIZE
 * ranks on this node): cuda:(local_rank % count). With fewer devices than
 * local ranks it says once on stderr that ranks share a device. Fails
 * when there is no CUDA device. */
ddp_status ddp_default_cuda_device(int local_rank, int local_world, ddp_device *out);
/* The PCI address of a GPU, as sysfs names it ("0000:3b:00.0": lower case,
 * a 4-digit domain), from cudaDeviceGetPCIBusId: what locates its NUMA node
 * and nearby CPUs (/sys/bus/pci/devices/<address>/). DDP_ERR_UNSUPPORTED
 * for the CPU, a build without CUDA or no device; DDP_ERR_INVALID for an
 * ordinal this process does not have. */
ddp_status ddp_device_pci_address(ddp_device device, char *buf, size_t bytes);
/* raw ("0000:3B:00.0" from CUDA, "00000000:3B:00.0" from NVML) as sysfs
 * writes it into buf ("0000:3b:00.0"); DDP_ERR_INVALID names text that is
 * not a PCI address. */
ddp_status ddp_pci_address_normalize(const char *raw, char *buf, size_t bytes);

/* Pinned (page-locked) host memory for copies to and from `device`, a GPU
 * (PyTorch's pin_memory): copies through it are asynchronous. *out NULL
 * on failure (DDP_ERR_UNSUPPORTED for the CPU or a build without CUDA).
 * Free with ddp_pinned_free (NULL ok), which waits for the device: keep
 * pinned buffers for the run, not per step. */
ddp_status ddp_pinned_alloc(ddp_device device, size_t bytes, void **out);
void ddp_pinned_free(void *ptr);
/* Copies `bytes` from src on src_device to dst on dst_device, one of them
 * a GPU and the other that GPU or the host, queued on the GPU's stream
 * without waiting (copy_(non_blocking=True)): host memory must come from
 * ddp_pinned_alloc (DDP_ERR_INVALID otherwise). Read a copy to the host,
 * or rewrite a copy's source, only after ddp_device_synchronize. Allowed
 * inside a CUDA graph capture. */
ddp_status ddp_device_copy_async(ddp_device dst_device, void *dst, ddp_device src_device,
                                 const void *src, size_t bytes);

/* Copies `bytes` from src on src_device to dst on dst_device, any two
 * devices, host memory pageable or pinned (ddp_tensor_copy's rules on raw
 * memory): a copy to the host is complete on return, one to a device is
 * queued on its stream. */
ddp_status ddp_device_copy(ddp_device dst_device, void *dst, ddp_device src_device,
                           const void *src, size_t bytes);

/* A staging area for host-to-device copies of batches: each upload copies
 * host buffers into the next of two pinned buffers and queues their copies
 * to the device, returning at once; a pinned buffer is refilled only after
 * the device has copied out of it. On the CPU an upload is a memcpy.
 * Created with ddp_device_stage_create, freed with _destroy (NULL ok;
 * waits for the copies). */
typedef struct ddp_device_stage ddp_device_stage;
ddp_status ddp_device_stage_create(ddp_device device, ddp_device_stage **out);
/* dst[i] (the stage's device) = src[i] (host memory, bytes[i]) for i < n.
 * The sources may be reused on return; the destinations are written by
 * the device's later work in order. */
ddp_status ddp_device_stage_upload(ddp_device_stage *stage, int n, void *const *dst,
                                   const void *const *src, const size_t *bytes);
void ddp_device_stage_destroy(ddp_device_stage *stage);

/* CUDA graphs (docs/cuda.md, "CUDA graphs"): the work one thread queues on
 * a GPU between begin and end is recorded, not run, and each replay runs
 * it again with the same kernels, arguments and addresses, one launch for
 * the lot (a small model's step is bound by kernel launches):
 *
 *   for (int i = 0; i < 3; i++) step();          // warm-up: memory, handles
 *   ddp_cuda_graph_begin(dev);
 *   step_without_optimizer();                    // recorded
 *   ddp_cuda_graph *g;
 *   ddp_cuda_graph_end(dev, &g);
 *   for (...) { refill_inputs(); ddp_cuda_graph_replay(g); optimizer_step(); }
 *   ddp_cuda_graph_destroy(g);
 *
 * While capturing, the thread must not wait for the device: a
 * synchronize, a copy to the host, a copy from pageable memory, a
 * cudaMalloc (memory the caching allocator does not hold yet: run the
 * step eagerly first) are refused with DDP_ERR_STATE saying so, and the
 * capture then fails at end. Host-side effects happen once, at capture
 * (BatchNorm's num_batches_tracked, dropout's masks): a replay does not
 * repeat them. Whatever the captured work reads or writes must stay
 * allocated while the graph lives (inputs are refilled in place); memory
 * freed during the capture is kept for the graph until it is destroyed. */
typedef struct ddp_cuda_graph ddp_cuda_graph;
/* Starts capturing this thread's work on `device` (a GPU;
 * DDP_ERR_UNSUPPORTED for the CPU or without CUDA). One capture per
 * thread; DDP_ERR_STATE when this thread captures already. */
ddp_status ddp_cuda_graph_begin(ddp_device device);
/* Ends this thread's capture on `device` and makes the graph (*out, free
 * with ddp_cuda_graph_destroy). When anything was refused or failed during
 * the capture, nothing is made (*out NULL) and the first such error is
 * returned; the device works on as before. */
ddp_status ddp_cuda_graph_end(ddp_device device, ddp_cuda_graph **out);
/* Queues one replay on the graph's device's stream and returns (errors in
 * the replayed work surface at the next synchronize). */
ddp_status ddp_cuda_graph_replay(ddp_cuda_graph *graph);
/* Frees the graph (NULL ok) and gives its memory back to the cache; a
 * replay still running finishes first. */
void ddp_cuda_graph_destroy(ddp_cuda_graph *graph);
#define DDP_MAX_DIMS 6

/* Tensor flags. */
#define DDP_TENSOR_REQUIRES_GRAD 0x1u /* backward computes a gradient for it */
#define DDP_TENSOR_PARAM 0x2u         /* a module parameter: grad hooks fire for it */
#define DDP_TENSOR_OWNS_DATA 0x4u     /* ddp_tensor_destroy frees data and the struct */
#define DDP_TENSOR_OWNS_GRAD 0x8u     /* grad was allocated by ddp_tensor_ensure_grad */
/* (bits from 0x100 up are the library's own bookkeeping) */

/* A dense, contiguous, row-major tensor. `data` holds numel elements of dtype
 * on `device`. `grad` (float32, same shape) is NULL until backward needs it,
 * except for parameters, whose grad is a view into the model's flat gradient
 * buffer. Gradients accumulate: backward adds into grad. */
typedef struct ddp_tensor {
  ddp_dtype dtype;
  ddp_device device;
  int32_t ndim;
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  void *data;
  float *grad;
  uint32_t flags;
  int32_t param_index; /* position in the owning model's parameter list; -1 if none */
  /* Autograd bookkeeping, owned by the tape: */
  int32_t node;        /* index of the tape node that produced it; -1 for leaves */
  int32_t pending;     /* intermediates: recorded consumers whose backward has not run
                        * (a leaf's counts are kept per tape: ddp__tape_leaf_pending) */
} ddp_tensor;

static inline float *ddp_tensor_f32(const ddp_tensor *t) { return (float *)t->data; }
static inline int64_t *ddp_tensor_i64(const ddp_tensor *t) { return (int64_t *)t->data; }

/* Initialises a caller-held tensor as a view over caller-owned memory (no
 * allocation; use it to feed each step's batch). Fails on a bad shape. */
ddp_status ddp_tensor_wrap(ddp_tensor *t, ddp_dtype dtype, int ndim, const int64_t *shape,
                           void *data);
/* Allocates a zeroed CPU tensor on the heap; free with ddp_tensor_destroy. */
ddp_status ddp_tensor_create(ddp_tensor **out, ddp_dtype dtype, int ndim, const int64_t *shape);
/* ddp_tensor_create on `device` (zeroed device memory from the caching
 * allocator for a GPU). */
ddp_status ddp_tensor_create_on(ddp_tensor **out, ddp_dtype dtype, int ndim,
                                const int64_t *shape, ddp_device device);
/* Copies src's elements into dst: same dtype and element count, any two
 * devices (the shapes may differ). A copy to the host is complete on
 * return; one to a device is queued on its stream. */
ddp_status ddp_tensor_copy(ddp_tensor *dst, const ddp_tensor *src);
/* Frees a tensor from ddp_tensor_create (and its grad if it owns it). NULL ok. */
void ddp_tensor_destroy(ddp_tensor *t);
/* Allocates t->grad (zeroed, on t's device, owned by t) if it has none. A wrapped
 * tensor's grad is released with ddp_tensor_free_grad. */
ddp_status ddp_tensor_ensure_grad(ddp_tensor *t);
void ddp_tensor_free_grad(ddp_tensor *t);
/* Writes "(8,3,28,28)" into buf; returns buf. Handy in error messages. */
const char *ddp_tensor_shape_str(const ddp_tensor *t, char *buf, size_t bytes);
#define DDP_SHAPE_STR_BYTES 96
bool ddp_tensor_same_shape(const ddp_tensor *a, const ddp_tensor *b);

/* ---- The tape ------------------------------------------------------------ */
typedef struct ddp_tape ddp_tape;

/* Called when a parameter's gradient is final for this backward pass: every op
 * that used the parameter has added its contribution. Runs on the thread that
 * calls ddp_backward, in the order gradients become final. */
typedef void (*ddp_grad_hook_fn)(ddp_tensor *param, void *user);

/* Creates a tape whose arena starts with `arena_bytes` (it grows as needed
 * during the first step). Destroy with ddp_tape_destroy (NULL ok). */
ddp_status ddp_tape_create(ddp_tape **out, size_t arena_bytes);
void ddp_tape_destroy(ddp_tape *tape);
/* Starts a new step: forgets the recorded ops and every tensor the tape
 * allocated. Keeps the memory, so identical steps do not allocate. */
void ddp_tape_reset(ddp_tape *tape);
/* With grad disabled (evaluation, torch.no_grad) ops record nothing. */
void ddp_tape_set_grad_enabled(ddp_tape *tape, bool enabled);
bool ddp_tape_grad_enabled(const ddp_tape *tape);
/* Installs the hook fired for each DDP_TENSOR_PARAM leaf (NULL removes it). */
void ddp_tape_set_grad_hook(ddp_tape *tape, ddp_grad_hook_fn fn, void *user);
/* Number of ops recorded since the last reset. */
int ddp_tape_num_nodes(const ddp_tape *tape);

/* Scratch memory from the tape's arena, valid until the next reset. */
void *ddp_tape_scratch(ddp_tape *tape, size_t bytes);

/* Runs backward from a scalar (numel 1) float32 loss: seeds d(loss) = 1, walks
 * the recorded ops in reverse, accumulates into leaves' grads (allocating a
 * leaf's grad from the heap if it requires grad and has none), and fires the
 * grad hook for each parameter as its gradient becomes final. */
ddp_status ddp_backward(ddp_tape *tape, ddp_tensor *loss);

/* ---- Ops ---------------------------------------------------------------
 * All take float32 tensors on one device unless said otherwise, write a new
 * tape-owned tensor to *out, and record themselves when grad is enabled and
 * an input requires grad. Shapes in comments: (N, C, H, W) and so on. */

/* a (M, K) @ b (K, N) -> (M, N). */
ddp_status ddp_matmul(ddp_tape *tape, ddp_tensor *a, ddp_tensor *b, ddp_tensor **out);
/* x (N, in) , weight (out, in), bias (out) or NULL -> (N, out); y = x W^T + b. */
ddp_status ddp_linear(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                      ddp_tensor **out);
/* x (N, C, H, W), weight (O, C, KH, KW), bias (O) or NULL -> (N, O, H', W'),
 * H' = (H + 2*padding - KH) / stride + 1. Zero padding, dilation 1, groups 1. */
ddp_status ddp_conv2d(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                      int stride, int padding, ddp_tensor **out);
/* x (N, C, H, W) -> (N, C, H', W'), H' = (H - kernel) / stride + 1 (floor,
 * no padding). stride 0 means stride = kernel. Ties pick the first maximum. */
ddp_status ddp_max_pool2d(ddp_tape *tape, ddp_tensor *x, int kernel, int stride,
                          ddp_tensor **out);
/* ddp_max_pool2d(relu(x)) as one op, without materialising relu(x): the
 * same values (a window whose max is -0.0 may give -0.0 for +0.0) and
 * gradients. nn runs a Sequential's ReLU followed by MaxPool2d through it. */
ddp_status ddp_relu_max_pool2d(ddp_tape *tape, ddp_tensor *x, int kernel, int stride,
                               ddp_tensor **out);
/* Batch normalisation over (N, C, H, W) or (N, C), per channel C.
 * weight, bias: (C) or NULL (affine=False). running_mean, running_var: (C) or
 * NULL (track_running_stats=False). Training: normalise with the batch's mean
 * and biased variance; update running_mean = (1-m)*running_mean + m*mean and
 * running_var with the unbiased variance, as PyTorch does; increment
 * *num_batches_tracked when not NULL. Eval: normalise with the running stats. */
ddp_status ddp_batch_norm(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight, ddp_tensor *bias,
                          ddp_tensor *running_mean, ddp_tensor *running_var,
                          int64_t *num_batches_tracked, bool training, float momentum,
                          float eps, ddp_tensor **out);
/* How a synchronized batch norm sums its per-channel statistics across the
 * replicas that share one batch (the ranks of a process group). The tensor
 * layer knows nothing of process groups: the layer that does fills this in
 * (parallel.h: ddp_batch_norm_sync_for_group), and a test can sum across
 * threads with anything else.
 * allreduce_sum sums buf[0..count) elementwise over every participant, in
 * place, and returns DDP_OK or a status with the last-error message set. It
 * is a collective: every participant calls it the same number of times, in
 * the same order, with the same count, so it must not be skipped on one
 * rank; it may block (with the group's timeout) and is called on the thread
 * that runs the op or the backward. */
typedef struct ddp_batch_norm_sync {
  ddp_status (*allreduce_sum)(void *user, double *buf, size_t count);
  void *user; /* borrowed; must outlive every forward and backward using it */
} ddp_batch_norm_sync;

/* SyncBatchNorm: ddp_batch_norm whose training-mode statistics are those of
 * every participant's batch together, as if the batches were concatenated.
 * The forward sums each channel's sum, sum of squares and element count
 * across participants in one allreduce_sum call (2C + 1 doubles) and
 * normalises with the global mean and biased variance; the running stats
 * are updated with the global mean and unbiased variance (count of all
 * ranks), identically on every rank. The backward adds this rank's share to
 * dweight and dbias (sum them across ranks, as data parallelism does, to get
 * the concatenated batch's) and, when the input needs a gradient, sums the
 * per-channel sum(dy) and sum(dy * (x - mean)) across participants in one
 * call (2C doubles), so dx is this rank's slice of the concatenated batch's.
 * Ranks may hold different batch sizes, even 0, as long as all together hold
 * more than one value per channel. In evaluation it is ddp_batch_norm and
 * does not communicate; sync NULL is ddp_batch_norm too. */
ddp_status ddp_sync_batch_norm(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                               ddp_tensor *bias, ddp_tensor *running_mean,
                               ddp_tensor *running_var, int64_t *num_batches_tracked,
                               bool training, float momentum, float eps,
                               const ddp_batch_norm_sync *sync, ddp_tensor **out);
/* ddp_max_pool2d(ddp_relu(ddp_sync_batch_norm(x, ...)), kernel, stride) as
 * one op for 4-D x: the normalised values are computed inside the pooling
 * and never stored, so the block reads x twice (statistics, pooling) and
 * writes only the pooled output. The same values, gradients, running
 * statistics and cross-rank sums as the three ops (a window whose max is
 * -0.0 may give -0.0 for +0.0). nn runs a Sequential's BatchNorm2d, ReLU,
 * MaxPool2d through it. */
ddp_status ddp_batch_norm_relu_max_pool2d(ddp_tape *tape, ddp_tensor *x, ddp_tensor *weight,
                                          ddp_tensor *bias, ddp_tensor *running_mean,
                                          ddp_tensor *running_var, int64_t *num_batches_tracked,
                                          bool training, float momentum, float eps,
                                          const ddp_batch_norm_sync *sync, int kernel, int stride,
                                          ddp_tensor **out);
ddp_status ddp_relu(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
ddp_status ddp_sigmoid(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
ddp_status ddp_tanh(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);
/* Inverted dropout: in training, zero each element with probability p and scale
 * the rest by 1/(1-p); identity when !training or p == 0. */
ddp_status ddp_dropout(ddp_tape *tape, ddp_tensor *x, float p, bool training, ddp_rng *rng,
                       ddp_tensor **out);
/* Channel dropout: zero whole (n, c) feature maps of (N, C, H, W); for other
 * ranks it behaves as PyTorch's F.dropout2d does (see docs/tensor.md). */
ddp_status ddp_dropout2d(ddp_tape *tape, ddp_tensor *x, float p, bool training, ddp_rng *rng,
                         ddp_tensor **out);
/* Same data, new shape (one entry may be -1). The output is a view: it shares
 * x's data (ops never write their inputs in place) but has its own grad. */
ddp_status ddp_reshape(ddp_tape *tape, ddp_tensor *x, int ndim, const int64_t *shape,
                       ddp_tensor **out);
/* Flattens dims [start_dim, ndim) into one: (N, C, H, W), 1 -> (N, C*H*W). */
ddp_status ddp_flatten(ddp_tape *tape, ddp_tensor *x, int start_dim, ddp_tensor **out);
/* Elementwise a + b, same shapes. */
ddp_status ddp_add(ddp_tape *tape, ddp_tensor *a, ddp_tensor *b, ddp_tensor **out);
/* x on `device` (torch's x.to(device)): a copy whose backward copies the
 * gradient back to x's device, so one model's layers can live on several
 * devices. Any dtype (int64 labels too; only float32 carries a gradient).
 * On x's own device the result is x itself, as in PyTorch. Fails when the
 * device does not exist here. */
ddp_status ddp_to(ddp_tape *tape, ddp_tensor *x, ddp_device device, ddp_tensor **out);
/* log_softmax over the last dim of (N, C). */
ddp_status ddp_log_softmax(ddp_tape *tape, ddp_tensor *x, ddp_tensor **out);

/* ---- Autocast (docs/tensor.md, "Mixed precision") -------------------------
 * torch.autocast("cpu", dtype) for ddp's ops: inside a region entered with
 * DDP_PRECISION_BF16 (FP16) on the calling thread, linear, matmul and
 * conv2d (PyTorch's CPU lower_precision_fp list) round their inputs,
 * weights and bias to bfloat16 (float16), multiply with float32
 * accumulation and round the output to bfloat16 (float16); the losses
 * (PyTorch's fp32 list) compute in float32; every other op computes in its
 * input's precision, as PyTorch's type promotion does. Parameters stay
 * float32, and their gradients arrive in float32.
 *
 * Storage, as a first step: a low-precision activation is a float32 tensor
 * whose values are exactly bfloat16 (float16) values, marked as such
 * (ddp_tensor_values_dtype); ops accept it as any float32 tensor. The
 * values are PyTorch's; the memory is float32's (twice a 2-byte tensor).
 *
 *   ddp_autocast_enter(DDP_PRECISION_BF16);
 *   forward(...); loss(...);                     // as torch.autocast's body
 *   ddp_autocast_exit();
 *   ddp_backward(tape, loss);                    // outside, as PyTorch advises
 *
 * Regions are per thread and nest: enter pushes a precision, exit pops it,
 * and the ops follow the innermost one. DDP_PRECISION_FP32 is a region
 * with autocast off (torch.autocast(enabled=False) inside an enabled one);
 * TF32 is a GPU matrix-math mode and, on the CPU, computes as FP32. The
 * region changes CPU tensors' ops only; ops on GPU tensors compute as
 * without it (the GPU's autocast is issue 42's GPU half). The backward of
 * an op recorded in a region uses the precision it was recorded with,
 * wherever it runs. */

/* Opens a region of `precision` on this thread. DDP_ERR_INVALID for a
 * value outside ddp_precision; DDP_ERR_STATE beyond DDP_AUTOCAST_MAX_DEPTH
 * nested regions (a missing exit). Allocates nothing. */
#define DDP_AUTOCAST_MAX_DEPTH 16
ddp_status ddp_autocast_enter(ddp_precision precision);
/* Closes this thread's innermost region, restoring the one outside it.
 * Leaving the outermost region forgets the cast cache's contents (its
 * memory is kept for the next region, so steady-state steps do not
 * allocate). DDP_ERR_STATE when no region is open. */
ddp_status ddp_autocast_exit(void);
/* The innermost region's precision on this thread; DDP_PRECISION_FP32
 * outside any region. */
ddp_precision ddp_autocast_precision(void);
/* Number of regions open on this thread (0 outside any). */
int ddp_autocast_depth(void);
/* The cast cache (PyTorch's autocast weight cache): inside a region, the
 * rounded copy of a leaf that requires grad (a parameter) is made at its
 * first use and reused by later ops of the region, keyed by the tensor,
 * its data pointer and size. Like PyTorch's, it does not see a parameter
 * changed in place inside the region (an optimizer step inside autocast):
 * call ddp_autocast_cache_clear after such a change. Leaving the outermost
 * region clears it. The thread's cache memory is freed at thread exit, or
 * now by ddp_autocast_cache_free (which also clears). */
void ddp_autocast_cache_clear(void);
void ddp_autocast_cache_free(void);
/* The precision of t's values: DDP_BFLOAT16 or DDP_FLOAT16 for an output
 * of a low-precision op under autocast and the ops that carry it on
 * (PyTorch's output dtype), else t->dtype. */
ddp_dtype ddp_tensor_values_dtype(const ddp_tensor *t);

/* Losses, mean reduction, scalar output (shape ()). */
/* mean((input - target)^2) over all elements; same shapes. */
ddp_status ddp_mse_loss(ddp_tape *tape, ddp_tensor *input, ddp_tensor *target, ddp_tensor **out);
/* logits (N, C) float32, target (N) int64 class indices in [0, C). */
ddp_status ddp_cross_entropy(ddp_tape *tape, ddp_tensor *logits, ddp_tensor *target,
                             ddp_tensor **out);
/* log_probs (N, C), target (N) int64: -mean(log_probs[i, target[i]]). */
ddp_status ddp_nll_loss(ddp_tape *tape, ddp_tensor *log_probs, ddp_tensor *target,
                        ddp_tensor **out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_TENSOR_H */
