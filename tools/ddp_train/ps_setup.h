/* The parameter-server side of ddp-train (--param-servers S --ps-mode M):
 * the roles by rank, the RPC agent, a server's whole life, and a trainer's
 * client (include/ddp/ps.h; docs/ps.md). */
#ifndef DDP_TOOLS_DDP_TRAIN_PS_SETUP_H
#define DDP_TOOLS_DDP_TRAIN_PS_SETUP_H

#include <stdbool.h>

#include "ddp/core.h"
#include "ddp/nn.h"
#include "ddp/ps.h"
#include "ddp/rendezvous.h"
#include "ddp/rpc.h"
#include "ddp/train.h"

/* The command line's part (--param-servers, --ps-mode, and the test
 * model's --step-sleep-ms and --straggler). */
typedef struct train_ps_args {
  int servers;           /* 0: no parameter server */
  const char *mode;      /* NULL: sync */
  double step_sleep_ms;  /* every trainer sleeps this long after each step */
  const char *straggler; /* "I:half" or "I:pause:P:MS" (trainer I), NULL: none */
} train_ps_args;

/* The value options it takes (for the parser's list of names). */
extern const char *const train_ps_option_names[4];
/* Takes option `name` (one of those) with value v; exits with usage 2 on a
 * bad value, as ddp-train's parser does. */
void train_ps_parse(train_ps_args *a, const char *name, const char *v);

typedef struct train_ps {
  train_ps_args args;
  ddp_ps_options opt;
  int rank, world_size; /* global */
  bool server;          /* rank < S */
  ddp_rendezvous_info rdzv;
  ddp_rpc_agent *agent;
  ddp_ps_client *client; /* trainers */
  /* The sleeps (--step-sleep-ms, --straggler) and the callback they wrap. */
  double sleep_ms, pause_p, pause_ms;
  uint64_t rng;
  ddp_train_callbacks inner;
} train_ps;

/* Meets the other ranks (env://) and fills *ps: S servers, the rest
 * trainers, `mode` as ddp_ps_mode_parse reads it. Nothing else yet: the
 * RPC agent starts once the model is built (train_ps_serve, train_ps_start). */
ddp_status train_ps_join(train_ps *ps, const train_ps_args *args);

/* A server's whole life: the server over `model` with the trainers'
 * optimizer, schedule and checkpoint options, the agent, serving until every
 * trainer is done or dropped, and a graceful shutdown. Returns the process's
 * exit status (0, or 1 after printing why). */
int train_ps_serve(train_ps *ps, ddp_model *model, const ddp_train_options *o);

/* A trainer: its client, the agent, o->param_server; the log only on
 * trainer 0; the test model's sleeps wrapped around o->callbacks.on_step. */
ddp_status train_ps_start(train_ps *ps, ddp_train_options *o);

/* After the run (ok tells whether it succeeded): tells the servers, shuts
 * the agent down, frees everything. */
void train_ps_end(train_ps *ps, bool ok);

#endif
