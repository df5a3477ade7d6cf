/* Test helpers shared by the rendezvous tests: clear every variable the
 * environment contracts read, then apply "NAME=value NAME=value". */
#ifndef DDP_RDZV_TEST_ENV_H
#define DDP_RDZV_TEST_ENV_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const rdzv_test_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "DDP_STORE_ADDR", "DDP_STORE_TOKEN", "DDP_TIMEOUT", "DDP_HOST_ID", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_NODELIST",
    "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
    "PMIX_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE",
};

static inline void rdzv_test_clear_env(void) {
  for (size_t i = 0; i < sizeof rdzv_test_vars / sizeof rdzv_test_vars[0]; i++)
    unsetenv(rdzv_test_vars[i]);
}

/* Returns 0, or -1 for an item without '='. */
static inline int rdzv_test_apply_env(const char *env) {
  char buf[2048];
  snprintf(buf, sizeof buf, "%s", env ? env : "");
  char *save = NULL;
  for (char *tok = strtok_r(buf, " ", &save); tok; tok = strtok_r(NULL, " ", &save)) {
    char *eq = strchr(tok, '=');
    if (!eq) return -1;
    *eq = '\0';
    setenv(tok, eq + 1, 1);
  }
  return 0;
}

#endif /* DDP_RDZV_TEST_ENV_H */
