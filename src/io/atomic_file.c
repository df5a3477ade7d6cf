/* Atomic replacement of a file: write a temporary file beside it, fsync it,
 * rename it over the old one, fsync the directory (so the rename itself is
 * durable). Until the rename, a reader sees the old file; after it, the new
 * one, complete. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io_internal.h"

int64_t ddp__io_fail_after_bytes = -1;
/* for the fault-injection hook; atomic: ranks that are threads of one
 * process write their files at the same time (PowerSGD's per-rank state) */
static _Atomic uint64_t total_written;

static void reset(ddp__atomic_file *f) {
  memset(f, 0, sizeof *f);
  f->fd = -1;
}

ddp_status ddp__atomic_open(ddp__atomic_file *f, const char *path) {
  reset(f);
  size_t n = strlen(path) + 32;
  f->path = ddp_strdup(path);
  f->tmp = ddp_alloc(n);
  if (!f->path || !f->tmp) {
    ddp__atomic_abort(f);
    return ddp_error(DDP_ERR_NOMEM, "%s: cannot allocate", path);
  }
  snprintf(f->tmp, n, "%s.tmp.%ld", path, (long)getpid());
  /* A leftover from an earlier process that had our pid and died mid-save. */
  unlink(f->tmp);
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    int e = errno;
    ddp_status s = ddp_error(e == ENOENT ? DDP_ERR_NOTFOUND : DDP_ERR_IO,
                             "%s: cannot create the temporary file %s: %s", path, f->tmp,
                             strerror(e));
    ddp__atomic_abort(f);
    return s;
  }
  return DDP_OK;
}

ddp_status ddp__atomic_write(ddp__atomic_file *f, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    size_t chunk = n;
    if (ddp__io_fail_after_bytes >= 0) {
      uint64_t limit = (uint64_t)ddp__io_fail_after_bytes;
      if (total_written >= limit) {
        return ddp_error(DDP_ERR_IO, "%s: writing %s at offset %llu: %s (injected)", f->path,
                         f->tmp, (unsigned long long)f->written, strerror(ENOSPC));
      }
      if (chunk > limit - total_written) chunk = (size_t)(limit - total_written);
    }
    ssize_t w = write(f->fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ddp_error(DDP_ERR_IO, "%s: writing %s at offset %llu: %s", f->path, f->tmp,
                       (unsigned long long)f->written, strerror(errno));
    }
    p += w;
    n -= (size_t)w;
    f->written += (uint64_t)w;
    total_written += (uint64_t)w;
  }
  return DDP_OK;
}

ddp_status ddp__atomic_finish(ddp__atomic_file *f) {
  if (fsync(f->fd) != 0)
    return ddp_error(DDP_ERR_IO, "%s: fsync of %s: %s", f->path, f->tmp, strerror(errno));
  int fd = f->fd;
  f->fd = -1;
  if (close(fd) != 0)
    return ddp_error(DDP_ERR_IO, "%s: closing %s: %s", f->path, f->tmp, strerror(errno));
  f->finished = true;
  return DDP_OK;
}

/* fsync of the directory holding path, so that the rename is on disk. */
static ddp_status sync_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  char dir[4096];
  if (!slash) {
    snprintf(dir, sizeof dir, ".");
  } else if (slash == path) {
    snprintf(dir, sizeof dir, "/");
  } else {
    size_t n = (size_t)(slash - path);
    if (n >= sizeof dir) return ddp_error(DDP_ERR_RANGE, "%s: directory name too long", path);
    memcpy(dir, path, n);
    dir[n] = '\0';
  }
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ddp_error(DDP_ERR_IO, "%s: opening directory %s: %s", path, dir, strerror(errno));
  int rc = fsync(fd);
  int e = errno;
  close(fd);
  /* Some file systems cannot fsync a directory (EINVAL): nothing to do. */
  if (rc != 0 && e != EINVAL)
    return ddp_error(DDP_ERR_IO, "%s: fsync of directory %s: %s", path, dir, strerror(e));
  return DDP_OK;
}

ddp_status ddp__atomic_rename(ddp__atomic_file *f) {
  DDP_ASSERT(f->finished);
  if (rename(f->tmp, f->path) != 0)
    return ddp_error(DDP_ERR_IO, "%s: renaming %s over it: %s", f->path, f->tmp, strerror(errno));
  ddp_free(f->tmp);
  f->tmp = NULL; /* nothing left to remove */
  return DDP_OK;
}

ddp_status ddp__atomic_sync_dir(const char *path) { return sync_dir(path); }

ddp_status ddp__atomic_commit(ddp__atomic_file *f) {
  DDP_TRY(ddp__atomic_rename(f));
  return sync_dir(f->path);
}

void ddp__atomic_abort(ddp__atomic_file *f) {
  if (f->fd >= 0) close(f->fd);
  if (f->tmp) unlink(f->tmp);
  ddp_free(f->tmp);
  ddp_free(f->path);
  reset(f);
}

ddp_status ddp__atomic_write_file(const char *path, const void *buf, size_t n) {
  ddp__atomic_file f;
  ddp_status s = ddp__atomic_open(&f, path);
  if (s == DDP_OK) s = ddp__atomic_write(&f, buf, n);
  if (s == DDP_OK) s = ddp__atomic_finish(&f);
  if (s == DDP_OK) s = ddp__atomic_commit(&f);
  ddp__atomic_abort(&f);
  return s;
}
