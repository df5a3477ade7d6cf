/* NCCL at run time (docs/comm.md, "The NCCL backend"): libnccl is hundreds
 * of MB and not on every machine a CUDA build runs on, so libddp does not
 * link it; the NCCL backend loads it with dlopen the first time a group
 * asks for it and resolves the functions it calls. The prototypes are
 * nccl.h's (the build's header; NCCL keeps its ABI within major version 2),
 * taken with __typeof__ so that a wrong signature does not compile. Where
 * the library is looked for, in order:
 *   1. $DDP_NCCL_LIBRARY, a path (when set, nothing else is tried);
 *   2. "libnccl.so.2" through the dynamic loader's search (LD_LIBRARY_PATH,
 *      the loader's cache): the machine's own NCCL, e.g. PyTorch's wheel's
 *      (nvidia/nccl/lib) put on LD_LIBRARY_PATH;
 *   3. libnccl.so.2 beside the CUDA toolkit the build found (DDP_NCCL_DIR).
 * Not installed; src/comm/nccl/ only. */
#ifndef DDP__COMM_NCCL_API_H
#define DDP__COMM_NCCL_API_H

#include <nccl.h>
#include <stdbool.h>

#include "ddp/core.h"

typedef struct ddp__nccl_api {
  void *handle;   /* dlopen's */
  char path[512]; /* what was loaded, as named to dlopen */
  int version;    /* ncclGetVersion's code: 22809 for 2.28.9 */
  __typeof__(ncclGetVersion) *GetVersion;
  __typeof__(ncclGetErrorString) *GetErrorString;
  __typeof__(ncclGetLastError) *GetLastError;
  __typeof__(ncclGetUniqueId) *GetUniqueId;
  __typeof__(ncclCommInitRank) *CommInitRank;
  __typeof__(ncclCommDestroy) *CommDestroy;
  __typeof__(ncclCommAbort) *CommAbort;
  __typeof__(ncclCommGetAsyncError) *CommGetAsyncError;
  __typeof__(ncclAllReduce) *AllReduce;
  __typeof__(ncclBroadcast) *Broadcast;
  __typeof__(ncclReduce) *Reduce;
  __typeof__(ncclAllGather) *AllGather;
  __typeof__(ncclReduceScatter) *ReduceScatter;
  __typeof__(ncclSend) *Send;
  __typeof__(ncclRecv) *Recv;
  __typeof__(ncclGroupStart) *GroupStart;
  __typeof__(ncclGroupEnd) *GroupEnd;
} ddp__nccl_api;

/* The process's NCCL, loaded at the first call that succeeds (thread-safe;
 * a failure names every path tried and the loader's reason for each, and
 * the next call tries again). *out borrowed for the process's life. DDP_ERR_UNSUPPORTED when no library loads or one lacks a function
 * this backend calls. */
ddp_status ddp__nccl_api_get(const ddp__nccl_api **out);

/* Tries candidates[0..n) in order with dlopen and fills *api from the
 * first that loads and has every function; the error names each path tried
 * and why it failed. For ddp__nccl_api_get and tests (not cached; the
 * handle stays open). */
ddp_status ddp__nccl_api_open(const char *const *candidates, int n, ddp__nccl_api *api);

/* The candidates ddp__nccl_api_get tries, from the environment and the
 * build (see above): fills up to 3 into out, returns how many. */
int ddp__nccl_api_candidates(const char **out);

/* "2.28.9" from a version code (both of NCCL's encodings). */
void ddp__nccl_version_str(int code, char *buf, size_t bytes);

#endif /* DDP__COMM_NCCL_API_H */
