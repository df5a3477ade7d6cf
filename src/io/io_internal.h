/* Internal pieces of the io layer: atomic file replacement (temporary file,
 * fsync, rename, directory fsync) split in two phases so that a checkpoint's
 * two files are both complete before either replaces its old version, and
 * the safetensors writer on top of it. */
#ifndef DDP_IO_INTERNAL_H
#define DDP_IO_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

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

#endif /* DDP_IO_INTERNAL_H */
