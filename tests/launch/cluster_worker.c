/* cluster_worker: the ddp program the Slurm and MPI tests launch (srun,
 * sbatch, mpirun, ddprun inside an allocation). It meets its peers through
 * env:// with no help, checks that the rendezvous read the launcher it was
 * expected to (and agrees with that launcher's own variables), then runs an
 * allreduce and an allgather and checks them against closed forms. Exit 0
 * only when every check holds; each failure is a line on stderr naming the
 * rank. One line on stdout per rank:
 *
 *   ok rank 2/4 local 2/4 source slurm master vm:16234 host 0/1 sum 10
 *
 * (with " run <TORCHELASTIC_RUN_ID>" appended under ddprun).
 *
 * Usage: cluster_worker --source env|slurm|mpi --world N [--local-world N]
 * (what the test expects; --local-world is checked when given). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

#define COUNT 1000 /* elements in the reduced vector */

static int rank_for_errors = -1;

static int fail(const char *what) {
  fprintf(stderr, "cluster_worker rank %d: %s\n", rank_for_errors, what);
  return 1;
}

/* The launcher's own rank variable, read independently of the library. */
static const char *launcher_rank_var(const char *source) {
  if (strcmp(source, "slurm") == 0) return "SLURM_PROCID";
  if (strcmp(source, "mpi") == 0) return "OMPI_COMM_WORLD_RANK";
  return "RANK";
}

static int run(ddp_rendezvous_info *info, const char *source, int world, int local_world) {
  char msg[512];
  rank_for_errors = info->rank;
  const char *got = ddp_rendezvous_source_name(info->rank_source);
  if (strcmp(got, source) != 0) {
    snprintf(msg, sizeof msg, "rank came from '%s', expected '%s'", got, source);
    return fail(msg);
  }
  const char *var = launcher_rank_var(source);
  const char *v = getenv(var);
  if (!v || atoi(v) != info->rank) {
    snprintf(msg, sizeof msg, "rank %d differs from %s=%s", (int)info->rank, var, v ? v : "(unset)");
    return fail(msg);
  }
  if (info->world_size != world) {
    snprintf(msg, sizeof msg, "world size %d, expected %d", (int)info->world_size, world);
    return fail(msg);
  }
  if (local_world > 0 && info->local_world_size != local_world) {
    snprintf(msg, sizeof msg, "local world size %d (from %s), expected %d",
             (int)info->local_world_size, ddp_rendezvous_source_name(info->local_world_size_source),
             local_world);
    return fail(msg);
  }
  if (info->local_rank < 0 || info->local_rank >= info->local_world_size) {
    snprintf(msg, sizeof msg, "local rank %d out of 0..%d", (int)info->local_rank,
             (int)info->local_world_size - 1);
    return fail(msg);
  }

  ddp_process_group *pg;
  if (ddp_process_group_create(info->store, info->rank, info->world_size, NULL, &pg) != DDP_OK)
    return fail(ddp_last_error());
  int bad = 0;
  /* x[i] = (rank + 1) * (i + 1): the sum over ranks is W(W+1)/2 * (i + 1),
   * exact in double for these sizes. */
  static double x[COUNT];
  for (int i = 0; i < COUNT; i++) x[i] = (double)(info->rank + 1) * (i + 1);
  if (ddp_allreduce(pg, x, COUNT, DDP_FLOAT64, DDP_REDUCE_SUM) != DDP_OK) {
    bad = fail(ddp_last_error());
  } else {
    double tri = world * (world + 1) / 2.0;
    for (int i = 0; i < COUNT && !bad; i++)
      if (x[i] != tri * (i + 1)) {
        snprintf(msg, sizeof msg, "allreduce element %d is %.17g, expected %.17g", i, x[i],
                 tri * (i + 1));
        bad = fail(msg);
      }
  }
  /* Every rank reports its own rank: the gather must be 0..W-1 in order. */
  int32_t me = info->rank, all[1024];
  if (!bad && world <= 1024) {
    if (ddp_allgather(pg, &me, all, 1, DDP_INT32) != DDP_OK) {
      bad = fail(ddp_last_error());
    } else {
      for (int r = 0; r < world && !bad; r++)
        if (all[r] != r) {
          snprintf(msg, sizeof msg, "allgather slot %d holds rank %d", r, (int)all[r]);
          bad = fail(msg);
        }
    }
  }
  /* No rank tears down its transport while a peer may still read from it. */
  if (!bad && ddp_barrier(pg) != DDP_OK) bad = fail(ddp_last_error());
  /* Under ddprun, its run id ("slurm-<job id>" when it read the allocation). */
  const char *run_id = getenv("TORCHELASTIC_RUN_ID");
  if (!bad)
    printf("ok rank %d/%d local %d/%d source %s master %s:%d host %d/%d sum %g%s%s\n",
           (int)info->rank, (int)info->world_size, (int)info->local_rank,
           (int)info->local_world_size, got, info->master_addr, (int)info->master_port,
           (int)info->host_index, (int)info->num_hosts, x[0], run_id ? " run " : "",
           run_id ? run_id : "");
  fflush(stdout);
  if (bad) ddp_process_group_abort(pg);
  ddp_process_group_destroy(pg);
  return bad;
}

/* Rank 0 hosts the store: it leaves only after every other rank said bye
 * through it (a barrier's release alone does not guarantee the others have
 * read it before rank 0's server goes away). */
static int leave_together(const ddp_rendezvous_info *info) {
  char key[64];
  if (info->rank != 0) {
    snprintf(key, sizeof key, "cluster_worker/bye/%d", (int)info->rank);
    return ddp_store_set(info->store, key, "", 0) != DDP_OK ? fail(ddp_last_error()) : 0;
  }
  for (int r = 1; r < info->world_size; r++) {
    snprintf(key, sizeof key, "cluster_worker/bye/%d", r);
    const char *keys[1] = {key};
    if (ddp_store_wait(info->store, keys, 1, -1) != DDP_OK) return fail(ddp_last_error());
  }
  return 0;
}

int main(int argc, char **argv) {
  const char *source = NULL;
  int world = 0, local_world = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--source") == 0) source = argv[i + 1];
    else if (strcmp(argv[i], "--world") == 0) world = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--local-world") == 0) local_world = atoi(argv[i + 1]);
    else break;
  }
  if (!source || world < 1) {
    fprintf(stderr, "usage: cluster_worker --source env|slurm|mpi --world N [--local-world N]\n");
    return 2;
  }
  ddp_rendezvous_info info;
  if (ddp_rendezvous("env://", NULL, &info) != DDP_OK) return fail(ddp_last_error());
  int bad = run(&info, source, world, local_world);
  if (!bad) bad = leave_together(&info);
  ddp_rendezvous_info_destroy(&info);
  return bad;
}
