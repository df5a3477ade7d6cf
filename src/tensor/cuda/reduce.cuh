/* Fixed-order reductions for the CUDA kernels (device code, CUDA C++
 * only): the one copy the basic, dense and pointwise kernels share.
 *
 * Determinism: every reduction is a fixed tree (warp butterflies, then the
 * warps' results in shared memory summed by warp 0), and values are never
 * combined with atomics, so a kernel gives the same bits on every run. */
#ifndef DDP__TENSOR_CUDA_REDUCE_CUH
#define DDP__TENSOR_CUDA_REDUCE_CUH

/* ---- fixed-order reductions ----
 * All 32 lanes of a warp must call the warp forms, and every thread of the
 * block the block forms (no thread may have returned): blockDim.x is a
 * multiple of 32, at most 1024. */

template <typename T> __device__ __forceinline__ T ddp__warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* The larger of the two; a NaN never wins (as `v > m ? v : m` on the CPU). */
__device__ __forceinline__ float ddp__warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other > v ? other : v;
  }
  return v;
}

__device__ __forceinline__ long long ddp__warp_min_i64(long long v) {
  for (int o = 16; o > 0; o >>= 1) {
    long long other = __shfl_xor_sync(0xffffffffu, v, o);
    v = other < v ? other : v;
  }
  return v;
}

/* The block's sum of v (double, or float where the kernel sums in
 * float), valid in thread 0. Ends with a barrier, so it may be called
 * again right away. Thread 0's result adds the same values in the same
 * order as a shuffle-down tree would. */
template <typename T> __device__ __forceinline__ T ddp__block_sum(T v) {
  __shared__ T warp_part[32];
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = ddp__warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = (blockDim.x + 31) >> 5;
    v = ddp__warp_sum(lane < warps ? warp_part[lane] : T(0));
  }
  __syncthreads();
  return v;
}

/* The block's minimum of v, valid in every thread. */
__device__ __forceinline__ long long ddp__block_min_i64(long long v) {
  __shared__ long long warp_part[32];
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = ddp__warp_min_i64(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  const unsigned warps = (blockDim.x + 31) >> 5;
  long long m = warp_part[0];
  for (unsigned w = 1; w < warps; w++) m = warp_part[w] < m ? warp_part[w] : m;
  __syncthreads();
  return m;
}

#endif /* DDP__TENSOR_CUDA_REDUCE_CUH */
