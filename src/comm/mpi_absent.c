/* ddp_process_group_from_mpi_comm in a build without MPI (src/comm/mpi/
 * absent): it links, and says how to get the backend. */
#include "comm/comm_internal.h"

/* ISO C wants a declaration in every file. */
typedef int ddp__mpi_absent_file;

#ifndef DDP_HAVE_MPI
ddp_status ddp_process_group_from_mpi_comm(const void *mpi_comm, const ddp_process_group_options *options,
                                           ddp_process_group **out) {
  if (out) *out = NULL;
  return ddp__backend_absent(DDP__BACKEND_MPI);
}
#endif
