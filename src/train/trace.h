/* The trainer's timeline (ddp_train_options.trace_path, ddp-train --trace):
 * events kept in a buffer sized once when the run starts and written as
 * Chrome trace event JSON when it ends. Internal: never installed; the
 * format is in docs/debugging.md ("Timeline"), and src/launch/trace_merge.c
 * reads it back to merge the ranks' files. */
#ifndef DDP_SRC_TRAIN_TRACE_H
#define DDP_SRC_TRAIN_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

/* What an event is. The step's phases nest in STEP on the training
 * thread; AUTOGRAD, WAIT and BLOCKING nest in BACKWARD; ALLREDUCE goes on
 * the communication track (an async slice: the buckets' reductions
 * overlap one another). */
typedef enum ddp__trace_kind {
  DDP__TRACE_STEP = 0,
  DDP__TRACE_LOAD,
  DDP__TRACE_FORWARD,
  DDP__TRACE_BACKWARD,
  DDP__TRACE_AUTOGRAD,   /* ddp_backward inside the wrapper's backward */
  DDP__TRACE_WAIT,       /* finalize waiting for a bucket's reduction */
  DDP__TRACE_BLOCKING,   /* the last bucket, reduced on the training thread */
  DDP__TRACE_OPTIMIZER,
  DDP__TRACE_LOSS,       /* the global batch's loss, reduced over the group */
  DDP__TRACE_EVALUATE,
  DDP__TRACE_ALLREDUCE,  /* a bucket's reduction from launch to completion */
  DDP__TRACE_KIND_COUNT
} ddp__trace_kind;

/* One event: 48 bytes, times on ddp_time_ns's clock. */
typedef struct ddp__trace_event {
  int64_t start_ns, end_ns;
  int64_t step;             /* the optimizer step it belongs to (1-based) */
  int64_t numel;            /* buckets: gradients reduced */
  int32_t kind;             /* ddp__trace_kind */
  int32_t bucket;           /* buckets: the index; else -1 */
  int32_t params_not_ready; /* buckets: the wrapper's record at launch */
  int32_t pad;
} ddp__trace_event;

typedef struct ddp__trace ddp__trace;

/* Creates a trace bound for `path` (copied) with room for `capacity`
 * events, allocated now, and takes its clock origin: a CLOCK_MONOTONIC
 * reading paired with CLOCK_REALTIME, which the merge aligns ranks on.
 * rank and world_size go into the file. NULL out on error. */
ddp_status ddp__trace_create(ddp__trace **out, const char *path, int rank, int world_size,
                             size_t capacity);
/* Appends an event; when the buffer is full the event is counted as
 * dropped (the file says how many) and nothing allocates. */
void ddp__trace_add(ddp__trace *tr, ddp__trace_kind kind, int64_t step, int64_t start_ns,
                    int64_t end_ns);
void ddp__trace_add_bucket(ddp__trace *tr, ddp__trace_kind kind, int64_t step, int bucket,
                           int64_t numel, int params_not_ready, int64_t start_ns,
                           int64_t end_ns);
/* Writes every event to the path (a temporary name, then rename). May be
 * called more than once; each call rewrites the whole file. */
ddp_status ddp__trace_write(ddp__trace *tr);
/* NULL is fine. Does not write. */
void ddp__trace_destroy(ddp__trace *tr);

#endif
