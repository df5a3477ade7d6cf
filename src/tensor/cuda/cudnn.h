/* Convolution on the GPU through cuDNN, and the choice between it and
 * im2col + cuBLAS (docs/cuda.md, "Convolution"). The table's entries
 * (ddp__cuda_conv2d_forward/backward, cuda/conv.cu) ask
 * ddp__cuda_conv_pick which implementation runs; cuda/conv_cudnn.c holds
 * the choice, the per-device cuDNN handle and the cuDNN calls. The cuDNN
 * part exists only in a build that found cuDNN (DDP_HAVE_CUDNN); the choice
 * exists in every CUDA build (without cuDNN it is always im2col).
 * Callable from C and CUDA C++. */
#ifndef DDP__TENSOR_CUDA_CUDNN_H
#define DDP__TENSOR_CUDA_CUDNN_H

#include <stdbool.h>

#ifdef DDP_HAVE_CUDNN
#include <cudnn.h>
#endif

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#include "tensor/kernels_dense.h"

/* ---- The choice ------------------------------------------------------------
 * DDP_CUDA_CONV = auto (the default, also when unset or empty) | cudnn |
 * im2col, read once, at the first convolution or the first question below.
 * auto: cuDNN where this build has it and its handle can be made on the
 * device (the library and its sub-libraries load, the driver suits it),
 * else im2col, silently (ddp__cudnn_unavailable_reason says why). cudnn:
 * cuDNN or an error from every convolution (a build without it, a library
 * that does not load). Any other value: every convolution fails saying so.
 * Even with cuDNN chosen, a geometry cuDNN refuses (not supported) runs
 * through im2col, that call only. */

/* Overrides DDP_CUDA_CONV for the whole process (tests): "auto", "cudnn" or
 * "im2col"; NULL returns to the environment's choice. DDP_ERR_UNSUPPORTED
 * for "cudnn" in a build without cuDNN, DDP_ERR_INVALID for another name;
 * the choice is then unchanged. Not meant to be called while another
 * thread runs convolutions (each call reads the choice once, so it would
 * only see the old or the new one). */
ddp_status ddp__cuda_conv_force(const char *name);

/* The implementation the next convolution on the current device uses:
 * "cudnn", "im2col", or "auto" for auto's per-pass rule with cuDNN
 * working (ddp__cuda_conv_pick_pass) (for benchmarks to print). With auto this makes the
 * current device's cuDNN handle if it does not exist yet. With a choice
 * that fails every convolution (cudnn without cuDNN, a bad DDP_CUDA_CONV)
 * it names what was asked for ("cudnn", or "invalid"). Static strings. */
const char *ddp__cuda_conv_impl(void);

/* Why cuDNN does not run on the current device ("this build has no cuDNN",
 * "cuda:0: cudnnCreate: ..."), or NULL when its handle is made (this call
 * makes it if needed). The string lives until the process ends. */
const char *ddp__cudnn_unavailable_reason(void);

/* For the table's entries: *use_cudnn says whether this call goes to
 * cuDNN. Fails (the message naming the choice) when the choice cannot be
 * honoured: cudnn without a working cuDNN, a bad DDP_CUDA_CONV. */
ddp_status ddp__cuda_conv_pick(bool *use_cudnn);
/* The same for one pass of one geometry, where auto decides per pass from
 * what the H100 measured (docs/cuda.md, "Convolution"): the forward through
 * cuDNN (as fast or faster at every seed's shape: 0.04 against 0.04-0.10 ms
 * at batch 100, 0.15-0.21 against 0.34-0.95 ms at 1024), the backward
 * through im2col (cuDNN's deterministic backward algorithms took 2-4x
 * longer) except when it wants dx and the im2col matrix passes 128 MiB
 * (ConvNet's conv2 at batch 1024: 1.03 ms against 1.62). A fixed rule of the
 * geometry, so the same run computes the same bits every time. cudnn and
 * im2col force one implementation for both passes. */
ddp_status ddp__cuda_conv_pick_pass(bool backward, bool dx_wanted, const ddp__conv2d_geom *g,
                                    bool *use_cudnn);

/* ---- The two implementations ------------------------------------------------
 * Each on the contract of kernels_dense.h's conv2d_forward/conv2d_backward,
 * word for word (arena: a device arena for scratch). */

/* im2col + cuBLAS (cuda/conv.cu): any geometry, empty ones included. */
ddp_status ddp__cuda_conv2d_forward_im2col(float *y, const float *x, const float *w,
                                           const float *b, const ddp__conv2d_geom *g,
                                           ddp_arena *arena);
ddp_status ddp__cuda_conv2d_backward_im2col(float *dx, float *dw, float *db, const float *dy,
                                            const float *x, const float *w,
                                            const ddp__conv2d_geom *g, bool dx_accumulate,
                                            ddp_arena *arena);

#ifdef DDP_HAVE_CUDNN
/* cuDNN (cuda/conv_cudnn.c): float32 in FMA math (no TF32), deterministic
 * algorithms only; db and the geometries cuDNN refuses or cannot describe
 * (empty, over 2^31 elements) through the im2col functions above. */
ddp_status ddp__cudnn_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                     const ddp__conv2d_geom *g, ddp_arena *arena);
ddp_status ddp__cudnn_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                      const float *x, const float *w, const ddp__conv2d_geom *g,
                                      bool dx_accumulate, ddp_arena *arena);

/* Autocast's 16-bit convolution through cuDNN (kernels_dense.h's
 * conv2d_forward_low / conv2d_backward_low, word for word): bfloat16 or
 * float16 NCHW data, float compute, tensor-op math, the float32 path's
 * deterministic algorithms. *done false when cuDNN refuses a part. */
ddp_status ddp__cudnn_conv2d_forward_low(bool bf16, float *y, const uint16_t *x,
                                         const uint16_t *w, const float *b,
                                         const ddp__conv2d_geom *g, ddp_arena *arena, bool *done);
ddp_status ddp__cudnn_conv2d_backward_low(bool bf16, float *dx, float *dw, const uint16_t *dy,
                                          const uint16_t *x, const uint16_t *w,
                                          const ddp__conv2d_geom *g, ddp_arena *arena,
                                          bool *done);

/* The cuDNN handle of the current device, bound to its compute stream
 * (ddp__cuda_stream), made on first use; NULL with the error set when it
 * cannot be made (tried once per device; the same error every later call). */
cudnnHandle_t ddp__cuda_cudnn(void);

/* A cuDNN status as a ddp error "cuda:<dev>: <what>: <cuDNN's string>"
 * (with cuDNN's last message when it has one); DDP_OK for success.
 * DDP_ERR_NOMEM for an allocation failure, DDP_ERR_INVALID for a bad
 * parameter, DDP_ERR_UNSUPPORTED for "not supported", else DDP_ERR_IO. */
ddp_status ddp__cudnn_check(cudnnStatus_t status, const char *what);
#endif

#ifdef __cplusplus
}
#endif

#endif /* DDP__TENSOR_CUDA_CUDNN_H */
