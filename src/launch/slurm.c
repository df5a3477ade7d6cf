/* Inside a Slurm allocation: the job's nodes, this node's rank and the master
 * (the first host of the node list) come from Slurm's variables, so
 * `srun ddprun --nproc-per-node 4 ./train` needs no --nnodes, --node-rank or
 * --master-addr. Reads a "NAME=VALUE" table so tests can pass their own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/rendezvous.h"
#include "launch/launch_internal.h"

/* As src/rendezvous/environment.c: without MASTER_PORT, a port derived from
 * the job id, so two jobs sharing a node rarely collide. */
#define SLURM_PORT_BASE 15000
#define SLURM_PORT_SPAN 20000

const char *ddp__envp_get(char *const *envp, const char *name) {
  size_t n = strlen(name);
  for (size_t i = 0; envp && envp[i]; i++)
    if (strncmp(envp[i], name, n) == 0 && envp[i][n] == '=')
      return envp[i][n + 1] ? envp[i] + n + 1 : NULL;
  return NULL;
}

static ddp_status slurm_int(char *const *envp, const char *name, int64_t lo, int64_t hi, int32_t *out) {
  const char *v = ddp__envp_get(envp, name);
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi)
    return ddp_error(DDP_ERR_INVALID, "Slurm variable %s=\"%s\": expected an integer in %lld..%lld", name, v,
                     (long long)lo, (long long)hi);
  *out = (int32_t)x;
  return DDP_OK;
}

ddp_status ddp_launch_apply_slurm(ddp_launch_config *cfg, char *const *envp, int *applied) {
  *applied = 0;
  const char *list_var = ddp__envp_get(envp, "SLURM_JOB_NODELIST") ? "SLURM_JOB_NODELIST" : "SLURM_NODELIST";
  const char *list = ddp__envp_get(envp, list_var);
  if (cfg->nodes_given || !ddp__envp_get(envp, "SLURM_JOB_ID") || !ddp__envp_get(envp, "SLURM_NNODES") ||
      !ddp__envp_get(envp, "SLURM_NODEID") || !list)
    return DDP_OK;
  int32_t nnodes, node, job;
  DDP_TRY(slurm_int(envp, "SLURM_NNODES", 1, 1 << 20, &nnodes));
  DDP_TRY(slurm_int(envp, "SLURM_NODEID", 0, nnodes - 1, &node));
  DDP_TRY(slurm_int(envp, "SLURM_JOB_ID", 0, INT32_MAX, &job));
  char **hosts = NULL;
  size_t count = 0;
  ddp_status s = ddp_hostlist_expand(list, &hosts, &count);
  if (s) return ddp_error_wrap(s, "Slurm variable %s", list_var);
  if (count != (size_t)nnodes) {
    ddp_free(hosts);
    return ddp_error(DDP_ERR_INVALID, "Slurm variables disagree: %s=\"%s\" names %zu hosts but SLURM_NNODES=%d",
                     list_var, list, count, (int)nnodes);
  }
  if (!cfg->master_addr[0]) {
    if (strlen(hosts[0]) >= sizeof cfg->master_addr) {
      ddp_free(hosts);
      return ddp_error(DDP_ERR_INVALID, "Slurm variable %s: the first host name is too long", list_var);
    }
    snprintf(cfg->master_addr, sizeof cfg->master_addr, "%s", hosts[0]);
  }
  ddp_free(hosts);
  cfg->nnodes = nnodes;
  cfg->node_rank = node;
  if (cfg->master_port == 0 && nnodes > 1) cfg->master_port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN;
  if (!strcmp(cfg->rdzv_id, "none")) snprintf(cfg->rdzv_id, sizeof cfg->rdzv_id, "slurm-%d", (int)job);
  *applied = 1;
  return DDP_OK;
}
