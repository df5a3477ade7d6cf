/* CPU dense kernels, split by subject: gemm and linear (cpu/dense.c),
 * convolution (cpu/conv.c), pooling (cpu/pool.c). cpu/dense.c assembles them
 * into ddp__cpu_dense_kernels. */
#ifndef DDP__TENSOR_CPU_DENSE_H
#define DDP__TENSOR_CPU_DENSE_H

#include "tensor/kernels_dense.h"

void ddp__cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                   float *c, int64_t ldc);
ddp_status ddp__cpu_conv2d_forward(float *y, const float *x, const float *w, const float *b,
                                   const ddp__conv2d_geom *g, ddp_arena *arena);
ddp_status ddp__cpu_conv2d_backward(float *dx, float *dw, float *db, const float *dy,
                                    const float *x, const float *w, const ddp__conv2d_geom *g,
                                    bool dx_accumulate, ddp_arena *arena);
void ddp__cpu_max_pool2d_forward(float *y, void *argmax, float *argval, const float *x,
                                 int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                 int64_t stride, int64_t oh, int64_t ow, bool relu,
                                 const ddp__pool_affine *affine);
void ddp__cpu_max_pool2d_backward(float *dx, const float *dy, const void *argmax,
                                  int64_t planes, int64_t h, int64_t w, int64_t kernel,
                                  int64_t stride, int64_t oh, int64_t ow, bool accumulate);

/* A stride-1 convolution's weight and bias gradient, one output channel's
 * gradient planes at a time (cpu/conv_fold.c), for batch norm's backward
 * to fold in (ddp__cpu_batch_norm_backward_fold): init pads the whole
 * input batch x (N, C, H, W) once; fold_plane adds the products of one
 * (OH, OW) gradient plane of sample n; fold_channel adds the channel's sums
 * into dw (C*KH*KW, that channel's row of the weight) and *db (each may be
 * NULL) and starts the next channel from zero. Stride 1 only. */
typedef struct ddp__conv2d_fold {
  const ddp__conv2d_geom *g;
  float *xp;           /* (N, C, HP, WP) zero-padded input */
  int64_t *off;        /* [K] tap offsets (c*HP + a)*WP + b within a sample */
  float *acc;          /* (K + 1) x 16 partial sums: the taps, then the bias */
  int64_t hp, wp, k;
  int64_t sample;      /* floats from one sample's planes to the next's (C*HP*WP and a gap) */
  int64_t slack;       /* zeros before and after xp, in floats */
  bool avx512;         /* rows of up to 32 outputs on the AVX-512 path */
  bool avx2;           /* the AVX2 family's kernel (cpu/conv_fold_avx2.c) */
} ddp__conv2d_fold;
ddp_status ddp__cpu_conv2d_fold_init(ddp__conv2d_fold *f, const float *x,
                                     const ddp__conv2d_geom *g, ddp_arena *arena);
void ddp__cpu_conv2d_fold_plane(ddp__conv2d_fold *f, const float *dy, int64_t n);
void ddp__cpu_conv2d_fold_channel(ddp__conv2d_fold *f, float *dw, float *db);
/* The sums over every output position (n, y, x) of the padded input's
 * patches, in double: psum[t] = sum of tap t's input element and
 * gram[t * K + u] = sum of the product of taps t's and u's (K x K,
 * symmetric), where tap t = (c, a, b) at (y, x) is xp_n[c][y + a][x + b].
 * A folded batch norm's backward needs them for the terms of dx that are
 * affine in x, hence in the patches. Scratch from arena. */
/* fold_plane's AVX2 kernel, sample xs of f->xp (cpu/conv_fold_avx2.c). */
void ddp__cpu_conv2d_fold_plane_avx2(ddp__conv2d_fold *f, const float *dy, const float *xs);
/* fold_gram's correlations for the AVX2 family (cpu/conv_fold_avx2.c):
 * r[d][i] += sum over n of p_n[i] * q_n[i + shift + d], d < nd (1..9). */
void ddp__cpu_fold_correlate_avx2(double *r, const float *p, const float *q, int64_t shift, int nd,
                                  int64_t n_samples, int64_t sample, int64_t plane);
ddp_status ddp__cpu_conv2d_fold_gram(const ddp__conv2d_fold *f, double *gram, double *psum,
                                     ddp_arena *arena);

/* The CPU kernel families (cpu/family.c): the generic C kernels, the AVX2 +
 * FMA ones (*_avx2) and the AVX-512 ones (*_avx512). */
typedef enum { DDP__CPU_GENERIC = 0, DDP__CPU_AVX2 = 1, DDP__CPU_AVX512 = 2 } ddp__cpu_family;
/* The family that runs now: the one DDP_CPU_KERNELS and the CPU chose,
 * unless a test forces another. */
ddp__cpu_family ddp__cpu_family_running(void);
/* Whether this CPU can run family f. */
bool ddp__cpu_can_run(ddp__cpu_family f);
/* ddp__cpu_has_avx512 is true when the AVX-512 family runs (the CPU has
 * AVX-512F, DDP_CPU_KERNELS allows it, and no test forces another);
 * ddp__cpu_has_avx2 likewise for the AVX2 family. */
bool ddp__cpu_has_avx512(void);
bool ddp__cpu_has_avx2(void);
/* Tests: run family f (a ddp__cpu_family) from now on, or (f < 0) the
 * chosen one again; false, changing nothing, when the CPU cannot run f.
 * force_generic(true) is force_family(GENERIC), (false) force_family(-1). */
bool ddp__cpu_force_family(int f);
void ddp__cpu_dense_force_generic(bool generic);
/* c (m, n) = init + a (m, k) @ b (k, n), row strides lda, ldb, ldc; init is
 * c itself when accumulate, else row_bias[i] along row i, else 0. Only call
 * when ddp__cpu_has_avx512(). */
void ddp__cpu_gemm_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                          const float *b, int64_t ldb, float *c, int64_t ldc,
                          const float *row_bias, bool accumulate);
/* c (m, n) += a (m, k) @ b (n, k)^T, row strides lda, ldb, ldc. Only call
 * when ddp__cpu_has_avx512(). */
void ddp__cpu_gemm_nt_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                             const float *b, int64_t ldb, float *c, int64_t ldc);
/* The same two with row kk of b at b + boff[kk] (gemm_off: b's rows run
 * along n; gemm_nt_off: row j of b (n, k) at b + boff[j]), for
 * convolutions that read shifted copies of the image instead of a column
 * matrix (cpu/conv.c). */
void ddp__cpu_gemm_off_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                              const float *b, const int64_t *boff, float *c, int64_t ldc,
                              const float *row_bias, bool accumulate);
void ddp__cpu_gemm_nt_off_avx512(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                                 const float *b, const int64_t *boff, float *c, int64_t ldc);
/* Max pooling with kernel 2, stride 2, and its backward into a fresh dx,
 * for the AVX2 family (cpu/pool_avx2.c; arguments as cpu/pool.c's, argmax
 * one byte a window). */
void ddp__cpu_max_pool2x2_avx2(float *restrict y, int8_t *restrict argmax,
                               float *restrict argval, const float *restrict x, int64_t planes,
                               int64_t h, int64_t w, int64_t oh, int64_t ow, bool relu,
                               const ddp__pool_affine *affine);
void ddp__cpu_max_unpool2x2_avx2(float *restrict dx, const float *restrict dy,
                                 const int8_t *restrict argmax, int64_t planes, int64_t h,
                                 int64_t w, int64_t oh, int64_t ow);
/* A folded batch norm + relu + max pool backward's window sums, one-byte
 * argmax, for the AVX2 family (cpu/norm_avx2.c): *s1 = sum of g[i], *s2 =
 * sum of g[i] * (v[i] - m) over the open windows (argmax >= 0) i < n. */
void ddp__cpu_window_sums_avx2(float *s1, float *s2, const float *restrict g,
                               const int8_t *argmax, const float *restrict v, float m, int64_t n);

/* Stride-1 convolution gemms that read a zero-padded image xp (C, HP, WP)
 * through per-tap offsets off[t] = (c*HP + a)*WP + b instead of a column
 * matrix. conv_rows: y (m, oh, ow) = (y if accumulate, else bias or 0) +
 * w (m, taps) @ columns of xp, with w given packed by conv_rows_pack (once
 * per call of the convolution, then for every sample); needs 16 floats of
 * slack past xp. conv_taps: dwt (taps, n) += columns^T-weighted sums,
 * dwt[t][j] += sum over (y, x) of xp[off[t] + y*wp + x] * dyt[(y*ow + x)*n + j]. */
int64_t ddp__cpu_conv_rows_packed_floats(int64_t m, int64_t taps);
/* packed (conv_rows_packed_floats(m, taps) floats) from w (m, taps; row
 * stride ldw). */
void ddp__cpu_conv_rows_pack(int64_t m, int64_t taps, const float *w, int64_t ldw,
                             float *packed);
void ddp__cpu_conv_rows_avx512(int64_t m, int64_t taps, const float *packed,
                               const float *xp, const int64_t *off, int64_t wp, float *y,
                               int64_t oh, int64_t ow, const float *bias, bool accumulate);
void ddp__cpu_conv_taps_avx512(int64_t taps, int64_t n, const float *xp, const int64_t *off,
                               int64_t wp, int64_t oh, int64_t ow, const float *dyt,
                               float *dwt);
/* 3x3 stride-1 convolutions by Winograd's F(2x2, 3x3) (cpu/winograd.c):
 * y (m, oh, ow) = (y if accumulate, else 0) + bias + the valid convolution
 * of x (c, oh + 2, ow + 2; already padded) with w (m, c, 3, 3; row stride
 * ldw per output channel), given u = winograd_weights(w) (once per call,
 * then for every sample) and winograd_scratch_floats of scratch. Only where
 * winograd_fits (even oh and ow, ow <= 30, m and c >= 16); only call
 * conv3x3 when ddp__cpu_has_avx512(). */
bool ddp__cpu_winograd_fits(int64_t m, int64_t c, int64_t oh, int64_t ow);
int64_t ddp__cpu_winograd_weights_floats(int64_t m, int64_t c);
void ddp__cpu_winograd_weights(int64_t m, int64_t c, const float *w, int64_t ldw, float *u);
int64_t ddp__cpu_winograd_scratch_floats(int64_t m, int64_t c, int64_t oh, int64_t ow);
void ddp__cpu_winograd_conv3x3_avx512(int64_t m, int64_t c, const float *u, const float *x,
                                      float *y, int64_t oh, int64_t ow, const float *bias,
                                      bool accumulate, float *scratch);
/* The weight gradient of the same convolution (m outputs, c inputs) by
 * Winograd: for each sample, dw_sample adds its x (c, oh + 2, ow + 2;
 * padded) and dy (m, oh, ow) into du (weights_floats(m, c), zeroed before
 * the first sample), with scratch_floats(m, c, oh, ow) of scratch; then
 * dw_finish adds du's transform into dw (m, c, 3, 3). */
void ddp__cpu_winograd_dw_sample_avx512(int64_t m, int64_t c, const float *x, const float *dy,
                                        int64_t oh, int64_t ow, float *du, float *scratch);
/* The AVX2 family (cpu/gemm_avx2.c): the same kernels as the AVX-512 ones
 * above, with the same contracts (conv_rows reads conv_rows_pack's layout
 * and 16 floats of slack past xp); only call when ddp__cpu_has_avx2(). */
void ddp__cpu_gemm_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                        const float *b, int64_t ldb, float *c, int64_t ldc,
                        const float *row_bias, bool accumulate);
void ddp__cpu_gemm_nt_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                           const float *b, int64_t ldb, float *c, int64_t ldc);
void ddp__cpu_gemm_off_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                            const float *b, const int64_t *boff, float *c, int64_t ldc,
                            const float *row_bias, bool accumulate);
void ddp__cpu_gemm_nt_off_avx2(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,
                               const float *b, const int64_t *boff, float *c, int64_t ldc);
void ddp__cpu_conv_rows_avx2(int64_t m, int64_t taps, const float *packed, const float *xp,
                             const int64_t *off, int64_t wp, float *y, int64_t oh, int64_t ow,
                             const float *bias, bool accumulate);
void ddp__cpu_conv_taps_avx2(int64_t taps, int64_t n, const float *xp, const int64_t *off,
                             int64_t wp, int64_t oh, int64_t ow, const float *dyt, float *dwt);
/* The AVX2 family's layout work for cpu/conv.c (cpu/conv_avx2.c):
 * copy_taps: col (taps, oh*ow) from xp's rows at off[t] + y*wp (whole
 * vectors: col and xp need 8 floats of slack); transpose: dst (cols, rows)
 * = src (rows, cols)^T; shifted_copy: cpu/conv.c's shifted copies of x
 * (c, h, w) into buf (c, kw, h + 2 pad, w), whose zeros stay. */
void ddp__cpu_copy_taps_avx2(float *restrict col, const float *xp, const int64_t *off,
                             int64_t taps, int64_t wp, int64_t oh, int64_t ow);
void ddp__cpu_transpose_avx2(float *restrict dst, const float *restrict src, int64_t rows,
                             int64_t cols);
void ddp__cpu_shifted_copy_avx2(float *buf, const float *restrict x, int64_t c, int64_t h,
                                int64_t w, int64_t kw, int64_t pad);

/* The same two for the AVX2 family (cpu/winograd_avx2.c): same
 * transforms, scratch and layout of u and du. */
void ddp__cpu_winograd_conv3x3_avx2(int64_t m, int64_t c, const float *u, const float *x,
                                    float *y, int64_t oh, int64_t ow, const float *bias,
                                    bool accumulate, float *scratch);
void ddp__cpu_winograd_dw_sample_avx2(int64_t m, int64_t c, const float *x, const float *dy,
                                      int64_t oh, int64_t ow, float *du, float *scratch);
void ddp__cpu_winograd_dw_finish(int64_t m, int64_t c, const float *du, float *dw);

/* Autocast's bfloat16 GEMM with AVX512_BF16 dot products (cpu/gemm_bf16.c;
 * the contract is ddp__dense_kernels' gemm_bf16, bf16_pack_bytes,
 * bf16_pack_b). It runs with the AVX-512 family on a CPU that has
 * AVX512_BF16 and AVX512BW. */
bool ddp__cpu_has_bf16_dot(void);
bool ddp__cpu_gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                        const float *a, int64_t lda, const float *b, int64_t ldb,
                        const uint16_t *b_packed, float *c, int64_t ldc, ddp_arena *arena);
size_t ddp__cpu_bf16_pack_bytes(int64_t k, int64_t n);
void ddp__cpu_bf16_pack_b(uint16_t *dst, bool trans_b, int64_t k, int64_t n, const float *b,
                          int64_t ldb);

/* Autocast's bfloat16 stride-1 convolution with vdpbf16ps for output rows
 * up to 32 wide (cpu/conv_bf16.c; only when ddp__cpu_has_bf16_dot()),
 * input channels in pairs:
 *   pairs_words: the 32-bit words of a padded pair image (ceil(c/2), hp,
 *     wp) with its 16 words of slack; zero it once, then conv_bf16_pairs
 *     writes each sample's interior: word (q, y + ph, x + pw) = channels 2q
 *     (low half) and 2q + 1 of x (c, h, w) at (y, x) as bfloat16, their
 *     float32's upper halves (x must hold bfloat16 values);
 *   pack: packed (packed_words(m, c, kk)) from w (m, c, kk taps; bfloat16
 *     values), MR = 8 output channels a pair tap;
 *   rows: y (m, oh, ow) = (y if accumulate, else bias or 0) + the sum over
 *     pair taps t2 = (q, a, b) of packed words times xp2[off[t2] + oy*wp +
 *     ox], off[t2] = (q*hp + a)*wp + b, float32 sums; ow <= 32; with
 *     `round`, y stored rounded to bfloat16 (ddp_convert_round_f32's bits). */
int64_t ddp__cpu_conv_bf16_pairs_words(int64_t c, int64_t hp, int64_t wp);
void ddp__cpu_conv_bf16_pairs_avx512(uint32_t *xp2, const float *x, int64_t c, int64_t h,
                                     int64_t w, int64_t ph, int64_t pw, int64_t hp, int64_t wp);
int64_t ddp__cpu_conv_bf16_packed_words(int64_t m, int64_t c, int64_t kk);
void ddp__cpu_conv_bf16_pack(int64_t m, int64_t c, int64_t kk, const float *w, uint32_t *packed);
void ddp__cpu_conv_rows_bf16_avx512(int64_t m, int64_t taps2, const uint32_t *packed,
                                    const uint32_t *xp2, const int64_t *off, int64_t wp, float *y,
                                    int64_t oh, int64_t ow, const float *bias, bool accumulate,
                                    bool round);
/* One input channel (conv1): the taps paired along kernel rows instead,
 * (a, 2j) with (a, 2j + 1) (a zero weight past an odd kw), over the
 * padded image's column pairs (colpairs below): conv_rows_bf16 with
 * off[(c*kh + a)*ceil(kw/2) + j] = (c*hp + a)*wp + 2j and the weights from
 * pack_cols, packed_words(m, 2c, kh*ceil(kw/2)) words. With an odd kw the
 * last j of each kernel row reads the single columns instead (singles
 * below, placed after the pairs: its offset moved by where they start),
 * so that its zero weight meets a zero, never an input (0 x inf = NaN). */
void ddp__cpu_conv_bf16_pack_cols(int64_t m, int64_t c, int64_t kh, int64_t kw, const float *w,
                                  uint32_t *packed);
/* The weight gradient with the outputs in pairs along rows (even ow):
 *   colpairs: dst[i] = the upper halves of xp[i] (low) and xp[i + 1],
 *     i < n (a padded image of bfloat16 values; xp readable to n + 16, dst
 *     writable to n rounded up to 16);
 *   rowpairs: dst[i] = the upper halves of src[2i] and src[2i + 1] (n
 *     floats: a sample's dy (n/2 pair words a channel), to be transposed);
 *   taps_bf16: conv_taps with xp the column pairs and dyp ((oh*ow/2), n)
 *     the pair words of dy transposed: dwt[t][j] += sum over (y, x) of
 *     xp[off[t] + y*wp + x] * dy[j][(y, x)], float32 sums. */
void ddp__cpu_conv_bf16_colpairs_avx512(uint32_t *dst, const float *xp, int64_t n);
/* singles: dst[i] = the upper half of xp[i] (low), the high half zero; xp
 * readable and dst writable as for colpairs. */
void ddp__cpu_conv_bf16_singles_avx512(uint32_t *dst, const float *xp, int64_t n);
void ddp__cpu_conv_bf16_rowpairs_avx512(uint32_t *dst, const float *src, int64_t n);
void ddp__cpu_conv_taps_bf16_avx512(int64_t taps, int64_t n, const uint32_t *xp,
                                    const int64_t *off, int64_t wp, int64_t oh, int64_t ow,
                                    const uint32_t *dyp, float *dwt);

#endif
