/* ddp-hpo's cmd: objective: a program run per evaluation (cmd_objective.c). */
#ifndef DDP_TOOLS_HPO_CMD_OBJECTIVE_H
#define DDP_TOOLS_HPO_CMD_OBJECTIVE_H

#include <stdbool.h>

#include "ddp/core.h"
#include "ddp/hpo.h"

typedef struct hpo_cmd {
  char *text;   /* the words' storage */
  char **argv;  /* the program and its own arguments */
  int argc;
  const char *loss_key; /* the JSON field holding the loss ("loss") */
} hpo_cmd;

/* "PROGRAM ARG ..." (words split at blanks, no quoting). */
ddp_status hpo_cmd_parse(const char *spec, hpo_cmd *out);
void hpo_cmd_free(hpo_cmd *c);

/* One evaluation, as rank `rank` of a worker of `size` ranks. */
typedef struct hpo_cmd_eval {
  int rank, size;          /* in the worker */
  int worker;
  int64_t generation;
  int master_port;         /* the worker's first rank's pick, for MASTER_PORT (size > 1) */
  const char *store_addr;  /* the job's store, for DDP_STORE_ADDR (size > 1), or NULL */
  double timeout_s;
} hpo_cmd_eval;

/* Runs the program; returns the loss it printed (rank 0), or INFINITY with
 * the reason on stderr. Every rank returns when its program has ended or
 * was killed at the timeout. */
double hpo_cmd_run(const hpo_cmd *c, const ddp_hpo_space *space, const double *values,
                   const hpo_cmd_eval *e);

/* A free loopback port, or 0. */
int hpo_cmd_free_port(void);

#endif
