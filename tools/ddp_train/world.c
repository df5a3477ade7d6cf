/* ddp-train's process group: detection of a launcher from the environment
 * and env:// init (docs/training.md, "Data parallel"). */
#include "ddp_train/world.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *train_world_requested(void) { return ddp_rendezvous_requested(); }

ddp_status train_world_init(train_world *w) { return train_world_init_on(w, NULL); }

ddp_status train_world_init_on(train_world *w, const char *backend) {
  *w = (train_world){.rank = 0, .size = 1, .local_size = 1};
  w->source = train_world_requested();
  /* --backend mpi (DDP_BACKEND=mpi) under mpirun or srun: no RANK, ranks
   * come from MPI (ddp_init_process_group takes them from there). */
  const char *chosen = backend ? backend : getenv("DDP_BACKEND");
  if (!w->source && chosen && !strcmp(chosen, "mpi")) w->source = "--backend mpi";
  /* A training rank shares its core with its loader thread: an MPI rank
   * spinning in a blocking collective while its peer computes holds that
   * core (ddp's own backend spins briefly, then yields). Open MPI's
   * mpi_yield_when_idle makes its waits yield too, before MPI starts; the
   * user's own setting wins, and other MPIs ignore it (docs/comm.md). */
  if (chosen && !strcmp(chosen, "mpi")) setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
  if (!w->source) return DDP_OK;
  ddp_process_group_options o = ddp_process_group_defaults();
  o.backend = chosen;
  ddp_status s = ddp_init_process_group("env://", NULL, &o, &w->pg);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "joining the process group (%s is set, so ddp-train trains "
                             "data-parallel)", w->source);
  w->rank = ddp_process_group_rank(w->pg);
  w->size = ddp_process_group_size(w->pg);
  int64_t local = w->size;
  if (ddp_env_int("LOCAL_WORLD_SIZE", w->size, &local) != DDP_OK || local < 1) local = w->size;
  w->local_size = (int)local;
  ddp_log_set_rank(w->rank);
  return DDP_OK;
}

void train_world_destroy(train_world *w) {
  if (!w->pg) return;
  /* Rank 0 may host the store the others still talk to: leave together. A
   * failed barrier (a peer already gone) changes nothing here. */
  (void)ddp_barrier(w->pg);
  ddp_process_group_destroy(w->pg);
  w->pg = NULL;
}
