/* ddp ps: parameter-server training over RPC (include/ddp/rpc.h). The world
 * is S server workers ("ps0".."ps<S-1>", ranks 0..S-1) and N trainers
 * ("trainer0".."trainer<N-1>", ranks S..S+N-1). The model's parameters and
 * their optimizer state are sharded over the servers by whole tensors,
 * balanced by size (ddp_ps_shard); the buffers (BatchNorm's running
 * statistics) live on server 0. Trainers compute gradients on their shard of
 * the data, push each as backward makes it final, and pull fresh parameters
 * before the next step. docs/ps.md has the rules and the reasons.
 *
 * Modes: sync (each step's gradients averaged over every trainer before one
 * update: the mathematics of data parallelism), async (each push applied on
 * arrival), ssp:K (pushes applied on arrival; a trainer's pull for step s
 * waits until the slowest live trainer has finished step s - K).
 *
 * The model of use (ddp-train --param-servers S --ps-mode M does this):
 *
 *   // every worker builds the same model (same seed), then:
 *   if (rank < S) {
 *     ddp_ps_server *srv;
 *     DDP_TRY(ddp_ps_server_create(&srv, model, &server_options)); // before ddp_rpc_init
 *     DDP_TRY(ddp_rpc_init(&rpc_options, &agent));                  // name: ddp_ps_worker_name
 *     s = ddp_ps_server_serve(srv, agent, NULL); // until every trainer is done or dropped
 *   } else {
 *     ddp_ps_client *c;
 *     DDP_TRY(ddp_ps_client_create(&c, &ps_options, rank - S)); // before ddp_rpc_init
 *     DDP_TRY(ddp_rpc_init(&rpc_options, &agent));
 *     DDP_TRY(ddp_ps_client_attach(c, agent));
 *     train_options.param_server = c;        // the trainer's parameter-server strategy
 *     ... ddp_trainer_create / ddp_trainer_run ...
 *     ddp_ps_client_finish(c);               // tells the servers this trainer is done
 *   }
 *   ddp_rpc_shutdown(agent, true, -1);
 *
 * Threads: a server's functions run on the RPC pool's threads under the
 * server's lock; a client is used by one trainer thread. */
#ifndef DDP_PS_H
#define DDP_PS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/io.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/rpc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ddp_ps_mode {
  DDP_PS_SYNC = 0,  /* a barrier per step: gradients averaged over all trainers */
  DDP_PS_ASYNC = 1, /* each push applied on arrival (Hogwild-style) */
  DDP_PS_SSP = 2,   /* bounded staleness: no trainer more than K steps ahead */
} ddp_ps_mode;

/* "sync", "async" or "ssp:K" (K >= 0) into *mode and *staleness (0 unless
 * ssp). DDP_ERR_INVALID naming the text otherwise. */
ddp_status ddp_ps_mode_parse(const char *text, ddp_ps_mode *mode, int32_t *staleness);
/* "sync", "async", "ssp"; "?" for anything else. */
const char *ddp_ps_mode_name(ddp_ps_mode mode);

/* What servers and trainers must agree on (the same on every worker).
 * Start from ddp_ps_defaults(), then set the counts of the job. A
 * zero-initialised struct has no servers and is refused. */
typedef struct ddp_ps_options {
  int32_t num_servers;  /* S >= 1 */
  int32_t num_trainers; /* N >= 1 */
  ddp_ps_mode mode;
  int32_t staleness;    /* ssp's K (>= 0); ignored otherwise */
  /* How long a trainer's pull or a meeting (evaluation, checkpoint) may
   * wait for the others, and how long a server may hear nothing from any
   * trainer; <= 0: $DDP_TIMEOUT, else 1800 s. */
  double timeout_s;
  uint64_t reserved[4]; /* zero */
} ddp_ps_options;
DDP_STRUCT_SIZE(ddp_ps_options, 56);

/* The defaults: one server, one trainer, DDP_PS_SYNC, staleness 0,
 * timeout_s 0 ($DDP_TIMEOUT, else 1800 s). */
ddp_ps_options ddp_ps_defaults(void);

/* Checks the options (counts, mode, staleness): DDP_ERR_INVALID naming the
 * field. */
ddp_status ddp_ps_options_check(const ddp_ps_options *o);

/* The RPC worker name of global rank `rank` in a world of o->num_servers
 * servers first: "ps<rank>" or "trainer<rank - S>". */
void ddp_ps_worker_name(const ddp_ps_options *o, int32_t rank, char out[DDP_RPC_MAX_NAME_BYTES]);

/* The sharding: owner[i] in [0, num_servers) for each of n tensors of
 * numel[i] elements. Whole tensors, balanced by size: largest first (ties:
 * lower index first) onto the server holding the fewest elements so far
 * (ties: lower server), which keeps the largest server within the largest
 * tensor of the mean. Deterministic: every rank computes the same from the
 * same sizes. DDP_ERR_INVALID when num_servers < 1 or n < num_servers (a
 * server without a tensor would hold nothing; use fewer servers). */
ddp_status ddp_ps_shard(const int64_t *numel, int32_t n, int32_t num_servers, int32_t *owner);

/* ---- Server ---------------------------------------------------------------- */

typedef struct ddp_ps_server ddp_ps_server;

/* Start from ddp_ps_server_defaults(). */
typedef struct ddp_ps_server_options {
  ddp_ps_options ps;
  int32_t index;           /* this server, 0..S-1 */
  int32_t reserved32;
  ddp_optim_options optim; /* the update of each parameter; lr comes with each push */
  /* The checkpoint's scheduler (StepLR when step_lr_size > 0), as the
   * trainers' (their state arrives with a save). */
  int64_t step_lr_size;
  double step_lr_gamma;
  /* Server 0 writes checkpoints here when the trainers save (NULL: saves are
   * refused); every server loads resume_path (NULL: fresh) at create. */
  const char *save_path;
  const char *resume_path;
  const ddp_kv *checkpoint_meta; /* compared on resume, written on save (borrowed) */
  size_t checkpoint_meta_count;
  uint64_t reserved[4];
} ddp_ps_server_options;
DDP_STRUCT_SIZE(ddp_ps_server_options, 240);

/* The defaults: ps = ddp_ps_defaults(), index 0, optim =
 * ddp_optim_defaults(DDP_OPTIM_SGD), no scheduler (step_lr_size 0,
 * step_lr_gamma 0.1 as StepLR's), no checkpoints (save_path, resume_path
 * and checkpoint_meta NULL). */
ddp_ps_server_options ddp_ps_server_defaults(void);

/* Creates server `o->index` over `model` (borrowed; built identically on
 * every worker: its parameters are the initial ones, its buffers server 0's
 * starting statistics; on resume both come from the checkpoint). Makes one
 * optimizer per owned parameter tensor (elementwise updates, so the shards
 * together equal one optimizer over the model) and registers the servers'
 * RPC functions; call before ddp_rpc_init. Free with ddp_ps_server_destroy. */
ddp_status ddp_ps_server_create(ddp_ps_server **out, ddp_model *model,
                                const ddp_ps_server_options *o);

/* What a server saw, for reports. */
typedef struct ddp_ps_server_stats {
  int64_t pushes, pulls, updates; /* messages served; optimizer steps made */
  int64_t max_step;               /* the highest step any trainer finished */
  int32_t trainers_done, trainers_dropped;
  /* Trainers' steps finished per second on this server from its first
   * finished step until a trainer first stopped stepping (finished, was
   * dropped, or came to a meeting: an evaluation or a save), i.e. while
   * every trainer trained; NaN before two steps. */
  double steps_per_s;
  uint64_t reserved[3];
} ddp_ps_server_stats;
DDP_STRUCT_SIZE(ddp_ps_server_stats, 72);

/* Serves trainers on `agent` (this process's worker, named as
 * ddp_ps_worker_name says) until every trainer has finished or been
 * dropped. A trainer that dies is told on stderr by name; in async and ssp
 * it is dropped and the others go on, in sync every waiting trainer's call
 * fails naming it and this returns DDP_ERR_PEER naming it. Also
 * DDP_ERR_TIMEOUT when no trainer is heard from for the options' timeout.
 * stats may be NULL. */
ddp_status ddp_ps_server_serve(ddp_ps_server *s, ddp_rpc_agent *agent, ddp_ps_server_stats *stats);

/* Takes the server's worker name out of the process's table of servers and
 * clients (calls for it are refused from then on; the parameter server's
 * RPC functions stay registered, shared by every server and client of the
 * process) and frees the server. Call after ddp_rpc_shutdown. NULL ok. */
void ddp_ps_server_destroy(ddp_ps_server *s);

/* ---- Client (a trainer) ------------------------------------------------------ */

typedef struct ddp_ps_client ddp_ps_client;

/* A trainer's side: trainer `trainer_index` (0..N-1) of a world described by
 * `o`. Registers the trainers' RPC function (the servers' watch on it);
 * call before ddp_rpc_init. Free with ddp_ps_client_destroy. */
ddp_status ddp_ps_client_create(ddp_ps_client **out, const ddp_ps_options *o,
                                int32_t trainer_index);
/* Binds the client to this process's worker once ddp_rpc_init returned. */
ddp_status ddp_ps_client_attach(ddp_ps_client *c, ddp_rpc_agent *agent);
int32_t ddp_ps_client_trainer_index(const ddp_ps_client *c);
const ddp_ps_options *ddp_ps_client_options(const ddp_ps_client *c);
/* Tells every server this trainer is done (its steps are over; in ssp the
 * others no longer wait for it) and answers the servers' watches, so a
 * graceful ddp_rpc_shutdown can end. Call once training is over (also after
 * a failed run: the servers then drop it as finished). */
ddp_status ddp_ps_client_finish(ddp_ps_client *c);
void ddp_ps_client_destroy(ddp_ps_client *c);

/* ---- The trainer's steps -------------------------------------------------------
 * What a training loop calls on an attached client (ddp_trainer's
 * parameter-server strategy, src/train/strategy_ps.c): bind once, then per
 * step push each final gradient (from the tape's grad hook) and end the
 * step; evaluations and checkpoints are meetings of the live trainers at
 * server 0. Not thread-safe: one thread drives a client. */

/* Binds the client to the model it trains (borrowed; it must outlive the
 * client), sizes its buffers (the push views, the buffers' last pulled
 * values), and pulls the current parameters and buffers into it; *base_step
 * (not NULL) is the step the servers start from (0, or a resumed run's).
 * Errors: the servers' (RPC failures, a model that does not match theirs),
 * DDP_ERR_NOMEM. */
ddp_status ddp_ps_client_bind(ddp_ps_client *c, ddp_model *model, int64_t *base_step);
/* The step in progress (1-based, counting from the start of training). */
int64_t ddp_ps_client_step(const ddp_ps_client *c);
/* Starts pushing parameter `param`'s gradient (final for this step, read
 * from the model's gradient buffer) to its server; returns once sent. The
 * first error is kept and returned by ddp_ps_client_end_step. */
void ddp_ps_client_push(ddp_ps_client *c, int32_t param, int64_t step, double lr);
/* Ends the step in progress: pushes what was not pushed yet (parameters
 * without a gradient push zeros), sends each server the pull for the step
 * (server 0 with the buffer deltas), waits for the fresh parameters and
 * copies them into the model, then for every push's acknowledgement. The
 * next step is in progress after it, whatever it returned. Errors: the
 * first push's, a server's or the RPC engine's (a timeout names the server). */
ddp_status ddp_ps_client_end_step(ddp_ps_client *c, double lr);
/* The model every live trainer evaluates: a barrier of the live trainers at
 * server 0, then the current parameters and buffers pulled. */
ddp_status ddp_ps_client_eval_begin(ddp_ps_client *c);
/* Sums values[0..n) over the live trainers (at server 0), in place. */
ddp_status ddp_ps_client_sum(ddp_ps_client *c, double *values, int n);

/* What a trainer hands the servers for a checkpoint (also the save
 * meeting's payload after its header: the layout is on the wire). */
typedef struct ddp_ps_save_info {
  ddp_train_state ts;
  ddp_scheduler_state sched;
  int32_t has_sched; /* 1 when sched is set */
  int32_t reserved32;
  double lr;
} ddp_ps_save_info;
DDP_STRUCT_SIZE(ddp_ps_save_info, 152);

/* A checkpoint, written by the servers once every live trainer asks (info
 * borrowed for the call; the same on every trainer at that point). */
ddp_status ddp_ps_client_save(ddp_ps_client *c, const ddp_ps_save_info *info);

#ifdef __cplusplus
}
#endif
#endif /* DDP_PS_H */
