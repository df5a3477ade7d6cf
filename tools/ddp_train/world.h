/* The data-parallel side of ddp-train: whether the environment asks for
 * several processes, and the process group the trainer (include/ddp/train.h)
 * then runs over. */
#ifndef DDP_TOOLS_TRAIN_WORLD_H
#define DDP_TOOLS_TRAIN_WORLD_H

#include <stdbool.h>
#include <stdio.h>

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/rendezvous.h"

typedef struct train_world {
  ddp_process_group *pg; /* NULL: one process, no collectives */
  int rank;              /* 0 when pg is NULL */
  int size;              /* 1 when pg is NULL */
  int local_size;        /* ranks on this host (LOCAL_WORLD_SIZE, else size) */
  const char *source;    /* the variable that asked for data parallelism, or NULL */
} train_world;

/* The name of the variable that asks for data parallelism, NULL when none
 * does (ddp_rendezvous_requested: a launcher's store or world size; an
 * sbatch script's own environment is not asking). */
const char *train_world_requested(void);

/* Fills *w for one process, or, when train_world_requested(), joins the
 * process group (env://) and fills rank and size. Errors carry
 * ddp_last_error(). */
ddp_status train_world_init(train_world *w);
/* As train_world_init, the group on `backend` (options.backend: "nccl",
 * "ddp", ...; NULL: $DDP_BACKEND, else ddp's own). */
ddp_status train_world_init_on(train_world *w, const char *backend);

/* Waits for every rank (so rank 0, which may host the store, leaves last)
 * and frees the group. Safe on a single-process world. */
void train_world_destroy(train_world *w);

#endif /* DDP_TOOLS_TRAIN_WORLD_H */
