/* A parameter server's state (server.c), shared with its checkpoint code
 * (server_ckpt.c). Not installed. */
#ifndef DDP_PS_SERVER_INTERNAL_H
#define DDP_PS_SERVER_INTERNAL_H

#include <pthread.h>

#include "ps/ps_internal.h"

/* The most values an evaluation's sum carries. */
#define DDP__PS_MAX_SUM 16

/* A trainer's snapshot: the reply of its pulls (owned parameters, then on
 * server 0 the buffers and counters), sized once. */
typedef struct ddp__ps_snap {
  ddp__ps_header header;
  ddp_tensor *tensors; /* views into data */
  ddp_tensor **ptrs;
  void *data;
} ddp__ps_snap;

typedef struct ddp__ps_watch {
  struct ddp_ps_server *s;
  int32_t t;
} ddp__ps_watch;

typedef struct ddp__ps_trainer {
  int32_t pushes;            /* owned tensors pushed for the step in progress */
  bool pull_in;              /* its pull for that step arrived */
  bool delta_in;             /* sync, server 0: its buffer deltas are in the slots */
  ddp_rpc_reply *pull_reply; /* a deferred pull */
  int64_t pull_step;
  ddp_rpc_reply *meet_reply; /* server 0: its place in the open meeting */
  ddp_rpc_future *watch, *retired;
  ddp__ps_watch watch_user;
  /* What its last pull carried, the base of its next gradients' staleness:
   * the slowest live trainer's clock then, and each owned tensor's version
   * (shard order; points into the server's pulled_versions). */
  int64_t pulled_min;
  int64_t *pulled_version;
} ddp__ps_trainer;

/* How stale the gradients a server received were, counted at each push.
 * steps: the gradient's step minus the slowest live trainer's clock when
 * the parameters it was computed from were pulled (sync: always 1; ssp:K:
 * at most K + 1); updates: how many updates of the tensor came between
 * that pull and the push (the other trainers' gradients it missed). The
 * last bin holds that many or more. */
#define DDP__PS_STALE_BINS 16
typedef struct ddp__ps_staleness {
  int64_t steps[DDP__PS_STALE_BINS];
  int64_t updates[DDP__PS_STALE_BINS];
  int64_t pushes;
  int64_t max_steps, max_updates;
  /* The slowest and fastest clocks when a trainer first stopped stepping
   * (an evaluation, done or dropped): the slowest then has stop_max -
   * stop_min steps to make with fewer trainers, fresher than the rest. */
  int64_t stop_min, stop_max;
} ddp__ps_staleness;

struct ddp_ps_server {
  ddp_ps_server_options o;
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_model *model;
  ddp_rpc_agent *agent;
  pthread_mutex_t mu; /* everything below */
  pthread_cond_t cv;  /* a trainer finished, dropped, or the server failed */
  ddp__ps_shard shard;
  ddp__ps_clock clock;
  ddp__ps_trainer *trainers;
  ddp__ps_snap *snaps;
  int64_t nb, nc; /* server 0: buffer floats, counters; 0 elsewhere */
  /* sync, server 0: each trainer's buffer deltas of the step in progress. */
  float *delta_slots;
  int64_t *counter_slots;
  bool buffer_deltas_pending;
  int64_t buffer_step;
  struct {
    bool active;
    int64_t seq;
    int32_t kind, count;
    double *values; /* (trainers, DDP__PS_MAX_SUM) */
    double sums[DDP__PS_MAX_SUM];
    ddp__ps_header header;
    char reply_payload[sizeof(ddp__ps_header) + DDP__PS_MAX_SUM * sizeof(double)];
    ddp_ps_save_info save;
  } meet;
  bool saving, stopping, registered;
  ddp_status failed;  /* sync after a death: every later request fails with ... */
  char failure[512];  /* ... this (written once, before failed is set) */
  int64_t last_heard_ns;
  int64_t max_step;
  /* The rate while every trainer trains: steps finished from the first
   * until a trainer leaves, and when. */
  bool all_training_over;
  int64_t window_steps, window_first_ns, window_last_ns;
  ddp_ps_server_stats stats;
  int64_t *pulled_versions; /* (trainers, owned tensors) */
  ddp__ps_staleness staleness;
  /* DDP_PS_SNAPSHOT=PATH (server 0 of 1, a debugging aid of issue 36): the
   * model's state dict (parameters and buffers) is written to this path
   * when a trainer first stops stepping, so the model before the others'
   * last steps can be evaluated (`ddp-train --init PATH --epochs 0`).
   * Empty when unset: nothing else is done. */
  char snapshot_path[1024];
  /* DDP_PS_SNAPSHOT_STEP=N: instead, when the slowest live trainer first
   * finished step N (the same moment in every mode: a control that tells
   * what the last steps of a run without a tail bring). 0: the first stop. */
  int64_t snapshot_step;
  bool snapshot_written;
  /* server 0 with a save path (server_ckpt.c): a whole-model optimizer and
   * schedule the checkpoint is assembled in, and a staging buffer. */
  ddp_optimizer *save_opt;
  ddp_scheduler *save_sched;
  float *save_stage;
};

/* Trainer t is gone (its watch failed with `why`): dropped, or in sync the
 * server fails. Takes the lock. */
void ddp__ps_server_trainer_lost(ddp_ps_server *s, int32_t t, const char *why);

/* The staleness counted so far (a copy, taken under the lock). */
void ddp__ps_server_staleness(ddp_ps_server *s, ddp__ps_staleness *out);

/* ---- server_ckpt.c ---- */
/* Loads o.resume_path into the model and the owned tensors' optimizers;
 * *start is the saved step. */
ddp_status ddp__ps_server_resume(ddp_ps_server *s, int64_t *start);
ddp_status ddp__ps_server_save_init(ddp_ps_server *s);
void ddp__ps_server_save_free(ddp_ps_server *s);
/* This server's shard as a message (the reply of ps.state): per owned
 * tensor its parameters then its optimizer state entries; the payload is
 * a header and, per owned tensor, its parameter index and whether its
 * optimizer holds state. Points into the server's memory: call under the
 * lock, with no trainer pushing (a save meeting holds them all). */
void ddp__ps_server_export(ddp_ps_server *s, ddp_rpc_message *m);
/* Server 0, once every live trainer is at the save meeting: gathers every
 * server's shard and writes the checkpoint. */
ddp_status ddp__ps_server_save(ddp_ps_server *s);

#endif
