/* The MPI backend's pieces (docs/comm.md, "MPI backend"): the backend
 * (mpi.c), MPI types and reduce ops for ddp's dtypes (types.c), and MPI's
 * start, the launch check and the bootstrap store (boot.c). Built only with
 * DDP_HAVE_MPI. */
#ifndef DDP__COMM_MPI_INTERNAL_H
#define DDP__COMM_MPI_INTERNAL_H

#include <mpi.h>

#include "comm/backend.h"

/* Starts MPI if nobody has (MPI_Init_thread asking MPI_THREAD_MULTIPLE: ddp
 * enters MPI from the caller and its progress thread at once), or checks
 * that the program's own MPI_Init gave MPI_THREAD_MULTIPLE. Refuses at once,
 * saying how to start the job, a process no MPI launcher started. Errors
 * name `who`. */
ddp_status ddp__mpi_ensure_init(const char *who);

/* The communicator the next group this thread makes should duplicate
 * (ddp_process_group_from_mpi_comm sets it around its group_create; the
 * backend's create reads it), or MPI_COMM_NULL: build from MPI_COMM_WORLD
 * ranks exchanged through the group's store. */
extern _Thread_local MPI_Comm ddp__mpi_base_comm;

/* Set once an MPI group of this process was aborted (a timeout, a peer's
 * failure, ddp_process_group_abort): MPI cannot take back the operations it
 * holds, so MPI_Finalize would wait for the peers they wait for. ddp then
 * ends the job with MPI_Abort at exit instead, and skips the bootstrap
 * store's closing barrier. */
extern atomic_bool ddp__mpi_failed;

/* leaders.c: a collective of at least this many bytes per rank composes
 * shared memory inside hosts with MPI between their leaders, a smaller one
 * runs flat on MPI; DDP_MPI_HIER_BYTES's default. 4 MiB: the smallest size
 * measured from which the composition beats flat MPI (quiet, 2 nodes x 2
 * ranks: 0.61x at 1 MiB, 1.42x at 4 MiB; docs/comm.md, "Hierarchy"). */
#define DDP__MPI_HIER_DEFAULT_BYTES ((size_t)4 << 20)

/* The largest DDP_MPI_SMALL_BYTES (mpi.c's small_allreduce receives into a
 * buffer this size in the backend), and the tag of its messages on the
 * collectives' communicator, which carries no other point-to-point. */
#define DDP__MPI_SMALL_MAX 1024
#define DDP__MPI_SMALL_TAG 4242

/* MPI's datatype for ddp's dtype (float16 / bfloat16 move as 16-bit words). */
MPI_Datatype ddp__mpi_datatype(ddp_dtype dtype);
/* MPI's reduce op for (dtype, op): MPI's own where it computes as ddp does
 * (integer ops, float SUM and PRODUCT), else one made with MPI_Op_create
 * around ddp's kernels (float MIN/MAX propagate NaN; float16 / bfloat16
 * compute in float32). AVG is SUM (the caller divides). Call after
 * ddp__mpi_ensure_init. */
MPI_Op ddp__mpi_op(ddp_dtype dtype, ddp_reduce_op op);

/* The communicator a backend made by ddp__backend_mpi_create runs its
 * collectives on (a duplicate of the group's), or MPI_COMM_NULL for a
 * backend of another kind. For bench/bench_mpi_allreduce.c, which times
 * MPI's own call on it against ddp_allreduce. */
MPI_Comm ddp__mpi_backend_comm(const ddp__backend *b);

/* Up to how many bytes per rank a blocking allreduce of that backend runs
 * as ddp's recursive doubling over point-to-point (mpi.c, small_rule; 0:
 * never, or a backend of another kind). For the tests and the bench. */
size_t ddp__mpi_small_bytes(const ddp__backend *b);

/* "MPI_ERR_TRUNCATE: message truncated" for an MPI error code. */
void ddp__mpi_error_string(int code, char *out, size_t bytes);

#endif /* DDP__COMM_MPI_INTERNAL_H */
