/* Convolution through cuDNN (cudnn.h, docs/cuda.md "Convolution"): the
 * choice between cuDNN and im2col + cuBLAS (DDP_CUDA_CONV), the cuDNN
 * handle of each device, a cache of descriptors per geometry, and the
 * forward and backward calls.
 *
 * Float32 as PyTorch computes it with TF32 off: NCHW tensors, float
 * compute type, cross-correlation (what a "convolution" layer computes),
 * CUDNN_FMA_MATH (no tensor-core TF32 or half-precision paths). The
 * algorithms are fixed, not searched, and deterministic (the same bits
 * every run, as every other kernel of the backend):
 *   forward      IMPLICIT_PRECOMP_GEMM: an implicit GEMM (no column matrix
 *                in memory, the point of using cuDNN at all: im2col's
 *                columns are what made batch 1024 memory-bound) with the
 *                offsets precomputed in a small workspace; every forward
 *                algorithm is deterministic, this one is the usual choice
 *                for small filters in float32;
 *   dX           BWD_DATA_ALGO_1 and
 *   dW           BWD_FILTER_ALGO_1: the deterministic ones of the implicit
 *                GEMM family (cuDNN documents ALGO_0 of both, and ALGO_3
 *                of dW, as non-deterministic: they sum with atomics).
 * No Winograd or FFT: their results differ from the direct sum by more
 * than rounding (transforms), and they are not what PyTorch's float32
 * baseline means.
 * The bias (forward) is added by cudnnAddTensor, elementwise; its gradient
 * by conv.cu's fixed-order reduction (the im2col backward with only db
 * asked for), not cudnnConvolutionBackwardBias, whose order cuDNN does not
 * document. A geometry cuDNN refuses (not supported) goes through im2col,
 * per part of the call. */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/tensor.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/kernels_cuda.h" /* from_half: widening the 16-bit outputs */
#include "tensor/cuda/runtime.h"

/* ---- The choice ------------------------------------------------------------ */

enum choice { CHOICE_AUTO, CHOICE_CUDNN, CHOICE_IM2COL, CHOICE_INVALID };

static pthread_once_t env_once = PTHREAD_ONCE_INIT;
static enum choice env_choice;
static char env_value[64];         /* DDP_CUDA_CONV as set, for messages */
static atomic_int forced = -1;     /* an enum choice from ddp__cuda_conv_force, or -1 */

static enum choice parse_choice(const char *name) {
  if (!name || !*name || strcmp(name, "auto") == 0) return CHOICE_AUTO;
  if (strcmp(name, "cudnn") == 0) return CHOICE_CUDNN;
  if (strcmp(name, "im2col") == 0) return CHOICE_IM2COL;
  return CHOICE_INVALID;
}

static void read_env(void) {
  const char *v = getenv("DDP_CUDA_CONV");
  env_choice = parse_choice(v);
  snprintf(env_value, sizeof env_value, "%s", v ? v : "");
}

static enum choice current_choice(void) {
  pthread_once(&env_once, read_env);
  const int f = atomic_load_explicit(&forced, memory_order_acquire);
  return f >= 0 ? (enum choice)f : env_choice;
}

ddp_status ddp__cuda_conv_force(const char *name) {
  if (!name) {
    atomic_store_explicit(&forced, -1, memory_order_release);
    return DDP_OK;
  }
  const enum choice c = parse_choice(name);
  if (c == CHOICE_INVALID)
    return ddp_error(DDP_ERR_INVALID,
                     "convolution implementation \"%s\": expected auto, cudnn or im2col", name);
#ifndef DDP_HAVE_CUDNN
  if (c == CHOICE_CUDNN)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "convolution implementation cudnn: this build has no cuDNN (CMake did "
                     "not find it)");
#endif
  atomic_store_explicit(&forced, (int)c, memory_order_release);
  return DDP_OK;
}

#ifdef DDP_HAVE_CUDNN
static cudnnHandle_t current_handle(bool report);
#endif

/* Whether the current device has a cuDNN handle (making it if needed),
 * quietly: auto's question, asked by every convolution, leaves the
 * thread's last error alone. */
static bool cudnn_usable(void) {
#ifdef DDP_HAVE_CUDNN
  return current_handle(false) != NULL;
#else
  return false;
#endif
}

ddp_status ddp__cuda_conv_pick(bool *use_cudnn) {
  *use_cudnn = false;
  switch (current_choice()) {
  case CHOICE_IM2COL: return DDP_OK;
  case CHOICE_AUTO: *use_cudnn = cudnn_usable(); return DDP_OK;
  case CHOICE_CUDNN:
#ifdef DDP_HAVE_CUDNN
    if (!ddp__cuda_cudnn())
      return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "convolution with cudnn chosen");
    *use_cudnn = true;
    return DDP_OK;
#else
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "DDP_CUDA_CONV=cudnn: this build has no cuDNN (CMake did not find it); "
                     "unset it or say im2col");
#endif
  case CHOICE_INVALID: break;
  }
  return ddp_error(DDP_ERR_INVALID, "DDP_CUDA_CONV=\"%s\": expected auto, cudnn or im2col",
                   env_value);
}

ddp_status ddp__cuda_conv_pick_pass(bool backward, bool dx_wanted, const ddp__conv2d_geom *g,
                                    bool *use_cudnn) {
  DDP_TRY(ddp__cuda_conv_pick(use_cudnn));
  if (current_choice() != CHOICE_AUTO || !*use_cudnn || !backward) return DDP_OK;
  const double col_bytes = 4.0 * (double)g->n * (double)(g->c * g->kh * g->kw) *
                           (double)(g->oh * g->ow);
  *use_cudnn = dx_wanted && col_bytes > 128.0 * (1 << 20);
  return DDP_OK;
}

const char *ddp__cuda_conv_impl(void) {
  switch (current_choice()) {
  case CHOICE_IM2COL: return "im2col";
  case CHOICE_CUDNN: return "cudnn";
  case CHOICE_AUTO: return cudnn_usable() ? "auto" : "im2col";
  case CHOICE_INVALID: break;
  }
  return "invalid";
}

#ifndef DDP_HAVE_CUDNN

const char *ddp__cudnn_unavailable_reason(void) { return "this build has no cuDNN"; }

#else /* DDP_HAVE_CUDNN */

/* ---- Errors ------------------------------------------------------------------ */

ddp_status ddp__cudnn_check(cudnnStatus_t status, const char *what) {
  if (status == CUDNN_STATUS_SUCCESS) return DDP_OK;
  ddp_status st;
  switch (CUDNN_STATUS_CATEGORY(status)) {
  case CUDNN_STATUS_BAD_PARAM: st = DDP_ERR_INVALID; break;
  case CUDNN_STATUS_NOT_SUPPORTED: st = DDP_ERR_UNSUPPORTED; break;
  default: st = DDP_ERR_IO; break;
  }
  if (status == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED)
    st = DDP_ERR_NOMEM;
  /* cuDNN's own account of the last error of this thread, often naming
   * the parameter or the sub-library at fault */
  char detail[256] = "";
  cudnnGetLastErrorString(detail, sizeof detail);
  return ddp_error(st, "cuda:%d: %s: %s%s%s%s", ddp__cuda_current_device(), what,
                   cudnnGetErrorString(status), detail[0] ? " (" : "", detail,
                   detail[0] ? ")" : "");
}

/* Whether a status means "this configuration is not supported", the one
 * failure that sends a call to im2col instead. */
static bool refused(cudnnStatus_t status) {
  return CUDNN_STATUS_CATEGORY(status) == CUDNN_STATUS_NOT_SUPPORTED;
}

/* ---- Handles, one per device ------------------------------------------------
 * Made on the first convolution on the device (cudnnCreate loads cuDNN's
 * sub-libraries: the slow part, once) and kept until the process ends,
 * bound to the device's compute stream, which never changes. A cuDNN
 * handle must not be used by two threads at once, so each device's calls
 * hold its lock (uncontended in practice: one thread drives a device). */
typedef struct cudnn_dev {
  atomic_int state;     /* 0 not tried, 1 made, -1 failed */
  cudnnHandle_t handle;
  pthread_mutex_t lock; /* held around every call on the handle */
  ddp_status failure;   /* state -1: why */
  char reason[512];
} cudnn_dev;

static pthread_once_t devs_once = PTHREAD_ONCE_INIT;
static cudnn_dev *devs; /* n_devs of them, never freed */
static int n_devs;
static pthread_mutex_t make_lock = PTHREAD_MUTEX_INITIALIZER;

static void make_devs(void) {
  const int n = ddp__cuda_device_count();
  if (n <= 0) return;
  devs = ddp_calloc((size_t)n, sizeof *devs);
  if (!devs) return;
  for (int i = 0; i < n; i++) pthread_mutex_init(&devs[i].lock, NULL);
  n_devs = n;
}

/* The current device's entry, or NULL (with the error set when `report`). */
static cudnn_dev *current_cudnn_dev(bool report) {
  pthread_once(&devs_once, make_devs);
  const int d = ddp__cuda_current_device();
  if (d >= 0 && d < n_devs) return &devs[d];
  if (!report) return NULL;
  if (ddp__cuda_device_count() == 0)
    ddp_error(DDP_ERR_UNSUPPORTED, "cuda:%d: cuDNN: CUDA is unavailable: %s", d,
              ddp__cuda_unavailable_reason());
  else
    ddp_error(DDP_ERR_NOMEM, "cuda:%d: cuDNN: cannot allocate the per-device state", d);
  return NULL;
}

static ddp_status make_handle(cudnn_dev *e) {
  const int d = ddp__cuda_current_device();
  cudaStream_t stream = ddp__cuda_stream();
  if (!stream) /* the device's own error waits for the next synchronize */
    return ddp_error(DDP_ERR_IO, "cuda:%d: cuDNN: the device's compute stream is unavailable", d);
  ddp_status st = ddp__cudnn_check(cudnnCreate(&e->handle), "cudnnCreate");
  if (st == DDP_OK) {
    st = ddp__cudnn_check(cudnnSetStream(e->handle, stream), "cudnnSetStream");
    if (st != DDP_OK) (void)cudnnDestroy(e->handle);
  }
  if (st != DDP_OK) {
    e->handle = NULL;
    /* A CUDA error cuDNN met while starting may sit in this thread's last
     * error, where the next synchronize would take it for a failed kernel
     * (auto goes on with im2col as if nothing happened). */
    (void)cudaGetLastError();
  }
  return st;
}

/* The current device's handle, made on first use; NULL when it cannot be
 * made, with the error set when `report`. */
static cudnnHandle_t current_handle(bool report) {
  cudnn_dev *e = current_cudnn_dev(report);
  if (!e) return NULL;
  int state = atomic_load_explicit(&e->state, memory_order_acquire);
  if (state == 0) {
    pthread_mutex_lock(&make_lock);
    state = atomic_load_explicit(&e->state, memory_order_relaxed);
    if (state == 0) {
      const ddp_status st = make_handle(e);
      if (st != DDP_OK) {
        e->failure = st;
        snprintf(e->reason, sizeof e->reason, "%s", ddp_last_error());
      }
      state = st == DDP_OK ? 1 : -1;
      atomic_store_explicit(&e->state, state, memory_order_release);
    }
    pthread_mutex_unlock(&make_lock);
  }
  if (state == 1) return e->handle;
  if (report) ddp_error(e->failure, "%s", e->reason);
  return NULL;
}

cudnnHandle_t ddp__cuda_cudnn(void) { return current_handle(true); }

const char *ddp__cudnn_unavailable_reason(void) {
  if (ddp__cuda_cudnn()) return NULL;
  cudnn_dev *e = current_cudnn_dev(false);
  if (e) return e->reason; /* state -1: kept for good */
  static char why[512];    /* no such device: the same text whichever thread asks */
  static pthread_mutex_t why_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&why_lock);
  snprintf(why, sizeof why, "%s", ddp_last_error());
  pthread_mutex_unlock(&why_lock);
  return why;
}

/* ---- Descriptors, cached per geometry ---------------------------------------
 * A plan holds the descriptors of one geometry on one device and what cuDNN
 * said of each part: supported or not, and the workspace it needs. Plans
 * are made once and never changed or freed, so a steady-state step makes
 * no descriptor and asks cuDNN nothing but to run. Past PLANS geometries
 * (far more than a model has) a call makes a plan of its own and destroys
 * it after. */
#define PLANS 64

typedef struct conv_plan {
  int device;
  ddp__conv2d_geom g;
  cudnnTensorDescriptor_t x, y, bias; /* (n, c, h, w), (n, o, oh, ow), (1, o, 1, 1) */
  cudnnFilterDescriptor_t w;          /* (o, c, kh, kw) */
  cudnnConvolutionDescriptor_t conv;
  bool tf32; /* planned with TF32 allowed (ddp_cuda_allow_tf32) */
  int low;   /* 0: float32; else the 16-bit data type (autocast's plans) */
  cudnnTensorDescriptor_t y32; /* y as float32 (a 16-bit plan's bias add) */
  bool fwd_ok, data_ok, filter_ok; /* cuDNN takes the part with our algorithm */
  size_t fwd_bytes, data_bytes, filter_bytes; /* their workspaces */
} conv_plan;

static const cudnnConvolutionFwdAlgo_t FWD_ALGO = CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
static const cudnnConvolutionBwdDataAlgo_t DATA_ALGO = CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
static const cudnnConvolutionBwdFilterAlgo_t FILTER_ALGO = CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1;

static conv_plan plans[PLANS];
static int n_plans;
static pthread_mutex_t plans_lock = PTHREAD_MUTEX_INITIALIZER;

static bool same_geom(const ddp__conv2d_geom *a, const ddp__conv2d_geom *b) {
  return a->n == b->n && a->c == b->c && a->h == b->h && a->w == b->w && a->o == b->o &&
         a->kh == b->kh && a->kw == b->kw && a->stride == b->stride && a->pad == b->pad &&
         a->oh == b->oh && a->ow == b->ow;
}

/* Whether cuDNN's legacy API can describe g: every size positive (an empty
 * convolution is im2col's: it clears or leaves outputs without cuDNN),
 * each an int, and each tensor under 2^31 elements (int strides). */
static bool describable(const ddp__conv2d_geom *g) {
  const int64_t sizes[] = {g->n,  g->c,      g->h,   g->w,  g->o,  g->kh,
                           g->kw, g->stride, g->oh, g->ow};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
    if (sizes[i] <= 0 || sizes[i] > INT_MAX) return false;
  if (g->pad < 0 || g->pad > INT_MAX) return false;
  const int64_t limit = INT64_C(1) << 31;
  /* each product checked against the limit before the next factor, so none
   * overflows int64 */
  return g->n * g->c < limit && g->n * g->c * g->h < limit && g->n * g->c * g->h * g->w < limit &&
         g->n * g->o < limit && g->n * g->o * g->oh < limit &&
         g->n * g->o * g->oh * g->ow < limit && g->o * g->c < limit &&
         g->o * g->c * g->kh < limit && g->o * g->c * g->kh * g->kw < limit;
}

static void plan_destroy(conv_plan *p) {
  if (p->x) (void)cudnnDestroyTensorDescriptor(p->x);
  if (p->y) (void)cudnnDestroyTensorDescriptor(p->y);
  if (p->y32) (void)cudnnDestroyTensorDescriptor(p->y32);
  if (p->bias) (void)cudnnDestroyTensorDescriptor(p->bias);
  if (p->w) (void)cudnnDestroyFilterDescriptor(p->w);
  if (p->conv) (void)cudnnDestroyConvolutionDescriptor(p->conv);
  memset(p, 0, sizeof *p);
}

/* A part's workspace query: *ok and *bytes from its status; an error
 * other than "not supported" fails the plan. */
static ddp_status part_query(cudnnStatus_t status, const char *what, bool *ok, size_t *bytes) {
  *ok = status == CUDNN_STATUS_SUCCESS;
  if (!*ok) *bytes = 0;
  return *ok || refused(status) ? DDP_OK : ddp__cudnn_check(status, what);
}

/* Makes p for g (describable) on the current device: descriptors, the
 * output size checked against g's, each part's support and workspace.
 * On failure p is left empty (nothing to destroy). */
static ddp_status plan_make(conv_plan *p, const ddp__conv2d_geom *g, cudnnHandle_t handle,
                            cudnn_dev *e, int low) {
  memset(p, 0, sizeof *p);
  p->device = ddp__cuda_current_device();
  p->g = *g;
  p->tf32 = low ? false : ddp_cuda_tf32_allowed();
  p->low = low;
  /* x, w and y in the data's type; the convolution computes in float */
  const cudnnDataType_t dt = low ? (cudnnDataType_t)low : CUDNN_DATA_FLOAT;
  const int n = (int)g->n, c = (int)g->c, h = (int)g->h, w = (int)g->w, o = (int)g->o;
  const int kh = (int)g->kh, kw = (int)g->kw, oh = (int)g->oh, ow = (int)g->ow;
  const int stride = (int)g->stride, pad = (int)g->pad;
  ddp_status st = ddp__cudnn_check(cudnnCreateTensorDescriptor(&p->x), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnCreateTensorDescriptor(&p->y), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnCreateTensorDescriptor(&p->bias), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnCreateTensorDescriptor(&p->y32), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnCreateFilterDescriptor(&p->w), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnCreateConvolutionDescriptor(&p->conv), "creating a descriptor");
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetTensor4dDescriptor(p->x, CUDNN_TENSOR_NCHW, dt, n, c, h, w),
        "conv2d: describing x");
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetTensor4dDescriptor(p->y, CUDNN_TENSOR_NCHW, dt, n, o, oh, ow),
        "conv2d: describing y");
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetTensor4dDescriptor(p->y32, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, n, o, oh, ow),
        "conv2d: describing y (float32)");
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetTensor4dDescriptor(p->bias, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, o, 1, 1),
        "conv2d: describing the bias");
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetFilter4dDescriptor(p->w, dt, CUDNN_TENSOR_NCHW, o, c, kh, kw),
        "conv2d: describing the weight");
  if (st == DDP_OK)
    st = ddp__cudnn_check(cudnnSetConvolution2dDescriptor(p->conv, pad, pad, stride, stride, 1,
                                                          1, CUDNN_CROSS_CORRELATION,
                                                          CUDNN_DATA_FLOAT),
                          "conv2d: describing the convolution");
  /* No TF32, no reduced precision: float32 FMAs; with the TF32 opt-in
   * the tensor cores, float32 data converted to TF32 (PyTorch's
   * cudnn.allow_tf32). The algorithms stay the fixed deterministic ones. */
  /* A 16-bit plan: the tensor cores on the 16-bit data, float compute. */
  if (st == DDP_OK)
    st = ddp__cudnn_check(
        cudnnSetConvolutionMathType(p->conv, low       ? CUDNN_TENSOR_OP_MATH
                                             : p->tf32 ? CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
                                                       : CUDNN_FMA_MATH),
        low ? "conv2d: setting tensor-op math" : p->tf32 ? "conv2d: setting TF32 tensor-op math"
                                                         : "conv2d: setting FMA math");
  if (st == DDP_OK) { /* cuDNN must see the output we were given */
    int yn = 0, yc = 0, yh = 0, yw = 0;
    st = ddp__cudnn_check(
        cudnnGetConvolution2dForwardOutputDim(p->conv, p->x, p->w, &yn, &yc, &yh, &yw),
        "conv2d: output size");
    if (st == DDP_OK && (yn != n || yc != o || yh != oh || yw != ow))
      st = ddp_error(DDP_ERR_INTERNAL,
                     "cuda:%d: conv2d: cuDNN makes the output (%d, %d, %d, %d) of a geometry "
                     "that gives (%d, %d, %d, %d)",
                     p->device, yn, yc, yh, yw, n, o, oh, ow);
  }
  if (st == DDP_OK) {
    pthread_mutex_lock(&e->lock);
    st = part_query(cudnnGetConvolutionForwardWorkspaceSize(handle, p->x, p->w, p->conv, p->y,
                                                            FWD_ALGO, &p->fwd_bytes),
                    "conv2d forward: workspace size", &p->fwd_ok, &p->fwd_bytes);
    if (st == DDP_OK)
      st = part_query(cudnnGetConvolutionBackwardDataWorkspaceSize(
                          handle, p->w, p->y, p->conv, p->x, DATA_ALGO, &p->data_bytes),
                      "conv2d backward (dx): workspace size", &p->data_ok, &p->data_bytes);
    if (st == DDP_OK)
      st = part_query(cudnnGetConvolutionBackwardFilterWorkspaceSize(
                          handle, p->x, p->y, p->conv, p->w, FILTER_ALGO, &p->filter_bytes),
                      "conv2d backward (dw): workspace size", &p->filter_ok, &p->filter_bytes);
    pthread_mutex_unlock(&e->lock);
  }
  if (st != DDP_OK) plan_destroy(p);
  return st;
}

/* The plan of g on the current device: *out points into the cache, or to
 * *spare (made here; the caller destroys it with plan_destroy) when the
 * cache is full. */
static ddp_status plan_get(const ddp__conv2d_geom *g, cudnnHandle_t handle, cudnn_dev *e,
                           conv_plan *spare, const conv_plan **out, int low) {
  const int device = ddp__cuda_current_device();
  ddp_status st = DDP_OK;
  *out = NULL;
  pthread_mutex_lock(&plans_lock);
  for (int i = 0; i < n_plans && !*out; i++)
    if (plans[i].device == device && same_geom(&plans[i].g, g) && plans[i].low == low &&
        (low || plans[i].tf32 == ddp_cuda_tf32_allowed()))
      *out = &plans[i];
  if (!*out && n_plans < PLANS) {
    st = plan_make(&plans[n_plans], g, handle, e, low);
    if (st == DDP_OK) *out = &plans[n_plans++];
  }
  pthread_mutex_unlock(&plans_lock);
  if (*out || st != DDP_OK) return st;
  DDP_TRY(plan_make(spare, g, handle, e, low));
  *out = spare;
  return DDP_OK;
}

/* `bytes` of device scratch from the arena (NULL for none needed). */
static ddp_status workspace(ddp_arena *arena, size_t bytes, void **out) {
  *out = NULL;
  if (bytes == 0) return DDP_OK;
  *out = ddp_arena_alloc(arena, bytes);
  if (!*out)
    return ddp_error(DDP_ERR_NOMEM, "cuda:%d: conv2d on cuDNN: cannot allocate %zu bytes of "
                     "workspace", ddp__cuda_current_device(), bytes);
  return DDP_OK;
}

/* ---- Forward and backward ----------------------------------------------------- */

/* The handle and plan of g on the current device (plan == spare when it
 * is not cached: the caller destroys it). *handle NULL: use im2col (g is
 * not describable). */
static ddp_status prepare(const ddp__conv2d_geom *g, cudnnHandle_t *handle, cudnn_dev **e,
                          conv_plan *spare, const conv_plan **plan, int low) {
  *handle = NULL;
  *plan = NULL;
  memset(spare, 0, sizeof *spare);
  if (!describable(g)) return DDP_OK;
  cudnnHandle_t h = ddp__cuda_cudnn();
  if (!h) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "conv2d on cuDNN");
  *e = current_cudnn_dev(true);
  DDP_TRY(plan_get(g, h, *e, spare, plan, low));
  *handle = h;
  return DDP_OK;
}

ddp_status ddp__cudnn_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                     const ddp__conv2d_geom *g, ddp_arena *arena) {
  cudnnHandle_t handle;
  cudnn_dev *e = NULL;
  conv_plan spare;
  const conv_plan *p;
  DDP_TRY(prepare(g, &handle, &e, &spare, &p, 0));
  if (!handle || !p->fwd_ok) {
    plan_destroy(&spare);
    return ddp__cuda_conv2d_forward_im2col(y, x, w, b, g, arena);
  }
  void *ws = NULL;
  ddp_status st = workspace(arena, p->fwd_bytes, &ws);
  cudnnStatus_t conv = CUDNN_STATUS_SUCCESS, add = CUDNN_STATUS_SUCCESS;
  if (st == DDP_OK) {
    /* y = conv(x, w), then y += b broadcast over (n, oh, ow). beta 0: y is
     * not read (cuDNN's rule), so a fresh buffer's garbage or NaN is fine. */
    const float one = 1.0f, zero = 0.0f;
    pthread_mutex_lock(&e->lock);
    conv = cudnnConvolutionForward(handle, &one, p->x, x, p->w, w, p->conv, FWD_ALGO, ws,
                                   p->fwd_bytes, &zero, p->y, y);
    if (conv == CUDNN_STATUS_SUCCESS && b)
      add = cudnnAddTensor(handle, &one, p->bias, b, &one, p->y, y);
    pthread_mutex_unlock(&e->lock);
  }
  plan_destroy(&spare);
  if (st != DDP_OK) return st;
  if (refused(conv)) return ddp__cuda_conv2d_forward_im2col(y, x, w, b, g, arena);
  DDP_TRY(ddp__cudnn_check(conv, "conv2d forward"));
  return ddp__cudnn_check(add, "conv2d forward: adding the bias");
}

ddp_status ddp__cudnn_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                      const float *x, const float *w, const ddp__conv2d_geom *g,
                                      bool dx_accumulate, ddp_arena *arena) {
  if (!dx && !dw) /* db only (or nothing): conv.cu's reduction */
    return ddp__cuda_conv2d_backward_im2col(NULL, NULL, db, dy, x, w, g, false, arena);
  cudnnHandle_t handle;
  cudnn_dev *e = NULL;
  conv_plan spare;
  const conv_plan *p;
  DDP_TRY(prepare(g, &handle, &e, &spare, &p, 0));
  if (!handle) return ddp__cuda_conv2d_backward_im2col(dx, dw, db, dy, x, w, g, dx_accumulate,
                                                       arena);
  ddp_status st = DDP_OK;
  if (db) /* the fixed-order per-channel sums of conv.cu */
    st = ddp__cuda_conv2d_backward_im2col(NULL, NULL, db, dy, x, w, g, false, arena);
  /* One workspace for both parts: they run one after the other on the
   * stream. */
  const bool filter = dw && p->filter_ok, data = dx && p->data_ok;
  size_t bytes = 0;
  if (filter && p->filter_bytes > bytes) bytes = p->filter_bytes;
  if (data && p->data_bytes > bytes) bytes = p->data_bytes;
  void *ws = NULL;
  if (st == DDP_OK) st = workspace(arena, bytes, &ws);
  const float one = 1.0f, dx_beta = dx_accumulate ? 1.0f : 0.0f;
  /* dw before dx: dx may be x itself (!dx_accumulate), and dw reads x; the
   * stream runs the two in the order queued. dw += (beta 1); dx = or +=
   * (beta 0: dx is not read, a fresh buffer's NaN included). */
  if (st == DDP_OK && dw) {
    cudnnStatus_t s = CUDNN_STATUS_NOT_SUPPORTED;
    if (filter) {
      pthread_mutex_lock(&e->lock);
      s = cudnnConvolutionBackwardFilter(handle, &one, p->x, x, p->y, dy, p->conv, FILTER_ALGO,
                                         ws, bytes, &one, p->w, dw);
      pthread_mutex_unlock(&e->lock);
    }
    st = refused(s)
             ? ddp__cuda_conv2d_backward_im2col(NULL, dw, NULL, dy, x, w, g, false, arena)
             : ddp__cudnn_check(s, "conv2d backward (dw)");
  }
  if (st == DDP_OK && dx) {
    cudnnStatus_t s = CUDNN_STATUS_NOT_SUPPORTED;
    if (data) {
      pthread_mutex_lock(&e->lock);
      s = cudnnConvolutionBackwardData(handle, &one, p->w, w, p->y, dy, p->conv, DATA_ALGO, ws,
                                       bytes, &dx_beta, p->x, dx);
      pthread_mutex_unlock(&e->lock);
    }
    st = refused(s) ? ddp__cuda_conv2d_backward_im2col(dx, NULL, NULL, dy, x, w, g,
                                                       dx_accumulate, arena)
                    : ddp__cudnn_check(s, "conv2d backward (dx)");
  }
  plan_destroy(&spare);
  return st;
}

#endif /* DDP_HAVE_CUDNN */

/* ---- Autocast: 16-bit data, float compute ---------------------------------------
 * The float32 path's algorithms on bfloat16 / float16 descriptors (cuDNN's
 * "pseudo half" configurations: 16-bit x, w, y, float accumulation), so
 * the results are as deterministic. cuDNN writes 16-bit outputs into
 * device scratch, which one conversion kernel widens into the float32
 * tensor (exact). Where cuDNN refuses a part in 16 bits, nothing is done
 * (*done false) and the op layer computes on rounded float32 operands. */

static int low_type(bool bf16) { return bf16 ? (int)CUDNN_DATA_BFLOAT16 : (int)CUDNN_DATA_HALF; }

ddp_status ddp__cudnn_conv2d_forward_low(bool bf16, float *y, const uint16_t *x,
                                         const uint16_t *w, const float *b,
                                         const ddp__conv2d_geom *g, ddp_arena *arena, bool *done) {
  *done = false;
  cudnnHandle_t handle;
  cudnn_dev *e = NULL;
  conv_plan spare;
  const conv_plan *p;
  DDP_TRY(prepare(g, &handle, &e, &spare, &p, low_type(bf16)));
  if (!handle || !p->fwd_ok) {
    plan_destroy(&spare);
    return DDP_OK;
  }
  const int64_t ny = g->n * g->o * g->oh * g->ow;
  void *ws = NULL;
  uint16_t *y16 = ddp_arena_alloc(arena, (size_t)ny * sizeof *y16);
  ddp_status st = y16 ? workspace(arena, p->fwd_bytes, &ws)
                      : ddp_error(DDP_ERR_NOMEM, "cuda:%d: conv2d (16-bit): no scratch for its "
                                  "output", ddp__cuda_current_device());
  cudnnStatus_t conv = CUDNN_STATUS_SUCCESS, add = CUDNN_STATUS_SUCCESS;
  if (st == DDP_OK) {
    const float one = 1.0f, zero = 0.0f;
    pthread_mutex_lock(&e->lock);
    conv = cudnnConvolutionForward(handle, &one, p->x, x, p->w, w, p->conv, FWD_ALGO, ws,
                                   p->fwd_bytes, &zero, p->y, y16);
    if (conv == CUDNN_STATUS_SUCCESS) {
      ddp__cuda_basic_kernels.from_half(y, y16, ny, bf16); /* exact */
      if (b) add = cudnnAddTensor(handle, &one, p->bias, b, &one, p->y32, y);
    }
    pthread_mutex_unlock(&e->lock);
  }
  plan_destroy(&spare);
  if (st != DDP_OK) return st;
  if (refused(conv)) return DDP_OK; /* *done false: the caller computes it */
  DDP_TRY(ddp__cudnn_check(conv, "conv2d forward (16-bit)"));
  DDP_TRY(ddp__cudnn_check(add, "conv2d forward (16-bit): adding the bias"));
  *done = true;
  return DDP_OK;
}

ddp_status ddp__cudnn_conv2d_backward_low(bool bf16, float *dx, float *dw, const uint16_t *dy,
                                          const uint16_t *x, const uint16_t *w,
                                          const ddp__conv2d_geom *g, ddp_arena *arena,
                                          bool *done) {
  *done = false;
  if (!dx && !dw) {
    *done = true;
    return DDP_OK;
  }
  cudnnHandle_t handle;
  cudnn_dev *e = NULL;
  conv_plan spare;
  const conv_plan *p;
  DDP_TRY(prepare(g, &handle, &e, &spare, &p, low_type(bf16)));
  /* Both wanted parts in 16 bits, or neither (the caller's float32 path
   * then does both) */
  if (!handle || (dw && !p->filter_ok) || (dx && !p->data_ok)) {
    plan_destroy(&spare);
    return DDP_OK;
  }
  size_t bytes = 0;
  if (dw && p->filter_bytes > bytes) bytes = p->filter_bytes;
  if (dx && p->data_bytes > bytes) bytes = p->data_bytes;
  const int64_t nw = g->o * g->c * g->kh * g->kw, nx = g->n * g->c * g->h * g->w;
  uint16_t *dw16 = dw ? ddp_arena_alloc(arena, (size_t)nw * sizeof *dw16) : NULL;
  uint16_t *dx16 = dx ? ddp_arena_alloc(arena, (size_t)nx * sizeof *dx16) : NULL;
  void *ws = NULL;
  ddp_status st = (dw && !dw16) || (dx && !dx16)
                      ? ddp_error(DDP_ERR_NOMEM, "cuda:%d: conv2d backward (16-bit): no scratch "
                                  "for its gradients", ddp__cuda_current_device())
                      : workspace(arena, bytes, &ws);
  cudnnStatus_t sf = CUDNN_STATUS_SUCCESS, sd = CUDNN_STATUS_SUCCESS;
  if (st == DDP_OK) {
    const float one = 1.0f, zero = 0.0f; /* beta 0: the 16-bit outputs are written */
    pthread_mutex_lock(&e->lock);
    if (dw)
      sf = cudnnConvolutionBackwardFilter(handle, &one, p->x, x, p->y, dy, p->conv, FILTER_ALGO,
                                          ws, bytes, &zero, p->w, dw16);
    if (dx && sf == CUDNN_STATUS_SUCCESS)
      sd = cudnnConvolutionBackwardData(handle, &one, p->w, w, p->y, dy, p->conv, DATA_ALGO, ws,
                                        bytes, &zero, p->x, dx16);
    pthread_mutex_unlock(&e->lock);
  }
  plan_destroy(&spare);
  if (st != DDP_OK) return st;
  if (refused(sf) || refused(sd)) return DDP_OK; /* nothing written to dx, dw */
  DDP_TRY(ddp__cudnn_check(sf, "conv2d backward (dw, 16-bit)"));
  DDP_TRY(ddp__cudnn_check(sd, "conv2d backward (dx, 16-bit)"));
  if (dw) ddp__cuda_basic_kernels.from_half(dw, dw16, nw, bf16);
  if (dx) ddp__cuda_basic_kernels.from_half(dx, dx16, nx, bf16);
  *done = true;
  return DDP_OK;
}
