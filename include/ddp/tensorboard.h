/* ddp tensorboard: TensorBoard event files, written by ddp's own code (no
 * TensorFlow, no protobuf library), and the trainer's curves in them.
 *
 * A run's curves for TensorBoard, from the trainer (rank 0 writes; call it
 * on every rank of the group, after the options are final):
 *
 *   ddp_train_tensorboard *tb;
 *   DDP_TRY(ddp_train_tensorboard_attach(&tb, &o, "runs/exp1", pg));  // pg may be NULL
 *   DDP_TRY(ddp_trainer_create(&t, model, train, test, pg, &o));
 *   ... ddp_trainer_run(t, &r) ...
 *   DDP_TRY(ddp_train_tensorboard_close(tb));   // the first write error, if any
 *
 * then `tensorboard --logdir runs`. Or any scalars and text of one's own:
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

#include "ddp/comm.h"
#include "ddp/core.h"
#include "ddp/train.h"

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

/* ---- The trainer's curves ---------------------------------------------------- */

/* What ddp_train_tensorboard_attach made: the writer (rank 0) and the
 * callbacks it chains to. Opaque. */
typedef struct ddp_train_tensorboard ddp_train_tensorboard;

/* Makes a trainer with these options write its curves to an event file in
 * `dir`: replaces options->callbacks with callbacks that write and then
 * call the ones that were there (their return values decide stops, as
 * before). Per step, at the step's number: train/loss, train/lr,
 * train/samples_per_s and phases/<phase>_ms for each part of the step
 * (load, forward, backward_compute, backward_comm, optimizer, step,
 * preempted); per evaluation: test/loss and test/accuracy; at the start:
 * the options (those of the trainer, the group's size and
 * options->checkpoint_meta's pairs) as a Markdown table, text tag
 * "options". The names after the slash are the JSON log's keys
 * (docs/train.md, "TensorBoard"). Values are stored as float32, as
 * TensorBoard's scalars are; a value that is not finite (preempted_ms
 * where the kernel has no schedstat, a regression model's accuracy) is
 * left out, as the log writes it null.
 *
 * Call it on every rank of pg (NULL: one process) with the same options,
 * once they are final and before ddp_trainer_create: every rank gets the
 * callbacks, since the trainer reduces callbacks' stop requests over the
 * group and every rank must take part; only pg's rank 0 opens a file
 * (`dir` is created if missing). With no callbacks before, this adds the
 * trainer's one 8-byte allreduce per step on a group of more than one
 * rank (docs/train.md, "Callbacks").
 *
 * The attachment must outlive the trainer's run; ddp_train_tensorboard_close
 * frees it. A write error during the run does not stop training: it is
 * logged once (a warning), nothing more is written, and close returns it.
 * On error nothing is allocated and the options are unchanged. */
ddp_status ddp_train_tensorboard_attach(ddp_train_tensorboard **out,
                                        ddp_train_options *options, const char *dir,
                                        const ddp_process_group *pg);

/* The event file's path on rank 0, NULL on other ranks (and for NULL). */
const char *ddp_train_tensorboard_path(const ddp_train_tensorboard *tb);

/* Closes the file and frees the attachment; returns the first write error
 * of the run (the message names the file), else DDP_OK. NULL is fine. The
 * options it was attached to must not be used for another trainer after:
 * their callbacks point at it. */
ddp_status ddp_train_tensorboard_close(ddp_train_tensorboard *tb);

#ifdef __cplusplus
}
#endif

#endif /* DDP_TENSORBOARD_H */
