/* The environment contract between the launcher and its workers: torchrun's
 * variables (so PyTorch programs run unchanged) and ddp's DDP_STORE_ADDR /
 * DDP_STORE_PREFIX (so ddp programs meet in the launcher's store). */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "launch/launch_internal.h"

/* Every variable the launcher sets; inherited values of these are dropped. */
static const char *const owned[] = {
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "DDP_STORE_ADDR", "DDP_STORE_PREFIX", "DDP_TRACE_FILE",
    "TORCHELASTIC_ERROR_FILE",
};
#define NUM_OWNED (sizeof owned / sizeof owned[0])
#define MAX_VALUE 512

/* Whether entry ("NAME=value") names `name` (NUL- or '='-terminated). */
static bool same_name(const char *entry, const char *name) {
  size_t n = strcspn(name, "=");
  return strncmp(entry, name, n) == 0 && entry[n] == '=';
}

bool ddp__launch_env_owned(const char *entry) {
  for (size_t i = 0; i < NUM_OWNED; i++)
    if (same_name(entry, owned[i])) return true;
  return false;
}

/* Whether base's entry stays: not the launcher's, not one that add sets. */
static bool keep(const char *entry, char *const *add, size_t n_add) {
  if (ddp__launch_env_owned(entry)) return false;
  for (size_t i = 0; i < n_add; i++)
    if (same_name(entry, add[i])) return false;
  return true;
}

ddp_status ddp__launch_env(char *const *base, char *const *add, size_t n_add, char ***out) {
  *out = NULL;
  size_t n_base = 0, bytes = 0;
  for (size_t i = 0; base && base[i]; i++) {
    if (!keep(base[i], add, n_add)) continue;
    n_base++;
    bytes += strlen(base[i]) + 1;
  }
  for (size_t i = 0; i < n_add; i++) bytes += strlen(add[i]) + 1;
  size_t slots = n_base + n_add + 1;
  char **env = ddp_alloc(slots * sizeof *env + bytes);
  if (!env) return ddp_error(DDP_ERR_NOMEM, "launch: out of memory for a worker's environment");
  char *text = (char *)(env + slots);
  size_t k = 0;
  for (size_t i = 0; base && base[i]; i++) {
    if (!keep(base[i], add, n_add)) continue;
    size_t len = strlen(base[i]) + 1;
    memcpy(text, base[i], len);
    env[k++] = text;
    text += len;
  }
  for (size_t i = 0; i < n_add; i++) {
    size_t len = strlen(add[i]) + 1;
    memcpy(text, add[i], len);
    env[k++] = text;
    text += len;
  }
  env[k] = NULL;
  *out = env;
  return DDP_OK;
}

void ddp__attempt_prefix(const char *run_id, int32_t attempt, char *buf, size_t bytes) {
  snprintf(buf, bytes, "ddprun/%s/attempt/%d/", run_id, (int)attempt);
}

void ddp__error_file_path(const ddp__world *w, int32_t attempt, int32_t local_rank, char *buf, size_t bytes) {
  if (!w->error_dir[0]) {
    buf[0] = '\0';
    return;
  }
  snprintf(buf, bytes, "%.*s/attempt_%d/%d/error.json", (int)(bytes - 48), w->error_dir, (int)attempt,
           (int)local_rank);
}

ddp_status ddp__worker_env(char *const *base, const ddp__world *w, int32_t local_rank,
                           int32_t attempt, char ***out) {
  char prefix[DDP_LAUNCH_ID_BYTES + 64];
  ddp__attempt_prefix(w->run_id, attempt, prefix, sizeof prefix);
  /* Elastic: the job's failures so far; otherwise every attempt after the
   * first is a restart after a failure. */
  int32_t restart_count = w->elastic ? w->restarts : attempt;
  int32_t rank = w->rank_offset + local_rank;
  int omp_given = w->omp_threads > 0;
  int omp = omp_given || (w->nproc > 1 && !ddp__envp_get(base, "OMP_NUM_THREADS"));
  /* name=value lines, formatted once into a scratch table. */
  char add[NUM_OWNED + 1][MAX_VALUE];
  char *lines[NUM_OWNED + 3];
  size_t n_add = 0;
#define ADD(...) snprintf(add[n_add++], MAX_VALUE, __VA_ARGS__)
  ADD("MASTER_ADDR=%s", w->master_addr);
  ADD("MASTER_PORT=%d", (int)w->master_port);
  ADD("RANK=%d", (int)rank);
  ADD("WORLD_SIZE=%d", (int)w->world_size);
  ADD("LOCAL_RANK=%d", (int)local_rank);
  ADD("LOCAL_WORLD_SIZE=%d", (int)w->nproc);
  ADD("GROUP_RANK=%d", (int)w->node_rank);
  ADD("GROUP_WORLD_SIZE=%d", (int)w->nnodes);
  ADD("ROLE_RANK=%d", (int)rank);
  ADD("ROLE_WORLD_SIZE=%d", (int)w->world_size);
  ADD("ROLE_NAME=default");
  ADD("TORCHELASTIC_RESTART_COUNT=%d", (int)restart_count);
  ADD("TORCHELASTIC_MAX_RESTARTS=%d", (int)w->max_restarts);
  ADD("TORCHELASTIC_RUN_ID=%s", w->run_id);
  ADD("TORCHELASTIC_USE_AGENT_STORE=False");
  ADD("DDP_STORE_ADDR=%s", w->store_addr);
  ADD("DDP_STORE_PREFIX=%s", prefix);
  if (omp) ADD("OMP_NUM_THREADS=%d", omp_given ? (int)w->omp_threads : 1);
  if (w->trace_dir) ADD("DDP_TRACE_FILE=%s/rank%d.json", w->trace_dir, (int)rank);
#undef ADD
  for (size_t i = 0; i < n_add; i++) lines[i] = add[i];
  char debug_line[sizeof w->debug_dir + 16]; /* a path: longer than MAX_VALUE */
  if (w->debug_dir[0]) {
    snprintf(debug_line, sizeof debug_line, "DDP_DEBUG_DIR=%s", w->debug_dir);
    lines[n_add++] = debug_line;
  }
  char error_line[DDP_LAUNCH_PATH_BYTES + 32];
  if (w->error_dir[0]) {
    int used = snprintf(error_line, sizeof error_line, "TORCHELASTIC_ERROR_FILE=");
    ddp__error_file_path(w, attempt, local_rank, error_line + used, sizeof error_line - (size_t)used);
    lines[n_add++] = error_line;
  }
  return ddp__launch_env(base, lines, n_add, out);
}
