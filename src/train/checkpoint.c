/* Checkpoints of a training run (the files: docs/io.md; a pipeline's:
 * docs/train.md, "Pipeline"): the save at a position of the loop, written
 * through the strategy, and the resumption that fills where the loop
 * starts. */
#include <math.h>
#include <stdio.h>
#include <unistd.h>

#include "train/train_internal.h"

/* The strategy writes the checkpoint (by default rank 0); every rank waits
 * at a barrier until it is on disk, so none can go on (exit, or load it)
 * before. */
ddp_status ddp__train_save(ddp_trainer *t, int64_t step, int64_t epoch, int64_t epoch_batches,
                           int64_t epoch_samples, const ddp__train_patience *pat) {
  ddp_train_state ts = {.step = step, .epoch = epoch, .epoch_batches = epoch_batches,
                        .epoch_samples = epoch_samples,
                        .sampler_seed = t->o.seed, .world_size = t->replicas,
                        .best_test_loss = pat->best_loss,
                        .evals_without_better = pat->without_better};
  if (t->strategy->save_aside) {
    /* Every rank's file first, then the checkpoint that refers to them. */
    ddp_status s = t->strategy->save_aside(t, &ts);
    int32_t failed = s != DDP_OK;
    if (s != DDP_OK) DDP_WARN("rank %d: %s", t->rank, ddp_last_error());
    if (t->pg) {
      ddp_process_group *pg = t->pg;
      if (!ddp_process_group_takes_host(pg)) DDP_TRY(ddp_process_group_host_group(pg, &pg));
      DDP_TRY(ddp_allreduce(pg, &failed, 1, DDP_INT32, DDP_REDUCE_SUM));
    }
    if (failed)
      return s != DDP_OK ? ddp_error_wrap(s, "saving the checkpoint")
                         : ddp_error(DDP_ERR_IO, "saving the checkpoint %s: %d rank(s) could not "
                                     "write their state beside it (their log says why); the "
                                     "previous checkpoint is kept", t->o.save_path, (int)failed);
  }
  if (t->strategy->save) {
    DDP_TRY(t->strategy->save(t, &ts));
  } else if (t->o.sharded_checkpoint) {
    /* Balanced ranges of the whole optimizer, as ZeRO's. */
    int world = t->pg ? t->size : 1;
    int64_t *starts = ddp_calloc((size_t)world + 1, sizeof(int64_t));
    if (!starts) return ddp_error(DDP_ERR_NOMEM, "saving the checkpoint: out of memory");
    int64_t n = ddp_model_num_param_elements(t->model);
    for (int r = 0; r <= world; r++) starts[r] = n * r / world;
    ddp_status s = ddp__train_save_sharded(t, &ts, t->opt, starts);
    ddp_free(starts);
    DDP_TRY(s);
  } else if (t->rank == 0) {
    ddp_status s = ddp_checkpoint_save(t->o.save_path, t->model, t->opt, t->sched, &ts,
                                       t->o.checkpoint_meta, t->o.checkpoint_meta_count);
    if (s != DDP_OK) return ddp_error_wrap(s, "saving the checkpoint");
  }
  if (t->pg) {
    /* On the host group where t->pg is nccl (no device buffer to meet on). */
    ddp_process_group *pg = t->pg;
    ddp_status s = ddp_process_group_takes_host(pg) ? DDP_OK : ddp_process_group_host_group(pg, &pg);
    if (s == DDP_OK) s = ddp_barrier(pg);
    if (s != DDP_OK) return ddp_error_wrap(s, "waiting for rank 0 to save the checkpoint");
  }
  return DDP_OK;
}

/* Loads resume_path through the strategy (by default every rank reads the
 * files into the model, optimizer and schedule) and fills where training
 * continues. A checkpoint taken mid-epoch by another number of shards
 * (ranks, replicas) resumes from its position in samples (the rest of the
 * epoch dealt over this run's shards); one without that position (an older
 * version) is refused: the epoch's order depends on it. */
ddp_status ddp__train_resume(ddp_trainer *t, ddp_train_state *start) {
  *start = (ddp_train_state){.world_size = t->replicas, .best_test_loss = INFINITY};
  if (!t->o.resume_path) return DDP_OK;
  ddp_status s = t->strategy->resume
                     ? t->strategy->resume(t, start)
                 : ddp_sharded_is_checkpoint(t->o.resume_path)
                     ? ddp_sharded_load(t->o.resume_path, t->model, t->opt, t->sched, start,
                                        t->o.checkpoint_meta, t->o.checkpoint_meta_count)
                     : ddp_checkpoint_load(t->o.resume_path, t->model, t->opt, t->sched, start,
                                           t->o.checkpoint_meta, t->o.checkpoint_meta_count);
  if (s != DDP_OK) return ddp_error_wrap(s, "resuming");
  if (t->strategy->resume_aside) {
    s = t->strategy->resume_aside(t, start);
    if (s != DDP_OK) return ddp_error_wrap(s, "resuming");
  }
  /* The data's shards: ranks, a pipeline's replicas. */
  const char *shards = t->strategy->shards ? t->strategy->shards : "ranks";
  const char *shards_long = t->strategy->shards_long ? t->strategy->shards_long : shards;
  if (start->world_size != t->replicas && start->epoch_batches > 0 && start->epoch_samples <= 0)
    return ddp_error(DDP_ERR_INVALID,
                     "%s was saved by %lld %s in the middle of epoch %lld by a version that did not "
                     "record the epoch's position in samples; this run has %d %s, which split that "
                     "epoch differently (resume with %lld %s, or from a checkpoint taken at the end "
                     "of an epoch)",
                     t->o.resume_path, (long long)start->world_size, shards_long,
                     (long long)start->epoch + 1, t->replicas, shards,
                     (long long)start->world_size, shards);
  return DDP_OK;
}

/* Whether the resumed epoch must be dealt from its position in samples
 * rather than replayed batch by batch: another number of shards, or an
 * epoch that already changed worlds (its position is not this world's
 * batches). The replay stays for the plain case, which it reproduces bit
 * for bit. */
bool ddp__train_resume_by_samples(const ddp_trainer *t, const ddp_train_state *start) {
  if (start->epoch_batches <= 0 || start->epoch_samples <= 0) return false;
  return start->world_size != t->replicas ||
         start->epoch_samples != start->epoch_batches * t->o.batch_size * t->replicas;
}

ddp_status ddp__train_save_sharded(ddp_trainer *t, const ddp_train_state *ts, ddp_optimizer *opt,
                                   const int64_t *starts) {
  const int world = t->pg ? t->size : 1, rank = t->pg ? t->rank : 0;
  /* One id for the save, rank 0's, names its shards. */
  uint64_t id = (uint64_t)ddp_time_ns() ^ ((uint64_t)getpid() << 40);
  if (t->pg) DDP_TRY(ddp_broadcast(t->pg, &id, 1, DDP_INT64, 0));
  char id_s[32];
  snprintf(id_s, sizeof id_s, "%016llx", (unsigned long long)id);
  ddp_status s = ddp_sharded_save_shard(t->o.save_path, id_s, rank, world, starts, t->model, opt);
  if (s != DDP_OK) DDP_WARN("rank %d: %s", rank, ddp_last_error());
  /* Every rank learns whether every shard is on disk before rank 0 writes
   * the metadata that makes them the checkpoint. */
  int32_t failed = s != DDP_OK;
  if (t->pg) DDP_TRY(ddp_allreduce(t->pg, &failed, 1, DDP_INT32, DDP_REDUCE_SUM));
  if (failed)
    return s != DDP_OK ? ddp_error_wrap(s, "saving the sharded checkpoint")
                       : ddp_error(DDP_ERR_IO, "saving the sharded checkpoint %s: %d rank(s) "
                                   "could not write their shard (their log says why); the "
                                   "previous checkpoint is kept", t->o.save_path, (int)failed);
  if (rank == 0) {
    s = ddp_sharded_save_metadata(t->o.save_path, id_s, world, starts, t->model, opt, t->sched,
                                  ts, t->o.checkpoint_meta, t->o.checkpoint_meta_count);
    if (s != DDP_OK) return ddp_error_wrap(s, "saving the sharded checkpoint");
  }
  return DDP_OK;
}
