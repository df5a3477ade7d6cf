/* The file store (PyTorch's FileStore, for `file://` on a shared filesystem):
 * an append-only log of records in one file, guarded by an fcntl lock on the
 * whole file. Every handle keeps the table the log describes and the offset
 * it has read to; each operation locks, reads the records others appended
 * since, does its work (a write appends one record), and unlocks. Blocking
 * calls poll: they recheck when the file grows, sleeping 1 ms doubling to
 * 50 ms in between.
 *
 * File layout: "DDPFSv1\n", then records
 *   u8 type (1 set, 2 delete) | u32 key length | key | [u32 value length | value]
 * little-endian. add, compare_set and append are written as sets of the
 * resulting value, computed under the lock. A record cut short by a writer
 * that died mid-write is cut off by the next writer. The log is not
 * compacted: it grows with every write (rendezvous writes a few per rank). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store/protocol.h"
#include "store/store_impl.h"
#include "store/table.h"

#define FILE_MAGIC "DDPFSv1\n"
#define FILE_MAGIC_BYTES 8
#define REC_SET 1
#define REC_DELETE 2
#define POLL_FIRST_MS 1
#define POLL_MAX_MS 50

typedef struct file_store {
  ddp_store base;
  pthread_mutex_t mu; /* one operation at a time on this handle */
  char *path;
  int fd;
  ddp__kv_table table; /* the log's state up to `offset` */
  uint64_t offset;
  ddp__buf rec;     /* records being written */
  ddp__buf scratch; /* bytes being read */
} file_store;

static file_store *as_file(ddp_store *s) { return (file_store *)s; }

/* Takes the whole-file lock (an open-file-description lock, so that two
 * handles in one process exclude each other too), polling until deadline. */
static ddp_status lock_file(file_store *f, int64_t deadline_ns) {
  struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
  int64_t nap = POLL_FIRST_MS;
  for (;;) {
    if (fcntl(f->fd, F_OFD_SETLK, &fl) == 0) return DDP_OK;
    if (errno != EAGAIN && errno != EACCES && errno != EINTR)
      return ddp_error(DDP_ERR_IO, "cannot lock %s: %s", f->path, strerror(errno));
    if (ddp_time_ns() >= deadline_ns)
      return ddp_error(DDP_ERR_TIMEOUT, "timed out waiting for the lock on %s", f->path);
    ddp__store_sleep_ms(nap);
    nap = nap * 2 > POLL_MAX_MS ? POLL_MAX_MS : nap * 2;
  }
}

static void unlock_file(file_store *f) {
  struct flock fl = {.l_type = F_UNLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
  fcntl(f->fd, F_OFD_SETLK, &fl);
}

static ddp_status pread_full(file_store *f, void *buf, size_t len, uint64_t at) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = pread(f->fd, (char *)buf + done, len - done, (off_t)(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ddp_error(DDP_ERR_IO, "read %s: %s", f->path, strerror(errno));
    if (n == 0) return ddp_error(DDP_ERR_IO, "read %s: file shrank while locked", f->path);
    done += (size_t)n;
  }
  return DDP_OK;
}

static ddp_status pwrite_full(file_store *f, const void *buf, size_t len, uint64_t at) {
  size_t done = 0;
  while (done < len) {
    ssize_t n = pwrite(f->fd, (const char *)buf + done, len - done, (off_t)(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ddp_error(DDP_ERR_IO, "write %s: %s", f->path, strerror(errno));
    done += (size_t)n;
  }
  return DDP_OK;
}

/* Reads a u32-length-prefixed field. Returns 1 on success, 0 if the buffer
 * ends first (a partial record), -1 if the length is over max (corrupt). */
static int field(ddp__reader *r, size_t max, ddp__slice *out) {
  if (r->end - r->p < 4) return 0;
  uint32_t len = ddp__load_u32(r->p);
  if (len > max) return -1;
  if ((size_t)(r->end - r->p) - 4 < len) return 0;
  out->data = r->p + 4;
  out->len = len;
  r->p += 4 + (size_t)len;
  return 1;
}

/* Applies the whole records in buf; *used = their bytes. A partial record at
 * the end is left (not an error); anything malformed is. */
static ddp_status apply_records(file_store *f, const uint8_t *buf, size_t len, size_t *used) {
  ddp__reader r = {buf, buf + len, 0};
  *used = 0;
  while (r.p < r.end) {
    uint8_t type = *r.p++;
    ddp__slice key = {NULL, 0}, value = {NULL, 0};
    int ok =
        type == REC_SET || type == REC_DELETE ? field(&r, DDP_STORE_MAX_KEY_BYTES * 2, &key) : -1;
    if (ok == 1 && key.len == 0) ok = -1;
    if (ok == 1 && type == REC_SET) ok = field(&r, DDP_STORE_MAX_VALUE_BYTES, &value);
    if (ok == 0) return DDP_OK;
    if (ok < 0)
      return ddp_error(DDP_ERR_FORMAT, "%s: corrupt record (type %u) at offset %" PRIu64, f->path,
                       type, f->offset + *used);
    if (type == REC_SET) {
      DDP_TRY(ddp__kv_set(&f->table, (const char *)key.data, key.len, value.data, value.len, NULL));
    } else {
      int deleted;
      ddp__kv_delete(&f->table, (const char *)key.data, key.len, &deleted);
    }
    *used = (size_t)(r.p - buf);
  }
  return DDP_OK;
}

/* Brings the table up to date with the file (lock held). A partial record at
 * the end -- a writer that died mid-record -- is cut off. */
static ddp_status refresh(file_store *f) {
  struct stat sb;
  if (fstat(f->fd, &sb) != 0) return ddp_error(DDP_ERR_IO, "stat %s: %s", f->path, strerror(errno));
  uint64_t size = (uint64_t)sb.st_size;
  if (size < f->offset) {
    /* Someone truncated or replaced the log: start over. */
    ddp__kv_free(&f->table);
    ddp__kv_init(&f->table, 0);
    f->offset = FILE_MAGIC_BYTES;
  }
  if (size == f->offset) return DDP_OK;
  size_t len = (size_t)(size - f->offset);
  f->scratch.len = 0;
  ddp__buf_reserve(&f->scratch, len);
  if (f->scratch.failed) {
    f->scratch.failed = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory reading %zu bytes of %s", len, f->path);
  }
  DDP_TRY(pread_full(f, f->scratch.data, len, f->offset));
  size_t used;
  DDP_TRY(apply_records(f, f->scratch.data, len, &used));
  f->offset += used;
  if (used < len) {
    ddp_log(DDP_LOG_WARN,
            "file store %s: cutting off a partial record at offset %" PRIu64
            " (a writer died mid-write)",
            f->path, f->offset);
    if (ftruncate(f->fd, (off_t)f->offset) != 0)
      return ddp_error(DDP_ERR_IO, "truncate %s: %s", f->path, strerror(errno));
  }
  if (f->scratch.cap > (1u << 20)) ddp__buf_free(&f->scratch);
  return DDP_OK;
}

static void rec_set(file_store *f, const char *key, size_t key_len, const void *v, size_t n) {
  ddp__buf_u8(&f->rec, REC_SET);
  ddp__buf_bytes(&f->rec, key, key_len);
  ddp__buf_bytes(&f->rec, v, n);
}

/* Appends the records in f->rec to the log and to our table (lock held). */
static ddp_status commit(file_store *f) {
  if (f->rec.failed) {
    f->rec.failed = 0;
    f->rec.len = 0;
    return ddp_error(DDP_ERR_NOMEM, "out of memory");
  }
  ddp_status st = pwrite_full(f, f->rec.data, f->rec.len, f->offset);
  size_t used = 0;
  if (st == DDP_OK) st = apply_records(f, f->rec.data, f->rec.len, &used);
  if (st == DDP_OK) f->offset += used;
  f->rec.len = 0;
  if (f->rec.cap > (1u << 20)) ddp__buf_free(&f->rec);
  return st;
}

/* Locks the handle and the file and refreshes. */
static ddp_status begin(file_store *f) {
  pthread_mutex_lock(&f->mu);
  int64_t deadline = ddp_time_ns() + ddp_store_timeout_ms(&f->base) * 1000000LL;
  ddp_status st = lock_file(f, deadline);
  if (st == DDP_OK) {
    st = refresh(f);
    if (st != DDP_OK) unlock_file(f);
  }
  if (st != DDP_OK) pthread_mutex_unlock(&f->mu);
  return st;
}

static ddp_status end(file_store *f, ddp_status st) {
  unlock_file(f);
  pthread_mutex_unlock(&f->mu);
  return st;
}

static int present(file_store *f, const char *key) {
  const ddp__kv_entry *e = ddp__kv_find(&f->table, key, strlen(key));
  return e && e->has_value;
}

static size_t first_missing(file_store *f, const char *const *keys, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!present(f, keys[i])) return i;
  return n;
}

/* Polls until every key exists, then returns with both locks held. */
static ddp_status await_keys(file_store *f, const char *const *keys, size_t n, int64_t timeout_ms) {
  int64_t deadline = ddp_time_ns() + timeout_ms * 1000000LL;
  int64_t nap = POLL_FIRST_MS;
  for (;;) {
    DDP_TRY(begin(f));
    size_t miss = first_missing(f, keys, n);
    if (miss == n) return DDP_OK;
    end(f, DDP_OK);
    int64_t left_ms = (deadline - ddp_time_ns()) / 1000000LL;
    if (left_ms <= 0) return ddp__store_keys_timeout(timeout_ms, keys, n, miss);
    /* Sleep, but wake early if the file grows. */
    int64_t slept = 0, step = nap < left_ms ? nap : left_ms;
    struct stat sb;
    while (slept < step) {
      ddp__store_sleep_ms(1);
      slept++;
      if (fstat(f->fd, &sb) == 0 && (uint64_t)sb.st_size != f->offset) break;
    }
    nap = nap * 2 > POLL_MAX_MS ? POLL_MAX_MS : nap * 2;
  }
}

static ddp_status file_set(ddp_store *s, const char *key, const void *v, size_t n) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  rec_set(f, key, strlen(key), v, n);
  return end(f, commit(f));
}

static ddp_status file_get(ddp_store *s, const char *key, int64_t timeout_ms, void **v, size_t *n) {
  file_store *f = as_file(s);
  DDP_TRY(await_keys(f, &key, 1, timeout_ms));
  const ddp__kv_entry *e = ddp__kv_find(&f->table, key, strlen(key));
  *v = ddp__store_copy_value(e->value, e->value_len);
  *n = e->value_len;
  return end(f, *v ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "out of memory"));
}

static ddp_status file_add(ddp_store *s, const char *key, int64_t delta, int64_t *result) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  /* Compute on a scratch copy of the entry via the table's own semantics,
   * then log the resulting value. */
  ddp__kv_entry *e = ddp__kv_find(&f->table, key, strlen(key));
  int64_t cur = 0, sum;
  if (e && e->has_value) {
    int rc = ddp__store_parse_int(e->value, e->value_len, &cur);
    if (rc != 0) {
      /* Let the table produce the standard message. */
      ddp_status st = ddp__kv_add(&f->table, key, strlen(key), delta, result, NULL);
      return end(f, st);
    }
  }
  if (__builtin_add_overflow(cur, delta, &sum))
    return end(f,
               ddp_error(DDP_ERR_RANGE, "%" PRId64 " + %" PRId64 " overflows int64", cur, delta));
  char text[24];
  int len = snprintf(text, sizeof text, "%" PRId64, sum);
  rec_set(f, key, strlen(key), text, (size_t)len);
  ddp_status st = commit(f);
  if (st == DDP_OK) *result = sum;
  return end(f, st);
}

static ddp_status file_compare_set(ddp_store *s, const char *key, const void *exp, size_t en,
                                   const void *des, size_t dn, void **cur, size_t *cn) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  const ddp__kv_entry *e = ddp__kv_find(&f->table, key, strlen(key));
  const void *result;
  size_t rlen;
  int write = 0;
  if (!e || !e->has_value) {
    write = en == 0;
    result = write ? des : exp;
    rlen = write ? dn : en;
  } else if (e->value_len == en && (en == 0 || !memcmp(e->value, exp, en))) {
    write = 1;
    result = des;
    rlen = dn;
  } else {
    result = e->value;
    rlen = e->value_len;
  }
  *cur = ddp__store_copy_value(result, rlen);
  *cn = rlen;
  if (!*cur) return end(f, ddp_error(DDP_ERR_NOMEM, "out of memory"));
  ddp_status st = DDP_OK;
  if (write) {
    rec_set(f, key, strlen(key), des, dn);
    st = commit(f);
  }
  if (st != DDP_OK) {
    ddp_free(*cur);
    *cur = NULL;
  }
  return end(f, st);
}

static ddp_status file_wait(ddp_store *s, const char *const *keys, size_t n, int64_t timeout_ms) {
  file_store *f = as_file(s);
  DDP_TRY(await_keys(f, keys, n, timeout_ms));
  return end(f, DDP_OK);
}

static ddp_status file_check(ddp_store *s, const char *const *keys, size_t n, int *all) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  *all = first_missing(f, keys, n) == n;
  return end(f, DDP_OK);
}

static ddp_status file_del(ddp_store *s, const char *key, int *deleted) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  *deleted = present(f, key);
  if (!*deleted) return end(f, DDP_OK);
  ddp__buf_u8(&f->rec, REC_DELETE);
  ddp__buf_bytes(&f->rec, key, strlen(key));
  return end(f, commit(f));
}

static ddp_status file_num_keys(ddp_store *s, const char *prefix, int64_t *count) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  *count = (int64_t)ddp__kv_count_prefix(&f->table, prefix, strlen(prefix));
  return end(f, DDP_OK);
}

static ddp_status file_list_keys(ddp_store *s, const char *prefix, char ***keys, size_t *count) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  return end(f, ddp__kv_list_prefix(&f->table, prefix, strlen(prefix), keys, count));
}

static ddp_status file_append(ddp_store *s, const char *key, const void *v, size_t n) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  const ddp__kv_entry *e = ddp__kv_find(&f->table, key, strlen(key));
  size_t old = e && e->has_value ? e->value_len : 0;
  if (old + n > DDP_STORE_MAX_VALUE_BYTES)
    return end(f, ddp_error(DDP_ERR_RANGE, "appended value of %zu bytes exceeds the limit of %u",
                            old + n, DDP_STORE_MAX_VALUE_BYTES));
  ddp__buf_u8(&f->rec, REC_SET);
  ddp__buf_bytes(&f->rec, key, strlen(key));
  ddp__buf_u32(&f->rec, (uint32_t)(old + n));
  if (old) ddp__buf_put(&f->rec, e->value, old);
  ddp__buf_put(&f->rec, v, n);
  return end(f, commit(f));
}

static ddp_status file_multi_get(ddp_store *s, const char *const *keys, size_t n,
                                 int64_t timeout_ms, ddp_store_value *values) {
  file_store *f = as_file(s);
  DDP_TRY(await_keys(f, keys, n, timeout_ms));
  for (size_t i = 0; i < n; i++) {
    const ddp__kv_entry *e = ddp__kv_find(&f->table, keys[i], strlen(keys[i]));
    values[i].data = ddp__store_copy_value(e->value, e->value_len);
    values[i].bytes = e->value_len;
    if (!values[i].data) return end(f, ddp_error(DDP_ERR_NOMEM, "out of memory"));
  }
  return end(f, DDP_OK);
}

static ddp_status file_multi_set(ddp_store *s, const char *const *keys,
                                 const ddp_store_value *values, size_t n) {
  file_store *f = as_file(s);
  DDP_TRY(begin(f));
  for (size_t i = 0; i < n; i++)
    rec_set(f, keys[i], strlen(keys[i]), values[i].data, values[i].bytes);
  return end(f, commit(f)); /* one write under the lock: all or nothing for readers */
}

static ddp_status file_clone(ddp_store *s, ddp_store **out) {
  ddp_store_options o = {.timeout_ms = ddp_store_timeout_ms(s)};
  return ddp_store_file_open(as_file(s)->path, &o, out);
}

static void file_destroy(ddp_store *s) {
  file_store *f = as_file(s);
  if (f->fd >= 0) close(f->fd);
  ddp__kv_free(&f->table);
  ddp__buf_free(&f->rec);
  ddp__buf_free(&f->scratch);
  ddp_free(f->path);
  pthread_mutex_destroy(&f->mu);
  ddp__store_fini(s);
  ddp_free(f);
}

static const ddp__store_ops file_ops = {
    .kind = "file",
    .set = file_set,
    .get = file_get,
    .add = file_add,
    .compare_set = file_compare_set,
    .wait = file_wait,
    .check = file_check,
    .del = file_del,
    .num_keys = file_num_keys,
    .list_keys = file_list_keys,
    .append = file_append,
    .multi_get = file_multi_get,
    .multi_set = file_multi_set,
    .clone = file_clone,
    .destroy = file_destroy,
};

/* Writes the magic into an empty file, or checks it (lock held). */
static ddp_status init_file(file_store *f) {
  struct stat sb;
  if (fstat(f->fd, &sb) != 0) return ddp_error(DDP_ERR_IO, "stat %s: %s", f->path, strerror(errno));
  if (sb.st_size == 0) {
    DDP_TRY(pwrite_full(f, FILE_MAGIC, FILE_MAGIC_BYTES, 0));
  } else {
    char magic[FILE_MAGIC_BYTES] = {0};
    if (sb.st_size < FILE_MAGIC_BYTES || pread_full(f, magic, FILE_MAGIC_BYTES, 0) != DDP_OK ||
        memcmp(magic, FILE_MAGIC, FILE_MAGIC_BYTES) != 0)
      return ddp_error(DDP_ERR_FORMAT,
                       "%s is not a ddp file store (it does not start with \"DDPFSv1\"); "
                       "remove it or choose another path",
                       f->path);
  }
  f->offset = FILE_MAGIC_BYTES;
  return refresh(f);
}

ddp_status ddp_store_file_open(const char *path, const ddp_store_options *options,
                               ddp_store **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_store_file_open: out is NULL");
  *out = NULL;
  if (!path || !*path) return ddp_error(DDP_ERR_INVALID, "ddp_store_file_open: path is empty");
  file_store *f = ddp_calloc(1, sizeof *f);
  if (!f) return ddp_error(DDP_ERR_NOMEM, "out of memory");
  f->fd = -1;
  pthread_mutex_init(&f->mu, NULL);
  ddp__kv_init(&f->table, 0);
  size_t alen = strlen(path) + 8;
  char *address = ddp_alloc(alen);
  f->path = ddp_strdup(path);
  ddp_status st;
  if (!address || !f->path) {
    st = ddp_error(DDP_ERR_NOMEM, "out of memory");
    goto err;
  }
  snprintf(address, alen, "file://%s", path);
  st = ddp__store_init(&f->base, &file_ops, options, address);
  if (st != DDP_OK) goto err;
  f->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    st = ddp_error(errno == ENOENT || errno == EACCES ? DDP_ERR_INVALID : DDP_ERR_IO,
                   "store %s: cannot open: %s", address, strerror(errno));
    goto err;
  }
  st = lock_file(f, ddp_time_ns() + ddp_store_timeout_ms(&f->base) * 1000000LL);
  if (st == DDP_OK) {
    st = init_file(f);
    unlock_file(f);
  }
  if (st != DDP_OK) {
    st = ddp_error_wrap(st, "store %s", address);
    goto err;
  }
  ddp_free(address);
  *out = &f->base;
  return DDP_OK;
err:
  ddp_free(address);
  file_destroy(&f->base);
  return st;
}
