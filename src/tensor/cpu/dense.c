/* CPU dense kernels (gemm through OpenBLAS, convolution, pooling). */
#include "tensor/kernels_dense.h"

const ddp__dense_kernels ddp__cpu_dense_kernels = {0};
