/* ddprun's command line: torchrun's options in both spellings
 * (--nproc-per-node and --nproc_per_node) and both forms (--opt VALUE,
 * --opt=VALUE), plus ddp's own (--grace-period, --job-timeout, --rdzv-timeout,
 * --tail-lines, --threads) and the placement's (--bind, with mpirun's
 * --bind-to and torchrun's --numa-binding spellings, --report-bindings). Options end at the first argument that is not one: the
 * program, whose arguments are passed on untouched. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

ddp_launch_config ddp_launch_defaults(void) {
  ddp_launch_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.nproc_per_node = 1;
  cfg.nnodes = 1;
  cfg.node_rank = -1;
  snprintf(cfg.rdzv_id, sizeof cfg.rdzv_id, "none");
  cfg.rdzv_backend = DDP_LAUNCH_RDZV_STATIC;
  cfg.monitor_interval_s = 0.1;
  cfg.grace_s = DDP__LAUNCH_DEFAULT_GRACE_S;
  cfg.rdzv_timeout_s = 900.0; /* torchrun's join_timeout */
  cfg.tail_lines = DDP__LAUNCH_DEFAULT_TAIL;
  cfg.last_call_timeout_s = 30.0; /* torchrun's last_call_timeout */
  cfg.keep_alive_s = 15.0;        /* torchrun's keep_alive_interval 5 s x keep_alive_max_attempt 3 */
  return cfg;
}

/* ---- Values ------------------------------------------------------------------ */

static ddp_status int_value(const char *opt, const char *v, int64_t lo, int64_t hi, int32_t *out) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi)
    return ddp_error(DDP_ERR_INVALID, "%s %s: expected an integer in %lld..%lld", opt, v, (long long)lo,
                     (long long)hi);
  *out = (int32_t)x;
  return DDP_OK;
}

static ddp_status seconds_value(const char *opt, const char *v, double lo, double *out) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !isfinite(x) || x < lo || x > 1e9)
    return ddp_error(DDP_ERR_INVALID, "%s %s: expected a number of seconds >= %g", opt, v, lo);
  *out = x;
  return DDP_OK;
}

static ddp_status text_value(const char *opt, const char *v, char *dst, size_t bytes) {
  if (strlen(v) >= bytes)
    return ddp_error(DDP_ERR_INVALID, "%s: the value is longer than %zu characters", opt, bytes - 1);
  snprintf(dst, bytes, "%s", v);
  return DDP_OK;
}

/* GPUs on this host: /dev/nvidia<N> devices (no CUDA dependency), limited by
 * CUDA_VISIBLE_DEVICES when set. */
static int32_t count_gpus(void) {
  int32_t n = 0;
  for (int i = 0; i < 64; i++) {
    char path[32];
    snprintf(path, sizeof path, "/dev/nvidia%d", i);
    if (access(path, F_OK) == 0) n++;
  }
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (visible && n > 0) {
    int32_t listed = *visible ? 1 : 0;
    for (const char *p = visible; *p; p++) listed += *p == ',';
    if (listed < n) n = listed;
  }
  return n;
}

static ddp_status nproc_value(const char *opt, const char *v, int32_t *out) {
  if (strcmp(v, "cpu") == 0 || strcmp(v, "auto") == 0 || strcmp(v, "gpu") == 0) {
    int32_t gpus = count_gpus();
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (strcmp(v, "gpu") == 0 && gpus == 0)
      return ddp_error(DDP_ERR_INVALID, "%s gpu: no GPU found on this host (no /dev/nvidia0); use a number, cpu or auto", opt);
    /* torchrun: auto is the GPU count when there are GPUs, else the CPU count. */
    *out = strcmp(v, "cpu") == 0 || gpus == 0 ? (int32_t)(cpus > 0 ? cpus : 1) : gpus;
    return DDP_OK;
  }
  return int_value(opt, v, 1, 1 << 20, out);
}

/* "N" or "MIN:MAX" (torchrun's elastic form). N:N is N; MIN < MAX makes the
 * job elastic (checked against the backend once every option is read). */
static ddp_status nnodes_value(const char *opt, const char *v, ddp_launch_config *cfg) {
  const char *colon = strchr(v, ':');
  cfg->min_nnodes = 0;
  if (!colon) return int_value(opt, v, 1, 1 << 20, &cfg->nnodes);
  char lo_text[32];
  size_t n = (size_t)(colon - v);
  if (n >= sizeof lo_text) n = sizeof lo_text - 1;
  memcpy(lo_text, v, n);
  lo_text[n] = '\0';
  int32_t lo, hi;
  DDP_TRY(int_value(opt, lo_text, 1, 1 << 20, &lo));
  DDP_TRY(int_value(opt, colon + 1, 1, 1 << 20, &hi));
  if (lo > hi)
    return ddp_error(DDP_ERR_INVALID, "%s %s: MIN %d is above MAX %d (the form is MIN:MAX, MIN <= MAX)", opt, v,
                     (int)lo, (int)hi);
  cfg->nnodes = hi;
  if (lo < hi) cfg->min_nnodes = lo;
  return DDP_OK;
}

/* --rdzv-conf key=value,...: join_timeout (seconds) is the one ddprun uses;
 * the others torchrun knows are accepted and ignored with a note. */
static ddp_status rdzv_conf_value(const char *opt, const char *v, ddp_launch_config *cfg) {
  char buf[512];
  DDP_TRY(text_value(opt, v, buf, sizeof buf));
  char *save = NULL;
  /* torchrun's two keys make one limit: a node silent for interval x
   * attempts is dead. The defaults' product is cfg's default. */
  double keep_alive_interval = 5.0;
  int32_t keep_alive_attempts = 3;
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    char *eq = strchr(item, '=');
    if (!eq) return ddp_error(DDP_ERR_INVALID, "%s %s: expected key=value pairs separated by commas", opt, v);
    *eq = '\0';
    if (strcmp(item, "join_timeout") == 0 || strcmp(item, "timeout") == 0)
      DDP_TRY(seconds_value("--rdzv-conf join_timeout", eq + 1, 0.001, &cfg->rdzv_timeout_s));
    else if (strcmp(item, "last_call_timeout") == 0)
      DDP_TRY(seconds_value("--rdzv-conf last_call_timeout", eq + 1, 0, &cfg->last_call_timeout_s));
    else if (strcmp(item, "keep_alive_interval") == 0)
      DDP_TRY(seconds_value("--rdzv-conf keep_alive_interval", eq + 1, 0.001, &keep_alive_interval));
    else if (strcmp(item, "keep_alive_max_attempt") == 0)
      DDP_TRY(int_value("--rdzv-conf keep_alive_max_attempt", eq + 1, 1, 1000, &keep_alive_attempts));
    else
      fprintf(stderr, "ddprun: note: --rdzv-conf %s is not used by ddprun\n", item);
  }
  cfg->keep_alive_s = keep_alive_interval * keep_alive_attempts;
  return DDP_OK;
}

/* ---- The table of options ------------------------------------------------------ */

typedef enum kind { FLAG, VALUE } kind;

typedef struct option {
  const char *name; /* canonical, with dashes */
  const char *alias;
  kind kind;
} option;

static const option options[] = {
    {"--nproc-per-node", NULL, VALUE}, {"--nnodes", NULL, VALUE},
    {"--node-rank", NULL, VALUE},      {"--master-addr", NULL, VALUE},
    {"--master-port", NULL, VALUE},    {"--rdzv-endpoint", NULL, VALUE},
    {"--rdzv-id", NULL, VALUE},        {"--rdzv-backend", NULL, VALUE},
    {"--rdzv-conf", NULL, VALUE},      {"--rdzv-timeout", NULL, VALUE},
    {"--standalone", NULL, FLAG},      {"--max-restarts", NULL, VALUE},
    {"--monitor-interval", NULL, VALUE}, {"--log-dir", NULL, VALUE},
    {"--redirects", "-r", VALUE},      {"--tee", "-t", VALUE},
    {"--local-ranks-filter", NULL, VALUE}, {"--no-python", NULL, FLAG},
    {"--module", "-m", FLAG},          {"--pass-local-rank", NULL, FLAG},
    {"--grace-period", NULL, VALUE},   {"--job-timeout", NULL, VALUE},
    {"--tail-lines", NULL, VALUE},     {"--help", "-h", FLAG},
    {"--bind", "--bind-to", VALUE},    {"--numa-binding", NULL, VALUE},
    {"--report-bindings", NULL, FLAG}, {"--threads", NULL, VALUE},
    {"--trace", NULL, VALUE},          {"--may-fail", NULL, VALUE},
};
#define NUM_OPTIONS (sizeof options / sizeof options[0])

/* Finds the option for `arg` ("--nproc_per_node=4" -> --nproc-per-node, value
 * "4"): underscores count as dashes in the name. */
static const option *lookup(const char *arg, const char **inline_value) {
  char name[64];
  size_t n = strcspn(arg, "=");
  if (n >= sizeof name) return NULL;
  for (size_t i = 0; i < n; i++) name[i] = arg[i] == '_' ? '-' : arg[i];
  name[n] = '\0';
  *inline_value = arg[n] == '=' ? arg + n + 1 : NULL;
  for (size_t i = 0; i < NUM_OPTIONS; i++)
    if (strcmp(name, options[i].name) == 0 || (options[i].alias && strcmp(name, options[i].alias) == 0))
      return &options[i];
  return NULL;
}

static ddp_status apply(ddp_launch_config *cfg, const option *o, const char *v) {
  const char *name = o->name;
  if (strcmp(name, "--nproc-per-node") == 0) return nproc_value(name, v, &cfg->nproc_per_node);
  if (strcmp(name, "--nnodes") == 0) {
    cfg->nodes_given = 1;
    return nnodes_value(name, v, cfg);
  }
  if (strcmp(name, "--node-rank") == 0) {
    cfg->nodes_given = 1;
    return int_value(name, v, 0, 1 << 20, &cfg->node_rank);
  }
  if (strcmp(name, "--master-addr") == 0) return text_value(name, v, cfg->master_addr, sizeof cfg->master_addr);
  if (strcmp(name, "--master-port") == 0) return int_value(name, v, 1, 65535, &cfg->master_port);
  if (strcmp(name, "--rdzv-endpoint") == 0)
    return text_value(name, v, cfg->rdzv_endpoint, sizeof cfg->rdzv_endpoint);
  if (strcmp(name, "--rdzv-id") == 0) {
    if (!*v || strchr(v, '/'))
      return ddp_error(DDP_ERR_INVALID, "--rdzv-id '%s': expected a non-empty name without '/'", v);
    return text_value(name, v, cfg->rdzv_id, sizeof cfg->rdzv_id);
  }
  if (strcmp(name, "--rdzv-backend") == 0) {
    if (strcmp(v, "static") == 0) cfg->rdzv_backend = DDP_LAUNCH_RDZV_STATIC;
    else if (strcmp(v, "c10d") == 0) cfg->rdzv_backend = DDP_LAUNCH_RDZV_C10D;
    else
      return ddp_error(DDP_ERR_UNSUPPORTED, "--rdzv-backend %s: ddprun knows static and c10d", v);
    return DDP_OK;
  }
  if (strcmp(name, "--rdzv-conf") == 0) return rdzv_conf_value(name, v, cfg);
  if (strcmp(name, "--rdzv-timeout") == 0) return seconds_value(name, v, 0.001, &cfg->rdzv_timeout_s);
  if (strcmp(name, "--max-restarts") == 0) return int_value(name, v, 0, 1 << 20, &cfg->max_restarts);
  if (strcmp(name, "--monitor-interval") == 0) {
    DDP_TRY(seconds_value(name, v, 0.001, &cfg->monitor_interval_s));
    return DDP_OK;
  }
  if (strcmp(name, "--trace") == 0) {
    /* DDP_TRACE_FILE=DIR/rank<N>.json must fit a worker's environment line. */
    if (!*v || strlen(v) > 400)
      return ddp_error(DDP_ERR_INVALID, "--trace '%.40s': expected a directory of 1 to 400 bytes", v);
    cfg->trace_dir = v;
    return DDP_OK;
  }
  if (strcmp(name, "--may-fail") == 0) {
    DDP_TRY(ddp__rank_set_check(name, v));
    cfg->may_fail = v;
    return DDP_OK;
  }
  if (strcmp(name, "--log-dir") == 0) return text_value(name, v, cfg->log_dir, sizeof cfg->log_dir - 64);
  if (strcmp(name, "--redirects") == 0 || strcmp(name, "--tee") == 0) {
    int level;
    DDP_TRY(ddp__std_spec_for(name, v, 0, &level)); /* validates the whole value */
    return text_value(name, v, name[2] == 'r' ? cfg->redirects : cfg->tee, sizeof cfg->redirects);
  }
  if (strcmp(name, "--local-ranks-filter") == 0) {
    int allowed;
    DDP_TRY(ddp__filter_allows(v, 0, &allowed));
    return text_value(name, v, cfg->local_ranks_filter, sizeof cfg->local_ranks_filter);
  }
  if (strcmp(name, "--grace-period") == 0) return seconds_value(name, v, 0, &cfg->grace_s);
  if (strcmp(name, "--job-timeout") == 0) return seconds_value(name, v, 0, &cfg->job_timeout_s);
  if (strcmp(name, "--tail-lines") == 0) return int_value(name, v, 0, 10000, &cfg->tail_lines);
  if (strcmp(name, "--bind") == 0 || strcmp(name, "--numa-binding") == 0) {
    ddp_launch_bind mode;
    DDP_TRY(ddp__bind_parse(name, v, &mode));
    cfg->bind = (int32_t)mode;
    return DDP_OK;
  }
  if (strcmp(name, "--threads") == 0) return int_value(name, v, 1, DDP__MAX_CPUS, &cfg->threads_per_worker);
  return ddp_error(DDP_ERR_INTERNAL, "ddprun: option %s has no handler", name);
}

ddp_status ddp_launch_parse_args(int argc, char *const *argv, ddp_launch_config *cfg) {
  int i = 1;
  for (; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "--") == 0) {
      i++;
      break;
    }
    if (arg[0] != '-' || arg[1] == '\0') break; /* the program */
    const char *value;
    const option *o = lookup(arg, &value);
    if (!o)
      return ddp_error(DDP_ERR_INVALID, "unknown option %s (ddprun --help lists them; the program "
                       "and its arguments come after the options)", arg);
    if (o->kind == FLAG) {
      if (value) return ddp_error(DDP_ERR_INVALID, "%s takes no value (got %s)", o->name, arg);
      if (strcmp(o->name, "--standalone") == 0) cfg->standalone = 1;
      else if (strcmp(o->name, "--no-python") == 0) cfg->no_python = 1;
      else if (strcmp(o->name, "--module") == 0) cfg->module = 1;
      else if (strcmp(o->name, "--pass-local-rank") == 0) cfg->pass_local_rank = 1;
      else if (strcmp(o->name, "--help") == 0) cfg->help = 1;
      else if (strcmp(o->name, "--report-bindings") == 0) cfg->report_bindings = 1;
      continue;
    }
    if (!value) {
      if (i + 1 >= argc) return ddp_error(DDP_ERR_INVALID, "%s needs a value", o->name);
      value = argv[++i];
    }
    DDP_TRY(apply(cfg, o, value));
  }
  if (cfg->help) return DDP_OK;
  if (i >= argc)
    return ddp_error(DDP_ERR_INVALID, "no program to run (usage: ddprun [options] PROGRAM [ARGS...])");
  cfg->program = argv[i];
  cfg->args = argv + i + 1;
  cfg->num_args = argc - i - 1;
  if (cfg->module && cfg->no_python)
    return ddp_error(DDP_ERR_INVALID, "--module and --no-python contradict each other (-m runs python -m PROGRAM)");
  if (cfg->min_nnodes > 0 && cfg->rdzv_backend != DDP_LAUNCH_RDZV_C10D)
    return ddp_error(DDP_ERR_INVALID, "--nnodes %d:%d: elastic membership needs --rdzv-backend c10d (the static "
                     "backend has a fixed number of nodes)", (int)cfg->min_nnodes, (int)cfg->nnodes);
  if (cfg->min_nnodes > 0 && cfg->node_rank >= 0)
    return ddp_error(DDP_ERR_INVALID, "--nnodes %d:%d with --node-rank %d: an elastic job numbers its nodes "
                     "by arrival in each round; drop --node-rank", (int)cfg->min_nnodes, (int)cfg->nnodes,
                     (int)cfg->node_rank);
  if (cfg->node_rank >= cfg->nnodes)
    return ddp_error(DDP_ERR_INVALID, "--node-rank %d is out of range for --nnodes %d (node ranks are 0..%d)",
                     (int)cfg->node_rank, (int)cfg->nnodes, (int)cfg->nnodes - 1);
  if (cfg->standalone && cfg->nnodes > 1)
    return ddp_error(DDP_ERR_INVALID, "--standalone runs one node, but --nnodes is %d", (int)cfg->nnodes);
  return DDP_OK;
}
