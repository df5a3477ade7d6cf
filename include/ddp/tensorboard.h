/* ddp tensorboard: TensorBoard event files, written by ddp's own code (no
 * TensorFlow, no protobuf library). Part of the io layer: it needs core
 * only. The trainer's curves in them are train's (ddp_train_tensorboard_attach,
 * include/ddp/train.h).
 *
 * Scalars and text of one's own, then `tensorboard --logdir runs`:
 *
 *   ddp_summary_writer *w;
 *   DDP_TRY(ddp_summary_writer_create(&w, "runs/exp1", NULL));
 *   DDP_TRY(ddp_summary_writer_add_scalar(w, "train/loss", 0.25f, step, NAN));
 *   ddp_summary_writer_destroy(w);
 *
 * The format (docs/train.md, "TensorBoard"): a file of TFRecords (little-
 * endian uint64 length, its masked CRC-32C, the bytes, their masked
 * CRC-32C), each an `Event` protocol buffer (tensorflow/core/util/
 * event.proto): the first {wall_time, file_version "brain.Event:2"}, then
 * {wall_time, step, summary}, a `Summary` holding Values {tag,
 * simple_value} for scalars and, for text, the text plugin's string tensor,
 * as PyTorch's SummaryWriter writes them. The file is only appended to,
 * a record at a time in one write(2), so a reader follows a live run, and
 * a run killed mid-record leaves a partial last record, which TensorBoard
 * ignores. */
#ifndef DDP_TENSORBOARD_H
#define DDP_TENSORBOARD_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Event files ------------------------------------------------------------ */

/* One event file being written. Opaque; one thread at a time. */
typedef struct ddp_summary_writer ddp_summary_writer;

/* Creates `dir` (and its parents) if missing and a new event file in it,
 * named as SummaryWriter names its files:
 * events.out.tfevents.<time, 10 digits>.<host>.<pid>.<n><suffix>, where n
 * counts this process's writers from 0 and suffix may be NULL. Writes the
 * file-version event. The library allocates the writer;
 * ddp_summary_writer_destroy frees it. Errors name the path. */
ddp_status ddp_summary_writer_create(ddp_summary_writer **out, const char *dir,
                                     const char *suffix);

/* The event file's path (owned by the writer). */
const char *ddp_summary_writer_path(const ddp_summary_writer *w);

/* Appends one event at `step` holding a scalar per tag (tags[i] =
 * values[i]; n >= 1), as SummaryWriter.add_scalar does for each. wall_time
 * is seconds since the Unix epoch; NaN means now. The record reaches the
 * file before the call returns (no buffering in between). Tags must be
 * non-empty. Errors (a full disk) name the file; the file keeps every
 * record written before. */
ddp_status ddp_summary_writer_add_scalars(ddp_summary_writer *w, size_t n,
                                          const char *const *tags, const float *values,
                                          int64_t step, double wall_time);
ddp_status ddp_summary_writer_add_scalar(ddp_summary_writer *w, const char *tag, float value,
                                         int64_t step, double wall_time);

/* Appends a text summary as SummaryWriter.add_text(tag, text, step) does:
 * tag "<tag>/text_summary", the text plugin's metadata, and the UTF-8 text
 * as a one-element string tensor (TensorBoard renders it as Markdown). */
ddp_status ddp_summary_writer_add_text(ddp_summary_writer *w, const char *tag, const char *text,
                                       int64_t step, double wall_time);

/* Closes the file and frees the writer; NULL is fine. Nothing is pending:
 * every add has reached the file already. */
void ddp_summary_writer_destroy(ddp_summary_writer *w);

#ifdef __cplusplus
}
#endif

#endif /* DDP_TENSORBOARD_H */
