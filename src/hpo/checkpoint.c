/* Checkpoints of the search (docs/hpo.md, "Checkpoints"):
 *   DIR/search.meta          the options a resumed search must share,
 *                            "key=value" lines (rank 0 writes it: temporary
 *                            name, fsync, rename)
 *   DIR/worker-<w>.journal   worker w's journal: every message that entered
 *                            its population, in order (its own evaluations,
 *                            arrivals, deactivations), in groups each closed
 *                            by a commit record holding the generations
 *                            done and the generator's state; appended,
 *                            fsync'd per commit.
 * Resuming replays a journal up to its last commit (a torn tail is cut off),
 * which restores the worker's population and generator exactly as they were
 * at that commit; what came after is evaluated again. So an evaluation is
 * in the journals once, or not yet. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hpo/hpo_internal.h"
#include "io/io_internal.h"

#define COMMIT_MAGIC 0x43504844u /* "DHPC" */

/* ---- search.meta ---- */

static ddp_status read_file(const char *path, char **out) {
  *out = NULL;
  FILE *f = fopen(path, "r");
  if (!f) return errno == ENOENT ? DDP_ERR_NOTFOUND
                                 : ddp_error(DDP_ERR_IO, "hpo checkpoint: cannot read %s: %s", path,
                                             strerror(errno));
  char *buf = NULL;
  size_t n = 0, cap = 0;
  int c;
  while ((c = fgetc(f)) != EOF) {
    if (n + 2 > cap) {
      cap = cap ? 2 * cap : 4096;
      char *grown = ddp_realloc(buf, n, cap);
      if (!grown) {
        ddp_free(buf);
        fclose(f);
        return ddp_error(DDP_ERR_NOMEM, "hpo checkpoint: out of memory reading %s", path);
      }
      buf = grown;
    }
    buf[n++] = (char)c;
  }
  fclose(f);
  if (!buf) buf = ddp_calloc(1, 1);
  else buf[n] = '\0';
  *out = buf;
  return buf ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "hpo checkpoint: out of memory");
}

/* The first line where a and b differ, as "key: A against B". */
static void first_difference(const char *a, const char *b, char *buf, size_t bytes) {
  while (*a || *b) {
    size_t la = strcspn(a, "\n"), lb = strcspn(b, "\n");
    if (la != lb || strncmp(a, b, la) != 0) {
      snprintf(buf, bytes, "'%.*s' (saved) against '%.*s' (now)", (int)la, a, (int)lb, b);
      return;
    }
    a += la + (a[la] == '\n');
    b += lb + (b[lb] == '\n');
  }
  snprintf(buf, bytes, "(none)");
}

ddp_status ddp__hpo_meta_check(const char *dir, const char *meta, bool resume, bool *resuming) {
  *resuming = false;
  if (mkdir(dir, 0777) != 0 && errno != EEXIST)
    return ddp_error(DDP_ERR_IO, "hpo checkpoint: cannot create %s: %s", dir, strerror(errno));
  char path[4096];
  snprintf(path, sizeof path, "%s/search.meta", dir);
  char *saved;
  ddp_status s = read_file(path, &saved);
  if (s == DDP_OK) {
    if (!resume) {
      ddp_free(saved);
      return ddp_error(DDP_ERR_STATE, "hpo checkpoint: %s holds a search already (%s); resume it "
                       "(--resume) or choose another directory", dir, path);
    }
    if (strcmp(saved, meta) != 0) {
      char diff[1024];
      first_difference(saved, meta, diff, sizeof diff);
      ddp_free(saved);
      return ddp_error(DDP_ERR_INVALID, "hpo checkpoint: the search in %s ran with other options: "
                       "%s", dir, diff);
    }
    ddp_free(saved);
    *resuming = true;
    return DDP_OK;
  }
  if (s != DDP_ERR_NOTFOUND) return s;
  return ddp__atomic_write_file(path, meta, strlen(meta));
}

/* ---- journals ---- */

struct ddp__hpo_journal {
  int fd;
  char path[4096];
  int traits;
  unsigned char *buf; /* messages since the last commit */
  size_t used, cap;
};

static size_t message_bytes(int traits) { return ddp__hpo_record_bytes(traits); }
static size_t commit_bytes(void) { return 4 + 4 + 8 + 624 * 4 + 4 + 4 + 8; }

void ddp__hpo_journal_close(ddp__hpo_journal *j) {
  if (!j) return;
  if (j->fd >= 0) close(j->fd);
  ddp_free(j->buf);
  ddp_free(j);
}

ddp_status ddp__hpo_journal_append(ddp__hpo_journal *j, const ddp__hpo_message *m) {
  const size_t mb = message_bytes(j->traits);
  if (j->used + mb > j->cap) {
    size_t cap = j->cap ? 2 * j->cap : 64 * mb;
    unsigned char *grown = ddp_realloc(j->buf, j->used, cap);
    if (!grown) return ddp_error(DDP_ERR_NOMEM, "hpo checkpoint: out of memory");
    j->buf = grown;
    j->cap = cap;
  }
  ddp__hpo_record_encode(m, j->traits, j->buf + j->used);
  j->used += mb;
  return DDP_OK;
}

/* Writes the messages and a commit record, then fsync: everything before
 * is durable, generations_done and the generator with it. */
ddp_status ddp__hpo_journal_commit(ddp__hpo_journal *j, int64_t generations_done,
                                   const ddp_pyrandom *rng) {
  unsigned char commit[4 + 4 + 8 + 624 * 4 + 4 + 4 + 8], *p = commit;
  uint32_t magic = COMMIT_MAGIC, traits = (uint32_t)j->traits, gauss = rng->has_gauss_next;
  int32_t index = rng->index;
  memcpy(p, &magic, 4), p += 4;
  memcpy(p, &traits, 4), p += 4;
  memcpy(p, &generations_done, 8), p += 8;
  memcpy(p, rng->mt, 624 * 4), p += 624 * 4;
  memcpy(p, &index, 4), p += 4;
  memcpy(p, &gauss, 4), p += 4;
  memcpy(p, &rng->gauss_next, 8);
  const struct {
    const unsigned char *data;
    size_t bytes;
  } parts[2] = {{j->buf, j->used}, {commit, sizeof commit}};
  for (int k = 0; k < 2; k++)
    for (size_t done = 0; done < parts[k].bytes;) {
      ssize_t w = write(j->fd, parts[k].data + done, parts[k].bytes - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0)
        return ddp_error(DDP_ERR_IO, "hpo checkpoint: writing %s: %s", j->path,
                         w < 0 ? strerror(errno) : "no progress");
      done += (size_t)w;
    }
  if (fsync(j->fd) != 0)
    return ddp_error(DDP_ERR_IO, "hpo checkpoint: fsync of %s: %s", j->path, strerror(errno));
  j->used = 0;
  return DDP_OK;
}

/* Opens worker's journal; when resuming, replays it up to its last commit
 * through fn (each message of a committed group, in order), restores *rng
 * and *generations_done, and cuts a torn tail off so appends continue
 * after the last commit. A fresh journal starts empty. */
ddp_status ddp__hpo_journal_open(const char *dir, int worker, int traits, bool resuming,
                                 ddp__hpo_arrival fn, void *user, ddp_pyrandom *rng,
                                 int64_t *generations_done, ddp__hpo_journal **out) {
  *out = NULL;
  *generations_done = 0;
  ddp__hpo_journal *j = ddp_calloc(1, sizeof *j);
  if (!j) return ddp_error(DDP_ERR_NOMEM, "hpo checkpoint: out of memory");
  j->traits = traits;
  snprintf(j->path, sizeof j->path, "%s/worker-%d.journal", dir, worker);
  j->fd = open(j->path, O_RDWR | O_CREAT | (resuming ? 0 : O_TRUNC) | O_CLOEXEC, 0666);
  if (j->fd < 0) {
    ddp_status s = ddp_error(DDP_ERR_IO, "hpo checkpoint: cannot open %s: %s", j->path,
                             strerror(errno));
    ddp_free(j);
    return s;
  }
  ddp_status s = DDP_OK;
  if (resuming) {
    char *data = NULL;
    size_t n = 0;
    struct stat st;
    if (fstat(j->fd, &st) == 0 && st.st_size > 0) {
      n = (size_t)st.st_size;
      data = ddp_alloc(n);
      size_t got = 0;
      while (data && got < n) {
        ssize_t r = pread(j->fd, data + got, n - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
      }
      if (!data || got != n)
        s = ddp_error(DDP_ERR_IO, "hpo checkpoint: reading %s failed", j->path);
    }
    const size_t mb = message_bytes(traits), cb = commit_bytes();
    size_t at = 0, committed = 0;
    /* First pass: where the last complete commit ends. */
    while (s == DDP_OK && at + 4 <= n) {
      uint32_t magic;
      memcpy(&magic, data + at, 4);
      if (magic == COMMIT_MAGIC && at + cb <= n) at += cb, committed = at;
      else if (magic != COMMIT_MAGIC && at + mb <= n) at += mb;
      else break; /* torn */
    }
    /* Second pass: replay what was committed. */
    ddp__hpo_message m;
    double *values = ddp_alloc((size_t)traits * sizeof *values + 1);
    if (!values && s == DDP_OK) s = ddp_error(DDP_ERR_NOMEM, "hpo checkpoint: out of memory");
    for (at = 0; s == DDP_OK && at < committed;) {
      uint32_t magic;
      memcpy(&magic, data + at, 4);
      if (magic == COMMIT_MAGIC) {
        const unsigned char *p = (const unsigned char *)data + at + 8;
        int32_t index;
        uint32_t gauss;
        memcpy(generations_done, p, 8), p += 8;
        memcpy(rng->mt, p, 624 * 4), p += 624 * 4;
        memcpy(&index, p, 4), p += 4;
        memcpy(&gauss, p, 4), p += 4;
        memcpy(&rng->gauss_next, p, 8);
        rng->index = index;
        rng->has_gauss_next = gauss != 0;
        at += cb;
        continue;
      }
      char where[4200];
      snprintf(where, sizeof where, "%s at offset %zu", j->path, at);
      m = (ddp__hpo_message){.ind = {.values = values}};
      s = ddp__hpo_record_decode(data + at, mb, traits, where, &m);
      if (s == DDP_OK) s = fn(&m, user);
      at += mb;
    }
    ddp_free(values);
    ddp_free(data);
    if (s == DDP_OK && committed < n && ftruncate(j->fd, (off_t)committed) != 0)
      s = ddp_error(DDP_ERR_IO, "hpo checkpoint: cutting %s's torn tail: %s", j->path,
                    strerror(errno));
    if (s == DDP_OK && lseek(j->fd, (off_t)committed, SEEK_SET) < 0)
      s = ddp_error(DDP_ERR_IO, "hpo checkpoint: %s: %s", j->path, strerror(errno));
  }
  if (s != DDP_OK) {
    ddp__hpo_journal_close(j);
    return s;
  }
  *out = j;
  return DDP_OK;
}
