/* Internal pieces of the io layer, and io's one internal header for the
 * layers above (docs/architecture.md): atomic file replacement (temporary
 * file, fsync, rename, directory fsync) split in two phases so that a
 * checkpoint's two files are both complete before either replaces its old
 * version, the safetensors writer on top of it, and the JSON parser (json.c)
 * that launch and the tools read their formats with. */
#ifndef DDP_IO_INTERNAL_H
#define DDP_IO_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ddp/io.h"

/* A file being replaced: writes go to `tmp` (PATH.tmp.<pid> in the same
 * directory, so the rename stays within one file system). */
typedef struct ddp__atomic_file {
  char *path;      /* owned copies */
  char *tmp;
  int fd;          /* -1 once closed */
  uint64_t written;
  bool finished;   /* fsynced and closed: ready to commit */
} ddp__atomic_file;

/* Creates the temporary file (O_EXCL; a stale one from a dead process with
 * our pid is replaced). Errors name the path. */
ddp_status ddp__atomic_open(ddp__atomic_file *f, const char *path);
/* Writes all n bytes (short writes and EINTR handled). */
ddp_status ddp__atomic_write(ddp__atomic_file *f, const void *buf, size_t n);
/* fsync and close: the temporary file is complete on disk. */
ddp_status ddp__atomic_finish(ddp__atomic_file *f);
/* Renames the finished temporary file over the path and fsyncs the
 * directory. */
ddp_status ddp__atomic_commit(ddp__atomic_file *f);
/* The two halves of commit, for renaming several files back to back before
 * one directory fsync (a checkpoint's pair). */
ddp_status ddp__atomic_rename(ddp__atomic_file *f);
ddp_status ddp__atomic_sync_dir(const char *path);
/* Closes and removes the temporary file if it is still there, frees the
 * names. Safe after commit and on a zeroed struct. */
void ddp__atomic_abort(ddp__atomic_file *f);

/* The whole of the above for a file written in one piece: buf[0..n) to a
 * temporary file beside path, fsync, rename over path, fsync of the
 * directory. On error path is untouched and nothing is left behind; the
 * message names the path. The one way ddp and its tools replace a file. */
ddp_status ddp__atomic_write_file(const char *path, const void *buf, size_t n);

/* Test hook (fault injection): when >= 0, a write that would take the
 * process's total of checkpoint bytes written past this many fails with
 * ENOSPC, as a full disk would. -1 (default) turns it off. Not thread-safe;
 * tests set it around one save. */
extern int64_t ddp__io_fail_after_bytes;

/* ddp_safetensors_write up to ddp__atomic_finish: the temporary file is
 * complete and synced, not yet renamed. On failure f is aborted. */
ddp_status ddp__safetensors_write_temp(ddp__atomic_file *f, const char *path,
                                       const ddp_safetensors_entry *entries, size_t count,
                                       const ddp_kv *metadata, size_t metadata_count);

/* ddp_safetensors_read on an image in memory (copied); `name` stands for
 * the path in messages. For the fuzzer and tests. */
ddp_status ddp__safetensors_from_bytes(const char *name, const void *bytes, size_t size,
                                       ddp_safetensors **out);

/* ---- JSON (json.c) ---------------------------------------------------------
 * A small JSON parser (RFC 8259) for file-format headers: safetensors'
 * header is the product's file-format boundary, so ddp parses it itself,
 * strictly, with byte offsets in every error. Values live in one arena that
 * ddp__json_free releases at once. */

typedef enum ddp__json_kind {
  DDP__JSON_NULL = 0,
  DDP__JSON_BOOL,
  DDP__JSON_NUMBER,
  DDP__JSON_STRING,
  DDP__JSON_ARRAY,
  DDP__JSON_OBJECT,
} ddp__json_kind;

typedef struct ddp__json ddp__json;
struct ddp__json {
  ddp__json_kind kind;
  size_t offset;       /* where the value starts, in bytes from the text's start */
  bool boolean;
  /* Numbers: is_integer when written without fraction or exponent and within
   * int64 (then integer holds it); number always holds the double value. */
  bool is_integer;
  int64_t integer;
  double number;
  /* Strings: decoded UTF-8, NUL-terminated (len excludes the NUL; a string
   * with an escaped \u0000 keeps len and stops C string functions early). */
  char *string;
  size_t len;
  /* Arrays and objects: children in document order, linked by next. For an
   * object member, key (decoded) and key_offset name it. */
  ddp__json *first;
  size_t count;
  ddp__json *next;
  const char *key;
  size_t key_offset;
};

typedef struct ddp__json_doc {
  ddp_arena arena;
  ddp__json *root;
} ddp__json_doc;

/* Parses text[0..len) (one value, whitespace around it allowed) into *doc.
 * Nesting deeper than 64 is refused (a header has depth 3). Strings must be
 * valid UTF-8 without raw control characters; object keys unique. On error
 * returns DDP_ERR_FORMAT with "<what> at offset N" (N + base_offset, so a
 * caller can report file offsets) and leaves *doc empty. NOMEM when the
 * arena cannot grow. */
ddp_status ddp__json_parse(const char *text, size_t len, size_t base_offset, ddp__json_doc *doc);
void ddp__json_free(ddp__json_doc *doc);
/* The member named key of an object, or NULL. */
const ddp__json *ddp__json_get(const ddp__json *object, const char *key);
/* "null", "boolean", "number", "string", "array", "object". */
const char *ddp__json_kind_name(ddp__json_kind kind);

/* Writes s as a JSON string (quoted, escaped) into buf at *pos, growing
 * nothing: returns false when it does not fit in cap bytes. For writers. */
bool ddp__json_put_string(char *buf, size_t cap, size_t *pos, const char *s);
/* The same to a stream: the one way ddp and its tools print a JSON string
 * (a name, a path, a user's command line may hold quotes and controls). */
void ddp__json_fput_string(FILE *f, const char *s);

/* ---- Checkpoint pieces shared with sharded checkpoints (checkpoint.c) ---- */

/* The training-state file's entries (train.*, rng.dropout, with opt its lr
 * and per-parameter state at the parameters' offsets, with sched its
 * state), built as ddp_checkpoint_save builds them. */
typedef struct ddp__ckpt_entries ddp__ckpt_entries;
ddp_status ddp__ckpt_train_entries(ddp__ckpt_entries **out, ddp_model *model, ddp_optimizer *opt,
                                   const ddp_scheduler *sched, const ddp_train_state *ts);
const ddp_safetensors_entry *ddp__ckpt_entries_get(const ddp__ckpt_entries *t, size_t *count);
void ddp__ckpt_entries_free(ddp__ckpt_entries *t);
/* Reads and checks train.*, rng.dropout, (with sched) scheduler.* and the
 * gradient scaler's grad_scaler.* (*has_scaler: whether the file has
 * them) of a training-state file, as ddp_checkpoint_load does; changes
 * nothing. */
ddp_status ddp__ckpt_read_train(const ddp_safetensors *st, ddp_model *model, ddp_scheduler *sched,
                                ddp_train_state *ts, ddp_rng *rng, ddp_scheduler_state *ss,
                                ddp_grad_scaler *scaler, bool *has_scaler);
/* Puts a loaded scaler's state (has: the file had one) into the caller's
 * scaler gs when it is enabled (ddp_train_state.grad_scaler); else nothing. */
void ddp__ckpt_apply_scaler(ddp_grad_scaler *gs, const ddp_grad_scaler *saved, bool has);
/* A scalar entry of dtype (DDP_ERR_FORMAT naming the file when absent or
 * of another dtype or shape). */
ddp_status ddp__ckpt_get_scalar(const ddp_safetensors *st, const char *name, ddp_dtype dtype,
                                void *out);

#endif /* DDP_IO_INTERNAL_H */
