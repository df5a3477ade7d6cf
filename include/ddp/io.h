/* ddp io: safetensors files and checkpoints.
 *
 * safetensors (Hugging Face's public format): an 8-byte little-endian header
 * length N, N bytes of JSON header {name: {"dtype", "shape", "data_offsets":
 * [begin, end]}, optional "__metadata__": {str: str}}, then the tensors' raw
 * little-endian bytes; offsets count from the start of the data section,
 * and the tensors tile it (no gaps, no overlap). docs/io.md has the details.
 *
 * A checkpoint is two safetensors files (docs/io.md "Checkpoints"):
 *   PATH                      the model's state dict, exactly PyTorch's
 *                             model.state_dict() (names, shapes, dtypes), so
 *                             torch loads it with load_state_dict(strict=True);
 *   ddp_checkpoint_train_path(PATH)  the training state: optimizer state,
 *                             step, epoch, position in the epoch, RNG states,
 *                             sampler seed, lr scheduler.
 * Every write goes to a temporary file in the same directory, is fsynced and
 * renamed over the old file, and the directory is fsynced: a failed or
 * interrupted save leaves the previous file whole. Every read validates the
 * whole file before anything is copied into a model or optimizer, and errors
 * name the file, the byte offset and the tensor.
 *
 * Typical use (rank 0 writes, every rank loads after a barrier):
 *
 *   ddp_train_state ts = {.step = step, .epoch = epoch, ...};
 *   if (rank == 0) DDP_TRY(ddp_checkpoint_save(path, model, opt, sched, &ts, meta, n_meta));
 *   ddp_barrier(pg);
 *   DDP_TRY(ddp_checkpoint_load(path, model, opt, sched, &ts, meta, n_meta)); */
#ifndef DDP_IO_H
#define DDP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- safetensors files ------------------------------------------------------ */

/* A string pair for "__metadata__" (both borrowed by whoever passes them). */
typedef struct ddp_kv {
  const char *key;
  const char *value;
} ddp_kv;

/* One tensor to write: row-major, little-endian host data (borrowed). */
typedef struct ddp_safetensors_entry {
  const char *name;
  ddp_dtype dtype;
  int32_t ndim;                 /* 0 for a scalar (shape []) */
  int64_t shape[DDP_MAX_DIMS];
  const void *data;             /* numel * ddp_dtype_size(dtype) bytes */
} ddp_safetensors_entry;

/* Writes the tensors (data in the given order) and metadata to `path`
 * atomically: `path`.tmp.<pid> in the same directory, written, fsynced,
 * renamed over `path`, then the directory fsynced. Names must be unique,
 * non-empty and not "__metadata__"; dtypes float32, float64, int32, int64,
 * float16, bfloat16 or uint8. On failure the temporary file is removed, the
 * file at `path` (if any) is untouched, and the message names the path, the
 * step (create, write, fsync, rename) and strerror. */
ddp_status ddp_safetensors_write(const char *path, const ddp_safetensors_entry *entries,
                                 size_t count, const ddp_kv *metadata, size_t metadata_count);

/* A file read into memory and validated. Opaque; ddp_safetensors_free. */
typedef struct ddp_safetensors ddp_safetensors;

/* One tensor of a read file. data points into the file's image (valid until
 * ddp_safetensors_free) and may be unaligned: copy it with memcpy. */
typedef struct ddp_safetensors_tensor {
  const char *name;
  ddp_dtype dtype;
  int32_t ndim;
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  size_t bytes;
  const void *data;
  uint64_t file_offset;        /* where the data starts in the file */
} ddp_safetensors_tensor;

/* Reads and validates `path`: the header length against the file size (and
 * a 100 MiB cap, the reference implementation's), the header's JSON syntax,
 * every entry (dtype name, shape of non-negative integers, data_offsets
 * [begin, end] with end - begin = numel * dtype size), the entries tiling the
 * data section exactly (an overlap, a gap or an offset past the end is an
 * error naming both tensors or the range), metadata values strings.
 * DDP_ERR_NOTFOUND (no such file), DDP_ERR_IO (cannot read), DDP_ERR_FORMAT
 * ("safetensors: PATH: ... at offset N (tensor NAME)"), DDP_ERR_UNSUPPORTED
 * for a valid dtype ddp has no type for (BOOL, I8, U16, F8_*...).
 * The caller frees *out (NULL on failure). */
ddp_status ddp_safetensors_read(const char *path, ddp_safetensors **out);
void ddp_safetensors_free(ddp_safetensors *st);
size_t ddp_safetensors_count(const ddp_safetensors *st);
/* Tensor `index` in header order; DDP_ERR_RANGE past the end. */
ddp_status ddp_safetensors_get(const ddp_safetensors *st, size_t index,
                               ddp_safetensors_tensor *out);
/* By name; DDP_ERR_NOTFOUND naming the file and the tensor. */
ddp_status ddp_safetensors_find(const ddp_safetensors *st, const char *name,
                                ddp_safetensors_tensor *out);
/* The metadata value for key, or NULL. */
const char *ddp_safetensors_metadata(const ddp_safetensors *st, const char *key);
const char *ddp_safetensors_path(const ddp_safetensors *st);
/* The dtype's safetensors name ("F32", "I64", ...). */
const char *ddp_safetensors_dtype_name(ddp_dtype dtype);

/* ---- Model state dicts ------------------------------------------------------ */

/* Writes the model's state dict (ddp_model_state_entry order: PyTorch's
 * state_dict() order, names without any "module." prefix, num_batches_tracked
 * as an int64 scalar) atomically to `path`, with metadata "format": "pt",
 * "ddp.model": ddp_model_name(model) and the caller's pairs. */
ddp_status ddp_model_save(const ddp_model *model, const char *path, const ddp_kv *metadata,
                          size_t metadata_count);
/* load_state_dict(strict=True) from `path`: every entry of the model must be
 * in the file with the same dtype and shape, and nothing else may be (a
 * "module." prefix, as DistributedDataParallel's state_dict has, is
 * accepted and stripped). Everything is checked before any tensor is copied,
 * so on error the model is unchanged; the message lists the missing and
 * unexpected names (as PyTorch does) or the mismatched shape with both
 * shapes. */
ddp_status ddp_model_load(ddp_model *model, const char *path);
/* The same from a file already read. */
ddp_status ddp_model_load_from(ddp_model *model, const ddp_safetensors *st);

/* ---- Checkpoints: model + training state ------------------------------------ */

/* Where the run stood when it was saved. */
typedef struct ddp_train_state {
  int64_t step;             /* optimizer steps since the start of training */
  int64_t epoch;            /* the epoch to continue (the one in progress) */
  int64_t epoch_batches;    /* batches of `epoch` already consumed (0: at its start) */
  uint64_t sampler_seed;    /* the distributed sampler's seed */
  int64_t world_size;       /* ranks that trained (the sampler's num_replicas) */
  /* Early stopping's position (ddp-train --patience): the lowest test loss
   * so far (INFINITY before the first evaluation) and the evaluations since
   * it was reached (0 and 0 from callers without early stopping).
   * Checkpoints written without them load as INFINITY, 0. */
  double best_test_loss;
  int64_t evals_without_better;
  /* Positions of `epoch`'s order consumed (steps x the global batch, over
   * every world the epoch ran at), so a run at another world size can deal
   * out the rest (ddp_sampler_distributed_resume). -1: unknown (a
   * checkpoint of an older version: resumable at its own world only). */
  int64_t epoch_samples;
  /* The run's gradient scaler (include/ddp/optim.h; NULL: none). Saving,
   * an enabled one's state goes into the training-state file under
   * PyTorch's GradScaler.state_dict() keys, "grad_scaler.scale" (float32,
   * as its _scale), "grad_scaler.growth_factor", "grad_scaler.backoff_factor"
   * (float64), "grad_scaler.growth_interval" and "grad_scaler._growth_tracker"
   * (int64). Loading, the caller points it at the scaler to restore
   * (it is kept in *ts): an enabled one gets the saved state when the file
   * has one (checked: ddp_grad_scaler_check, else DDP_ERR_FORMAT) and stays
   * as it was when not (a run that starts scaling from an unscaled
   * checkpoint starts at the initial scale); a disabled one is left alone,
   * as PyTorch's disabled load_state_dict is a no-op. */
  struct ddp_grad_scaler *grad_scaler;
  int64_t reserved[4];
} ddp_train_state;
DDP_STRUCT_SIZE(ddp_train_state, 104);

/* PATH's training-state file: PATH with a final ".safetensors" replaced by
 * ".train.safetensors", or ".train.safetensors" appended when PATH has no
 * such suffix. Written into buf (NUL-terminated); DDP_ERR_RANGE if it does
 * not fit. */
ddp_status ddp_checkpoint_train_path(const char *path, char *buf, size_t bytes);

/* Saves the model to `path` and the training state beside it: `opt`'s state
 * in PyTorch's optimizer.state_dict() layout flattened to names
 * ("optimizer.state.<param index>.<key>", shaped like the parameter;
 * omitted before the first step, as PyTorch's is empty), its lr, `sched`'s
 * state (NULL: none), `ts`, and the model's dropout generator. `metadata`
 * goes into both files (the run's options, which ddp_checkpoint_load
 * compares). Both files get the same "ddp.checkpoint_id"; both temporary
 * files are complete and fsynced before either is renamed, so a failed save
 * leaves the previous pair whole. opt and sched may be NULL. */
ddp_status ddp_checkpoint_save(const char *path, const ddp_model *model, ddp_optimizer *opt,
                               const ddp_scheduler *sched, const ddp_train_state *ts,
                               const ddp_kv *metadata, size_t metadata_count);

/* Loads a checkpoint written by ddp_checkpoint_save into a model, optimizer
 * and scheduler built with the same options. Refused (DDP_ERR_INVALID naming
 * the key and both values) when a metadata pair of `expect` differs from the
 * saved one or is missing from it, and when the two files come from
 * different saves (their checkpoint ids differ: a save interrupted between
 * its two renames). Both files are read and validated completely before
 * anything is copied: on error model, opt, sched and *ts are unchanged.
 * opt / sched NULL skip their parts (a file that has them is fine). */
ddp_status ddp_checkpoint_load(const char *path, ddp_model *model, ddp_optimizer *opt,
                               ddp_scheduler *sched, ddp_train_state *ts, const ddp_kv *expect,
                               size_t expect_count);

/* ---- Sharded checkpoints (docs/sharding.md) --------------------------------
 * A directory instead of a pair of files (torch.distributed.checkpoint's
 * idea): each rank writes the pieces of the parameters and of the
 * optimizer state that fall in its range of the flat buffers
 * (DIR/shard-R-of-W.ID.safetensors, one-dimensional tensors under the
 * ordinary checkpoint's names), and rank 0 writes DIR/metadata.safetensors
 * last: the training state, the buffers, and in its "ddp.layout" metadata
 * every tensor's dtype, global shape and pieces (rank, offset, numel).
 * Each file is written atomically; the metadata names the shards of its
 * save by ID, so until its rename the previous checkpoint stays whole. A
 * sharded checkpoint loads at any world size, with or without ZeRO. */

/* Rank `rank` of `world`'s shard: floats [starts[rank], starts[rank + 1])
 * of the flat buffers (starts: world + 1 range starts in the model's
 * current layout), from `model`'s parameters and `opt`'s state (opt over
 * exactly that range, as ZeRO narrows it, or over the whole buffers; NULL
 * or without state: none). Rank 0's also holds the buffers. `id` names the
 * save (the same on every rank; letters, digits, '-'). */
ddp_status ddp_sharded_save_shard(const char *dir, const char *id, int rank, int world,
                                  const int64_t *starts, const ddp_model *model,
                                  ddp_optimizer *opt);
/* Rank 0, after every rank's shard is on disk: the metadata file, then
 * the shards of other saves removed. opt: any rank's (its lr, its
 * scalars and whether it has state). */
ddp_status ddp_sharded_save_metadata(const char *dir, const char *id, int world,
                                     const int64_t *starts, const ddp_model *model,
                                     ddp_optimizer *opt, const ddp_scheduler *sched,
                                     const ddp_train_state *ts, const ddp_kv *metadata,
                                     size_t metadata_count);
/* Loads a sharded checkpoint into a model, an optimizer over the model's
 * whole flat buffers (NULL: skipped) and a scheduler (NULL: skipped),
 * whatever world size wrote it. Everything is read and checked (every
 * piece inside its tensor, the pieces tiling it, every tensor of the
 * model present with its shape, the shards from the same save) before
 * anything changes; errors name the file, the tensor and the offset. */
ddp_status ddp_sharded_load(const char *dir, ddp_model *model, ddp_optimizer *opt,
                            ddp_scheduler *sched, ddp_train_state *ts, const ddp_kv *expect,
                            size_t expect_count);
/* Whether path is a directory holding metadata.safetensors. */
bool ddp_sharded_is_checkpoint(const char *path);
/* The model's whole state dict from the shards, written (atomically) to
 * out as ddp_model_save writes it: PyTorch's names and order, "format":
 * "pt", loadable with load_state_dict(strict=True). Needs no model. */
ddp_status ddp_sharded_consolidate(const char *dir, const char *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_IO_H */
