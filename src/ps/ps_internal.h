/* The parameter server's insides (src/ps/), shared with the tests (the
 * trainer's strategy, src/train/strategy_ps.c, uses ps.h only). Not
 * installed.
 * The pure parts (the clock table, the shard's update logic) know nothing of
 * RPC, so tests drive them directly; server.c and client.c put them on the
 * wire (wire.h). */
#ifndef DDP_PS_INTERNAL_H
#define DDP_PS_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "ddp/ps.h"
#include "ddp/tensor.h"

/* ---- The clock table (clock.c) -----------------------------------------------
 * One per server: how many steps each trainer has finished on this server
 * (every push of the step applied or stored, and its pull arrived), and
 * whether it is live, done or dropped. A pull for step s (the parameters
 * for step s + 1) may be answered once the trainer's own step s is in
 * (read your writes) and:
 *   sync    every live trainer has finished step s (the averaged update is made);
 *   ssp:K   the slowest live trainer has finished step s - K;
 *   async   nothing more. */
typedef enum ddp__ps_trainer_state {
  DDP__PS_LIVE = 0,
  DDP__PS_FINISHED = 1, /* finished its steps (ddp_ps_client_finish) */
  DDP__PS_DROPPED = 2, /* died; async and ssp go on without it */
} ddp__ps_trainer_state;

typedef struct ddp__ps_clock {
  int32_t n;
  ddp_ps_mode mode;
  int32_t staleness;
  int64_t *clock; /* n: steps finished */
  uint8_t *state; /* n: ddp__ps_trainer_state */
} ddp__ps_clock;

/* Every trainer live at clock `start` (0, or the resumed step). */
ddp_status ddp__ps_clock_init(ddp__ps_clock *c, int32_t n, ddp_ps_mode mode, int32_t staleness,
                              int64_t start);
void ddp__ps_clock_free(ddp__ps_clock *c);
/* The slowest live trainer's clock; INT64_MAX when none is live. */
int64_t ddp__ps_clock_min(const ddp__ps_clock *c);
int32_t ddp__ps_clock_live(const ddp__ps_clock *c);
/* Whether trainer t's pull for step s may be answered now (rule above). */
bool ddp__ps_clock_may_pull(const ddp__ps_clock *c, int32_t t, int64_t s);

/* ---- A server's shard (update.c) --------------------------------------------
 * The owned parameter tensors of one server, each with its own optimizer
 * over the model's memory (params at the tensor's offset, its gradient
 * buffer the accumulator). Not thread-safe: the server holds its lock. */
typedef struct ddp__ps_tensor {
  int32_t param;      /* index in the model */
  int64_t offset;     /* in floats, in the model's flat buffers */
  int64_t numel;
  ddp_optimizer *opt; /* over params_flat + offset, grads_flat + offset */
  int64_t version;    /* updates applied (sync: the last step applied) */
  int32_t contributions; /* sync: trainers that pushed this step */
  double pending_lr;     /* sync: the lr of this step's pushes */
} ddp__ps_tensor;

typedef struct ddp__ps_shard {
  ddp_model *model; /* borrowed */
  ddp_ps_mode mode;
  int32_t num_trainers;
  int32_t n;              /* owned tensors */
  ddp__ps_tensor *tensors;
  int32_t *local_of;      /* model param index -> position in tensors, -1 if not owned */
  int64_t owned_numel;    /* floats owned */
  /* sync: each trainer's gradient of each owned tensor for the step in
   * progress, summed in trainer order once all are in, so the result does
   * not depend on arrival order: (num_trainers, owned_numel). */
  float *slots;
  uint8_t *pushed;        /* sync: (num_trainers, n): this step's push stored */
  int64_t updates;        /* optimizer steps made */
} ddp__ps_shard;

/* The shard of server `server` under ddp_ps_shard over the model's
 * parameters, with an optimizer per tensor (options `optim`). */
ddp_status ddp__ps_shard_init(ddp__ps_shard *sh, ddp_model *model, int32_t server,
                              int32_t num_servers, int32_t num_trainers, ddp_ps_mode mode,
                              const ddp_optim_options *optim);
void ddp__ps_shard_free(ddp__ps_shard *sh);
/* Trainer t's gradient g (the tensor's numel floats) of model parameter
 * `param` for step `step`, at learning rate lr. async/ssp: applied at once
 * (one optimizer step). sync: stored; once every one of `live` trainers
 * has pushed this tensor for the step, their mean (summed in trainer
 * order) is applied and *updated set. Errors: a parameter this server does
 * not own, a second push of the same step (DDP_ERR_STATE), a push for
 * another step than the one in progress in sync. */
ddp_status ddp__ps_shard_push(ddp__ps_shard *sh, int32_t t, int32_t param, int64_t step,
                              const float *g, double lr, int32_t live, bool *updated);
/* sync: after trainer drops, whether tensors wait for nobody else: applies
 * every tensor whose pushes are all in for `live` trainers. */
ddp_status ddp__ps_shard_flush(ddp__ps_shard *sh, int32_t live);

/* ---- The wire (messages between trainers and servers) -----------------------
 * Every payload starts with this header; lengths are checked before use. */
#define DDP__PS_MAGIC 0x31535044u /* "DPS1" */

enum {
  DDP__PS_PUSH = 1,  /* tensors: gradients; payload: header + int32 param index each */
  DDP__PS_PULL = 2,  /* step s finished; server 0: tensors = buffer deltas (floats, counters) */
  DDP__PS_MEET = 3,  /* a meeting of the live trainers at server 0 (meet kinds below) */
  DDP__PS_DONE = 4,  /* this trainer is finished */
  DDP__PS_STATE = 5, /* server 0 -> others: your shard's parameters and optimizer state */
};

enum {
  DDP__PS_MEET_BARRIER = 1, /* everyone here (before an evaluation's pull) */
  DDP__PS_MEET_SUM = 2,     /* sum the trainers' values (evaluation's sums) */
  DDP__PS_MEET_SAVE = 3,    /* server 0 writes the checkpoint (payload: ddp_ps_save_info) */
};

typedef struct ddp__ps_header {
  uint32_t magic;
  uint32_t kind;
  int32_t trainer;
  int32_t count;    /* push: tensors; meet: values; pull reply: tensors */
  int64_t step;     /* push/pull: the trainer's step; meet: the meeting's sequence */
  double lr;        /* push: the lr of the update */
  int32_t meet_kind;
  int32_t reserved32;
  int64_t base_step; /* pull reply: the step training resumes from (first pull) */
} ddp__ps_header;

/* What a save meeting carries besides the header: ddp_ps_save_info (ps.h). */

/* Function names (registered on servers / trainers). */
#define DDP__PS_FN_PUSH "ps.push"
#define DDP__PS_FN_PULL "ps.pull"
#define DDP__PS_FN_MEET "ps.meet"
#define DDP__PS_FN_DONE "ps.done"
#define DDP__PS_FN_STATE "ps.state"
#define DDP__PS_FN_WATCH "ps.watch"

/* pull step meaning "no step: just the current parameters" (the first pull,
 * an evaluation's). */
#define DDP__PS_PULL_NOW (-1)

/* ---- Shared by server and client (registry.c) ------------------------------- */

/* RPC functions are registered once per process; a request finds its
 * server or client by the name of the agent serving it, so several workers
 * (threads, in tests) may live in one process. Names are registered before
 * ddp_rpc_init, so no request can arrive for a worker not yet known. */
ddp_status ddp__ps_registry_add(const char *name, void *obj);
void ddp__ps_registry_remove(const void *obj);
void *ddp__ps_registry_find(const ddp_rpc_call *call);
/* The options' timeout: timeout_s, else $DDP_TIMEOUT, else 1800 s. */
double ddp__ps_timeout(const ddp_ps_options *o);
/* Checks a received payload: magic, kind, and a size of the header plus
 * count elements of elem_bytes (naming `who` in the error). */
ddp_status ddp__ps_header_check(const ddp_rpc_message *m, uint32_t kind, size_t elem_bytes,
                                const char *who, const ddp__ps_header **out);

/* ---- The trainer's side (client.c): figures for the tests ----------------- */

/* The steps a training loop takes (bind, push, end_step, eval_begin, sum,
 * save) are public: ps.h, "The trainer's steps". */

/* Pushes so far made from backward's grad hook (overlapping the rest of
 * backward) and at the step's end (after it), and the parameter pushed
 * first in the first step (backward's first final gradient: the last
 * layer's). */
void ddp__ps_client_push_counts(const ddp_ps_client *c, int64_t *in_backward, int64_t *after,
                                int32_t *first_param);
/* Where the time of the last step's end went: waiting for push
 * acknowledgements, for the pull (seconds). */
void ddp__ps_client_last_wait(const ddp_ps_client *c, double *push_wait_s, double *pull_wait_s);

#endif /* DDP_PS_INTERNAL_H */
