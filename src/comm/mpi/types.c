/* ddp's dtypes and reduce ops in MPI's terms. MPI's own ops serve where
 * they compute what ddp's kernels do; the rest (float MIN/MAX, which must
 * propagate NaN as torch.minimum does and MPI's need not; every float16 /
 * bfloat16 op, which MPI lacks) are user ops that call ddp__reduce_into,
 * so a result is rounded as docs/comm.md's float rules say on every
 * backend. */
#include <pthread.h>
#include <stdio.h>

#include "comm/mpi/mpi_internal.h"

MPI_Datatype ddp__mpi_datatype(ddp_dtype dtype) {
  switch (dtype) {
  case DDP_FLOAT32: return MPI_FLOAT;
  case DDP_FLOAT64: return MPI_DOUBLE;
  case DDP_INT32: return MPI_INT32_T;
  case DDP_INT64: return MPI_INT64_T;
  case DDP_FLOAT16:
  case DDP_BFLOAT16: return MPI_UINT16_T;
  case DDP_UINT8: return MPI_UINT8_T;
  default: return MPI_BYTE;
  }
}

/* One user function per (dtype, op): MPI hands the function its datatype
 * only, and float16 and bfloat16 share MPI_UINT16_T. */
#define USER_FN(dt, op)                                                                 \
  static void user_##dt##_##op(void *in, void *inout, int *len, MPI_Datatype *type) {  \
    (void)type;                                                                         \
    ddp__reduce_into(inout, in, (size_t)*len, dt, op);                                  \
  }
#define USER_FNS(dt)                                                                    \
  USER_FN(dt, DDP_REDUCE_SUM) USER_FN(dt, DDP_REDUCE_MIN) USER_FN(dt, DDP_REDUCE_MAX)   \
  USER_FN(dt, DDP_REDUCE_PRODUCT)
USER_FNS(DDP_FLOAT32)
USER_FNS(DDP_FLOAT64)
USER_FNS(DDP_FLOAT16)
USER_FNS(DDP_BFLOAT16)

typedef void user_fn(void *, void *, int *, MPI_Datatype *);
#define ROW(dt) {user_##dt##_DDP_REDUCE_SUM, NULL, user_##dt##_DDP_REDUCE_MIN, \
                 user_##dt##_DDP_REDUCE_MAX, user_##dt##_DDP_REDUCE_PRODUCT}
static user_fn *const user_fns[DDP_DTYPE_COUNT][DDP_REDUCE_OP_COUNT] = {
    [DDP_FLOAT32] = ROW(DDP_FLOAT32),
    [DDP_FLOAT64] = ROW(DDP_FLOAT64),
    [DDP_FLOAT16] = ROW(DDP_FLOAT16),
    [DDP_BFLOAT16] = ROW(DDP_BFLOAT16),
};

/* Made once, after MPI started, and kept until MPI_Finalize frees them. */
static MPI_Op user_ops[DDP_DTYPE_COUNT][DDP_REDUCE_OP_COUNT];
static pthread_once_t user_ops_once = PTHREAD_ONCE_INIT;

static void make_user_ops(void) {
  for (int d = 0; d < DDP_DTYPE_COUNT; d++)
    for (int o = 0; o < DDP_REDUCE_OP_COUNT; o++) {
      user_ops[d][o] = MPI_OP_NULL;
      if (user_fns[d][o]) MPI_Op_create(user_fns[d][o], 1, &user_ops[d][o]);
    }
}

MPI_Op ddp__mpi_op(ddp_dtype dtype, ddp_reduce_op op) {
  if (op == DDP_REDUCE_AVG) op = DDP_REDUCE_SUM;
  bool half = dtype == DDP_FLOAT16 || dtype == DDP_BFLOAT16;
  bool fminmax = (dtype == DDP_FLOAT32 || dtype == DDP_FLOAT64) &&
                 (op == DDP_REDUCE_MIN || op == DDP_REDUCE_MAX);
  if (half || fminmax) {
    pthread_once(&user_ops_once, make_user_ops);
    return user_ops[dtype][op];
  }
  switch (op) {
  case DDP_REDUCE_MIN: return MPI_MIN;
  case DDP_REDUCE_MAX: return MPI_MAX;
  case DDP_REDUCE_PRODUCT: return MPI_PROD;
  default: return MPI_SUM;
  }
}

void ddp__mpi_error_string(int code, char *out, size_t bytes) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  text[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
  snprintf(out, bytes, "MPI error %d (%s)", code, len ? text : "unknown");
}
