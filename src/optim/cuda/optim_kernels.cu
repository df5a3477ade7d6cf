/* SGD, Adam and Adadelta on a CUDA device: each step is one kernel over the
 * flat (n,) buffers doing what the CPU loop in sgd.c / adam.c / adadelta.c
 * does per element (weight decay, moments, the update in one pass), with the
 * same scalars, computed on the host by the same functions. Every float
 * operation is an explicitly rounded intrinsic (__fmaf_rn, __fmul_rn,
 * __fdiv_rn, __fsqrt_rn, __fadd_rn): nvcc may neither contract a multiply
 * and an add nor approximate a division or a square root, so each element
 * is rounded as the CPU rounds it whatever the compiler flags. Also the
 * state's device memory and its copies to and from the host. */
#include <cuda_runtime.h>

#include "optim/cuda/optim_cuda.h"
#include "tensor/cuda/runtime.h"

#define OPTIM_BLOCK 256

/* Grid-stride loop over [0, n) in int64: n may exceed 2^31 floats. */
#define FOR_EACH_ELEMENT(i, n)                                                \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

/* sgd.c's loops: buf is NULL without momentum. */
static __global__ void sgd_kernel(float *param, const float *grad, float *buf, int64_t n,
                                  ddp__sgd_scalars s) {
  FOR_EACH_ELEMENT(i, n) {
    float d_p = __fmul_rn(s.sign, grad[i]);
    if (s.use_wd) d_p = __fmaf_rn(param[i], s.weight_decay, d_p);
    if (buf) {
      float b = s.first ? d_p
                        : __fmaf_rn(d_p, s.one_minus_dampening, __fmul_rn(buf[i], s.momentum));
      buf[i] = b;
      d_p = s.nesterov ? __fmaf_rn(b, s.momentum, d_p) : b;
    }
    param[i] = __fmaf_rn(d_p, s.neg_lr, param[i]);
  }
}

/* adam.c's loop: max_exp_avg_sq is NULL without amsgrad. */
static __global__ void adam_kernel(float *param, const float *grad, float *exp_avg,
                                   float *exp_avg_sq, float *max_exp_avg_sq, int64_t n,
                                   ddp__adam_scalars s) {
  FOR_EACH_ELEMENT(i, n) {
    float g = __fmul_rn(s.sign, grad[i]);
    if (s.use_wd) g = __fmaf_rn(param[i], s.weight_decay, g);
    float m = __fmaf_rn(g, s.one_minus_beta1, __fmul_rn(exp_avg[i], s.beta1));
    float v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], s.beta2));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (max_exp_avg_sq) {
      /* torch.maximum: NaN in either operand propagates. */
      float mx = max_exp_avg_sq[i];
      if (!(mx >= v) && !isnan(mx)) mx = v;
      max_exp_avg_sq[i] = mx;
      v = mx;
    }
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);
    param[i] = __fadd_rn(param[i], __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
  }
}

/* adadelta.c's loop. */
static __global__ void adadelta_kernel(float *param, const float *grad, float *square_avg,
                                       float *acc_delta, int64_t n, ddp__adadelta_scalars s) {
  FOR_EACH_ELEMENT(i, n) {
    float g = __fmul_rn(s.sign, grad[i]);
    if (s.use_wd) g = __fmaf_rn(param[i], s.weight_decay, g);
    float sq = __fmaf_rn(__fmul_rn(s.one_minus_rho, g), g, __fmul_rn(square_avg[i], s.rho));
    square_avg[i] = sq;
    float std = __fsqrt_rn(__fadd_rn(sq, s.eps));
    float acc = acc_delta[i];
    float delta = __fmul_rn(__fdiv_rn(__fsqrt_rn(__fadd_rn(acc, s.eps)), std), g);
    acc_delta[i] = __fmaf_rn(__fmul_rn(s.one_minus_rho, delta), delta, __fmul_rn(acc, s.rho));
    param[i] = __fmaf_rn(delta, s.neg_lr, param[i]);
  }
}

static const char *kind_name(const ddp_optimizer *opt) {
  return ddp_optim_kind_name(opt->options.kind);
}

static ddp_status make_current(const ddp_optimizer *opt) {
  return ddp__cuda_set_device(opt->options.device.index);
}

/* Why `ptr` is not memory of `device`, or NULL when it is. */
static const char *not_on_device(const void *ptr, int device) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    (void)cudaGetLastError(); /* not sticky: keep it from later checks */
    return "not CUDA memory";
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged:
      return attr.device == device ? NULL : "memory of another device";
    case cudaMemoryTypeHost:
      return "pinned host memory";
    default:
      return "host memory";
  }
}

ddp_status ddp__optim_cuda_check_buffers(const ddp_optimizer *opt) {
  int device = opt->options.device.index;
  DDP_TRY(make_current(opt));
  const char *why = not_on_device(opt->params, device);
  if (why)
    return ddp_error(DDP_ERR_INVALID, "%s on cuda:%d: params (%p) is %s", kind_name(opt),
                     device, (void *)opt->params, why);
  why = not_on_device(opt->grads, device);
  if (why)
    return ddp_error(DDP_ERR_INVALID, "%s on cuda:%d: grads (%p) is %s", kind_name(opt),
                     device, (const void *)opt->grads, why);
  return DDP_OK;
}

ddp_status ddp__optim_cuda_state_alloc(const ddp_optimizer *opt, size_t floats, float **out) {
  *out = NULL;
  DDP_TRY(make_current(opt));
  float *mem = (float *)ddp__cuda_malloc(floats * sizeof(float));
  if (!mem)
    return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate %zu floats of state on cuda:%d",
                     kind_name(opt), floats, opt->options.device.index);
  ddp_status st = ddp__cuda_check(
      cudaMemsetAsync(mem, 0, floats * sizeof(float), ddp__cuda_stream()),
      "zeroing optimizer state");
  if (st != DDP_OK) {
    ddp__cuda_free(mem);
    return st;
  }
  *out = mem;
  return DDP_OK;
}

void ddp__optim_cuda_state_free(const ddp_optimizer *opt, float *mem) {
  if (!mem) return;
  /* The device existed at create; the cache is the current device's. */
  if (make_current(opt) == DDP_OK) ddp__cuda_free(mem);
}

ddp_status ddp__optim_cuda_download(const ddp_optimizer *opt, float *host, const float *device,
                                    size_t floats) {
  DDP_TRY(make_current(opt));
  return ddp__cuda_copy(host, device, floats * sizeof(float), cudaMemcpyDeviceToHost);
}

ddp_status ddp__optim_cuda_upload(const ddp_optimizer *opt, float *device, const float *host,
                                  size_t floats) {
  DDP_TRY(make_current(opt));
  return ddp__cuda_copy(device, host, floats * sizeof(float), cudaMemcpyHostToDevice);
}

ddp_status ddp__optim_cuda_step(ddp_optimizer *opt) {
  DDP_TRY(make_current(opt));
  const int64_t n = (int64_t)opt->n;
  const unsigned blocks = ddp__cuda_blocks(n, OPTIM_BLOCK);
  cudaStream_t stream = ddp__cuda_stream();
  switch (opt->options.kind) {
    case DDP_OPTIM_SGD: {
      ddp__sgd_scalars s = ddp__sgd_scalars_of(opt);
      float *buf = s.use_momentum ? opt->state[0].data : NULL; /* (n,) momentum_buffer */
      sgd_kernel<<<blocks, OPTIM_BLOCK, 0, stream>>>(opt->params, opt->grads, buf, n, s);
      break;
    }
    case DDP_OPTIM_ADAM: {
      ddp__adam_scalars s = ddp__adam_next_scalars(opt);
      float *max_exp_avg_sq = opt->options.adam.amsgrad ? opt->state[3].data : NULL;
      adam_kernel<<<blocks, OPTIM_BLOCK, 0, stream>>>(opt->params, opt->grads, opt->state[1].data,
                                                     opt->state[2].data, max_exp_avg_sq, n, s);
      break;
    }
    case DDP_OPTIM_ADADELTA: {
      ddp__adadelta_scalars s = ddp__adadelta_scalars_of(opt);
      adadelta_kernel<<<blocks, OPTIM_BLOCK, 0, stream>>>(opt->params, opt->grads,
                                                         opt->state[0].data, opt->state[1].data,
                                                         n, s);
      break;
    }
    default:
      DDP_ASSERT(!"optimizer kind validated at create");
  }
  return DDP_OK;
}
