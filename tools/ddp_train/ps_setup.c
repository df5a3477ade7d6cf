/* ddp-train's parameter-server roles (tools/ddp_train/ps_setup.h): ranks
 * 0..S-1 serve, the rest train. Every rank meets through env:// once, then the RPC agents
 * meet in that store. */
#include "ddp_train/ps_setup.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *const train_ps_option_names[4] = {"--param-servers", "--ps-mode", "--step-sleep-ms",
                                              "--straggler"};

static _Noreturn void bad(const char *name, const char *v, const char *want) {
  fprintf(stderr, "ddp-train: %s expects %s, got '%s'\n(run ddp-train --help for the options)\n",
          name, want, v);
  exit(2);
}

void train_ps_parse(train_ps_args *a, const char *name, const char *v) {
  char *end;
  errno = 0;
  if (!strcmp(name, "--param-servers")) {
    long n = strtol(v, &end, 10);
    if (errno || *end || end == v || n < 1 || n > 1024) bad(name, v, "a number of servers >= 1");
    a->servers = (int)n;
  } else if (!strcmp(name, "--ps-mode")) {
    ddp_ps_mode m;
    int32_t k;
    if (ddp_ps_mode_parse(v, &m, &k) != DDP_OK) bad(name, v, "sync, async or ssp:K");
    a->mode = v;
  } else if (!strcmp(name, "--step-sleep-ms")) {
    double x = strtod(v, &end);
    if (errno || *end || end == v || !(x >= 0) || x > 1e6) bad(name, v, "milliseconds >= 0");
    a->step_sleep_ms = x;
  } else if (!strcmp(name, "--straggler")) {
    int who = -1, used = 0;
    double p, ms;
    const char *rest = !strncmp(v, "all:", 4) ? v + 4 : NULL;
    if (!rest && sscanf(v, "%d:%n", &who, &used) == 1 && who >= 0) rest = v + used;
    if (rest && !strcmp(rest, "half")) {
      a->straggler = v;
    } else if (rest && sscanf(rest, "pause:%lf:%lf%n", &p, &ms, &used) == 2 &&
               used == (int)strlen(rest) && p >= 0 && p <= 1 && ms >= 0) {
      a->straggler = v;
    } else {
      bad(name, v, "I:half or I:pause:P:MS (trainer I, or every trainer with I = all, at half "
                   "speed, or pausing MS ms with probability P after each step)");
    }
  }
}

ddp_status train_ps_join(train_ps *ps, const train_ps_args *args) {
  memset(ps, 0, sizeof *ps);
  ps->args = *args;
  const int servers = args->servers;
  ps->opt.num_servers = servers;
  DDP_TRY(ddp_ps_mode_parse(args->mode ? args->mode : "sync", &ps->opt.mode, &ps->opt.staleness));
  if (!ddp_rendezvous_requested())
    return ddp_error(DDP_ERR_INVALID, "--param-servers %d needs a launcher (ddprun "
                                      "--nproc-per-node S+N ...): S servers and N >= 1 trainers",
                     servers);
  ddp_status s = ddp_rendezvous("env://", NULL, &ps->rdzv);
  if (s != DDP_OK) return ddp_error_wrap(s, "meeting the other ranks (--param-servers)");
  ps->rank = ps->rdzv.rank;
  ps->world_size = ps->rdzv.world_size;
  ps->opt.num_trainers = ps->world_size - servers;
  ps->server = ps->rank < servers;
  ddp_log_set_rank(ps->rank);
  s = ddp_ps_options_check(&ps->opt);
  if (s != DDP_OK) ddp_rendezvous_info_destroy(&ps->rdzv);
  return s;
}

static ddp_status start_agent(train_ps *ps) {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_ps_worker_name(&ps->opt, ps->rank, name);
  ddp_rpc_options ro = ddp_rpc_defaults();
  ro.name = name;
  ro.rank = ps->rank;
  ro.world_size = ps->world_size;
  ro.store = ps->rdzv.store;
  ddp_status s = ddp_rpc_init(&ro, &ps->agent);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "starting RPC as '%s'", name);
}

/* Leaves: the agent (graceful: waits for the others' outstanding work),
 * then the store (rank 0 hosts it, and waits for the others to go). */
static void leave(train_ps *ps) {
  if (ps->agent) {
    ddp_status s = ddp_rpc_shutdown(ps->agent, true, 30);
    if (s != DDP_OK && s != DDP_ERR_PEER)
      fprintf(stderr, "ddp-train: rank %d: RPC shutdown: %s\n", ps->rank, ddp_last_error());
    ps->agent = NULL;
  }
  ddp_rendezvous_info_destroy(&ps->rdzv);
}

int train_ps_serve(train_ps *ps, ddp_model *model, const ddp_train_options *o) {
  ddp_ps_server_options so = {.ps = ps->opt, .index = ps->rank, .optim = o->optim,
                              .step_lr_size = o->step_lr_size, .step_lr_gamma = o->step_lr_gamma,
                              .save_path = o->save_path, .resume_path = o->resume_path,
                              .checkpoint_meta = o->checkpoint_meta,
                              .checkpoint_meta_count = o->checkpoint_meta_count};
  ddp_ps_server *srv = NULL;
  ddp_ps_server_stats st = {0};
  ddp_status s = ddp_ps_server_create(&srv, model, &so);
  if (s == DDP_OK) s = start_agent(ps);
  if (s == DDP_OK) s = ddp_ps_server_serve(srv, ps->agent, &st);
  char error[1024] = "";
  if (s != DDP_OK) snprintf(error, sizeof error, "%s", ddp_last_error());
  else
    fprintf(stderr, "ddp-train: server ps%d (%s): %lld pushes, %lld pulls, %lld updates, up to "
                    "step %lld; %d trainers finished, %d dropped; %.1f steps/s while all "
                    "trained\n",
            ps->rank, ddp_ps_mode_name(ps->opt.mode), (long long)st.pushes, (long long)st.pulls,
            (long long)st.updates, (long long)st.max_step, st.trainers_done, st.trainers_dropped,
            st.steps_per_s);
  leave(ps);
  ddp_ps_server_destroy(srv);
  if (s != DDP_OK) {
    fprintf(stderr, "ddp-train: rank %d: error: server ps%d: %s\n", ps->rank, ps->rank, error);
    return 1;
  }
  return 0;
}

static void sleep_ms(double ms) {
  if (!(ms > 0)) return;
  struct timespec ts = {.tv_sec = (time_t)(ms / 1e3),
                        .tv_nsec = (long)(fmod(ms, 1e3) * 1e6)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* The test model's step: the update, then a fixed sleep (2x for a
 * half-speed straggler; a pause now and then for a transient one), so
 * that the sleeps, not the 2 cores, set the pace. */
static bool sleepy_step(const ddp_train_step_info *info, void *user) {
  train_ps *ps = user;
  sleep_ms(ps->sleep_ms);
  if (ps->pause_p > 0) {
    ps->rng = ps->rng * 6364136223846793005ull + 1442695040888963407ull;
    if ((double)(ps->rng >> 11) * 0x1p-53 < ps->pause_p) sleep_ms(ps->pause_ms);
  }
  return ps->inner.on_step ? ps->inner.on_step(info, ps->inner.user) : false;
}
static void sleepy_start(const ddp_train_start_info *info, void *user) {
  train_ps *ps = user;
  if (ps->inner.on_start) ps->inner.on_start(info, ps->inner.user);
}
static bool sleepy_eval(const ddp_train_eval_info *info, void *user) {
  train_ps *ps = user;
  return ps->inner.on_eval ? ps->inner.on_eval(info, ps->inner.user) : false;
}

ddp_status train_ps_start(train_ps *ps, ddp_train_options *o) {
  const int trainer = ps->rank - ps->opt.num_servers;
  DDP_TRY(ddp_ps_client_create(&ps->client, &ps->opt, trainer));
  DDP_TRY(start_agent(ps));
  DDP_TRY(ddp_ps_client_attach(ps->client, ps->agent));
  o->param_server = ps->client;
  if (trainer != 0) o->log_path = NULL; /* one log: trainer 0's */
  ps->sleep_ms = ps->args.step_sleep_ms;
  const char *sg = ps->args.straggler;
  if (sg) { /* checked by train_ps_parse */
    int who = -1, used = 0;
    const char *rest = !strncmp(sg, "all:", 4) ? sg + 4 : NULL;
    if (!rest && sscanf(sg, "%d:%n", &who, &used) == 1) rest = sg + used;
    const bool me = !strncmp(sg, "all:", 4) || who == trainer;
    double p, ms;
    if (me && !strcmp(rest, "half")) ps->sleep_ms *= 2;
    else if (me && sscanf(rest, "pause:%lf:%lf", &p, &ms) == 2) {
      ps->pause_p = p;
      ps->pause_ms = ms;
      /* Each trainer its own sequence, the same in every run. */
      ps->rng = 0x9e3779b97f4a7c15ull * (uint64_t)(trainer + 1);
    }
  }
  if (ps->sleep_ms > 0 || ps->pause_p > 0) {
    ps->inner = o->callbacks;
    o->callbacks = (ddp_train_callbacks){sleepy_start, sleepy_step, sleepy_eval, ps};
  }
  return DDP_OK;
}

void train_ps_end(train_ps *ps, bool ok) {
  (void)ok;
  if (ps->client && ps->agent && ddp_ps_client_finish(ps->client) != DDP_OK)
    fprintf(stderr, "ddp-train: rank %d: %s\n", ps->rank, ddp_last_error());
  leave(ps);
  ddp_ps_client_destroy(ps->client);
  ps->client = NULL;
}
