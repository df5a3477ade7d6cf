/* The threads of DataParallel's replicas (data_parallel.c): persistent,
 * one per replica but the first (which is the caller), each pinned to a
 * core where it can be; a job runs on all of them at once, and a barrier
 * and a fixed-order sum over them serve SyncBatchNorm and the gradient
 * reduction. Every wait has the pool's timeout; one replica's failure
 * releases the others at once, and the error names the replica. */
#ifndef DDP__PARALLEL_REPLICA_POOL_H
#define DDP__PARALLEL_REPLICA_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

typedef struct ddp__replica_pool ddp__replica_pool;

/* One replica's part of a job; runs on replica r's thread (r 0: the caller). */
typedef ddp_status (*ddp__replica_job)(void *ctx, int replica);

/* n replicas; cpus[r] (r >= 1) the core to pin replica r's thread to, or -1;
 * sum_doubles: the largest count ddp__replica_pool_allreduce_sum takes. */
ddp_status ddp__replica_pool_create(ddp__replica_pool **out, int n, const int *cpus,
                                    int64_t timeout_ms, size_t sum_doubles);
/* Stops and joins the threads (each within the timeout; one that does not
 * end is left detached). NULL ok. */
void ddp__replica_pool_destroy(ddp__replica_pool *pool);

/* Runs job(ctx, r) for every replica r, r 0 on the calling thread, and
 * waits (timeout) for all. Returns the lowest failed replica's error,
 * its message prefixed "replica r (core c): <what>: ". After a timeout the
 * pool is broken: every later run fails at once (DDP_ERR_TIMEOUT). */
ddp_status ddp__replica_pool_run(ddp__replica_pool *pool, ddp__replica_job job, void *ctx,
                                 const char *what);

/* Inside a job: waits until every replica has reached it. Fails (without
 * waiting longer) when another replica's part has failed, or after the
 * timeout. */
ddp_status ddp__replica_pool_barrier(ddp__replica_pool *pool, int replica);

/* Inside a job, every replica with the same count: buf[0..count) becomes
 * the sum over replicas 0, 1, ..., n-1 in that order (the same bits on
 * every replica and every run). */
ddp_status ddp__replica_pool_allreduce_sum(ddp__replica_pool *pool, int replica, double *buf,
                                           size_t count);

int ddp__replica_pool_cpu(const ddp__replica_pool *pool, int replica);

#endif /* DDP__PARALLEL_REPLICA_POOL_H */
