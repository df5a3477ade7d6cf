/* Internals of the pipeline layer shared by its files: the schedule object
 * (schedule.c builds and prints it, check.c proves it), the point-to-point
 * channels (channels.c), the stage split (split.c) and the executor
 * (pipeline.c, exec.c). Not installed. */
#ifndef DDP__PIPELINE_INTERNAL_H
#define DDP__PIPELINE_INTERNAL_H

#include "ddp/pipeline.h"

struct ddp_pipeline_schedule {
  ddp_pipeline_schedule_kind kind;
  int n_ranks;        /* p */
  int n_microbatches; /* M */
  int virtual_stages; /* v */
  int *counts;                   /* (p) actions per rank */
  ddp_pipeline_action **lists;   /* (p) lists, each counts[r] long */
};

/* The rank that holds global stage g (looped placement). */
static inline int ddp__pp_rank_of(int n_ranks, int stage) { return stage % n_ranks; }

/* The bounds the built-in kinds promise (see ddp_pipeline_schedule_report);
 * -1 for none. */
int ddp__pp_promised_stage(const ddp_pipeline_schedule *s, int stage);
int ddp__pp_promised_rank(const ddp_pipeline_schedule *s, int rank);

/* ---- channels.c: point-to-point transfers between neighbouring stages -----
 * A channel carries one kind (activations or gradients) from one rank to
 * another, in order, on a two-rank subgroup's point-to-point lane.
 * Posting never blocks; a transfer completes in the background and is
 * waited for with its handle. */
typedef struct ddp__pp_channels ddp__pp_channels;
typedef struct ddp__pp_xfer ddp__pp_xfer; /* one posted transfer */

enum { DDP__PP_ACT = 0, DDP__PP_GRAD = 1 };

/* Creates the channels the schedule uses between this rank and its peers
 * (collective over pg: every rank calls it with the same schedule). */
ddp_status ddp__pp_channels_create(ddp__pp_channels **out, ddp_process_group *pg,
                                   const ddp_pipeline_schedule *sched, double timeout_s);
void ddp__pp_channels_destroy(ddp__pp_channels *ch);
/* Aborts every channel (peers waiting on this rank fail fast). */
void ddp__pp_channels_abort(ddp__pp_channels *ch);
/* Posts a send / receive of `bytes` on the channel of `kind` to / from
 * `peer`; *work is the handle (free with ddp_work_free after waiting). */
ddp_status ddp__pp_post(ddp__pp_channels *ch, bool send, int kind, int peer, void *buf,
                        size_t bytes, ddp_work **work);
/* Records the first failure where every stage can read it (the pipeline
 * group's store), so stages that only see their neighbour's abort report
 * the cause; returns the message to report (the first recorded one). */
void ddp__pp_record_failure(ddp__pp_channels *ch, const char *msg, char *first, size_t bytes);

#endif /* DDP__PIPELINE_INTERNAL_H */
