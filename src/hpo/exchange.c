/* How the workers tell each other what they evaluated, which migrants go
 * where and what to deactivate: through the job's store. Worker w's
 * messages are keys "hpo/r/<w>/<seq>" and their count is "hpo/n/<w>"; a
 * flush sets new messages and the count in one atomic multi_set, and a
 * poll reads every other worker's count in one multi_get and then the
 * messages it has not seen in another (every worker reads every worker's
 * messages and keeps those for its island: simple, and cheap for the tens
 * of workers of a node; a job of hundreds would want a log per island).
 * Nobody waits for anybody: a worker takes in whatever has arrived when it
 * looks, as Propulate's workers do with MPI's iprobe. Works across hosts
 * (the store is TCP); a poll costs two round trips, and the caller spaces
 * exchanges out (ddp_hpo_options.exchange_interval_s). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpo/hpo_internal.h"

/* A message: magic, kind, traits, the island it concerns, the individual
 * (generation, birth worker and island, current, migration steps, active,
 * loss, start, end, values). */
#define RECORD_MAGIC 0x32504844u /* "DHP2" */
enum { RECORD_HEAD = 4 * 4 + 8 + 4 * 5 + 8 * 3 };

size_t ddp__hpo_record_bytes(int traits) { return RECORD_HEAD + 8 * (size_t)traits; }
static size_t record_bytes(int traits) { return ddp__hpo_record_bytes(traits); }

static void put(unsigned char **p, const void *v, size_t n) {
  memcpy(*p, v, n); /* x86-64 and every host ddp runs on are little-endian */
  *p += n;
}
static void take(const unsigned char **p, void *v, size_t n) {
  memcpy(v, *p, n);
  *p += n;
}

void ddp__hpo_record_encode(const ddp__hpo_message *m, int traits, unsigned char *out) {
  unsigned char *p = out;
  const ddp_hpo_individual *ind = &m->ind;
  uint32_t head[4] = {RECORD_MAGIC, (uint32_t)m->kind, (uint32_t)traits, (uint32_t)m->island};
  int32_t fields[5] = {ind->worker, ind->island, ind->current, ind->migration_steps, ind->active};
  put(&p, head, sizeof head);
  put(&p, &ind->generation, 8);
  put(&p, fields, sizeof fields);
  put(&p, &ind->loss, 8);
  put(&p, &ind->start_s, 8);
  put(&p, &ind->end_s, 8);
  put(&p, ind->values, 8 * (size_t)traits);
}

ddp_status ddp__hpo_record_decode(const void *data, size_t bytes, int traits, const char *key,
                                  ddp__hpo_message *m) {
  if (bytes != record_bytes(traits))
    return ddp_error(DDP_ERR_FORMAT, "hpo exchange: store key %s holds %zu bytes, a message of %d "
                     "traits has %zu (another search's keys?)", key, bytes, traits,
                     record_bytes(traits));
  const unsigned char *p = data;
  uint32_t head[4];
  int32_t fields[5];
  take(&p, head, sizeof head);
  if (head[0] != RECORD_MAGIC || head[2] != (uint32_t)traits || head[1] < DDP__HPO_EVAL ||
      head[1] > DDP__HPO_DEACTIVATE)
    return ddp_error(DDP_ERR_FORMAT, "hpo exchange: store key %s is no message of this search "
                     "(magic %08x, kind %u, %u traits)", key, head[0], head[1], head[2]);
  ddp_hpo_individual *ind = &m->ind;
  m->kind = (int)head[1];
  m->island = (int)head[3];
  take(&p, &ind->generation, 8);
  take(&p, fields, sizeof fields);
  take(&p, &ind->loss, 8);
  take(&p, &ind->start_s, 8);
  take(&p, &ind->end_s, 8);
  take(&p, ind->values, 8 * (size_t)traits);
  ind->worker = fields[0];
  ind->island = fields[1];
  ind->current = fields[2];
  ind->migration_steps = fields[3];
  ind->active = fields[4] != 0;
  return DDP_OK;
}

struct ddp__hpo_exchange {
  ddp_store *store; /* the caller's: borrowed */
  int worker, n_workers, traits;
  int64_t sent, flushed; /* records handed in / in the store */
  int64_t *seen;         /* per peer: records taken in */
  unsigned char *pending; /* records not yet flushed, back to back */
  int64_t pending_cap;
  char **keys;           /* scratch for up to max(pending_cap, n_workers) + 1 keys */
  ddp_store_value *vals;
  int64_t scratch_keys;
};

static ddp_status grow_scratch(ddp__hpo_exchange *x, int64_t n) {
  if (n <= x->scratch_keys) return DDP_OK;
  char **keys =
      ddp_realloc(x->keys, (size_t)x->scratch_keys * sizeof *keys, (size_t)n * sizeof *keys);
  if (keys) x->keys = keys;
  ddp_store_value *vals =
      ddp_realloc(x->vals, (size_t)x->scratch_keys * sizeof *vals, (size_t)n * sizeof *vals);
  if (vals) x->vals = vals;
  if (!keys || !vals) return ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
  for (int64_t i = x->scratch_keys; i < n; i++) {
    x->keys[i] = ddp_alloc(64);
    if (!x->keys[i]) return ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
    x->scratch_keys = i + 1;
  }
  return DDP_OK;
}

void ddp__hpo_exchange_destroy(ddp__hpo_exchange *x) {
  if (!x) return;
  for (int64_t i = 0; i < x->scratch_keys; i++) ddp_free(x->keys[i]);
  ddp_free(x->keys);
  ddp_free(x->vals);
  ddp_free(x->seen);
  ddp_free(x->pending);
  ddp_free(x);
}

ddp_status ddp__hpo_exchange_create(ddp_store *store, int worker, int n_workers, int traits,
                                    int64_t max_pending, ddp__hpo_exchange **out) {
  *out = NULL;
  ddp__hpo_exchange *x = ddp_calloc(1, sizeof *x);
  if (!x) return ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
  x->store = store;
  x->worker = worker;
  x->n_workers = n_workers;
  x->traits = traits;
  x->pending_cap = max_pending;
  x->seen = ddp_calloc((size_t)n_workers, sizeof *x->seen);
  x->pending = ddp_alloc((size_t)max_pending * record_bytes(traits));
  ddp_status s = x->seen && x->pending ? grow_scratch(x, (max_pending > n_workers ? max_pending
                                                                                 : n_workers) + 1)
                                       : ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
  /* This worker's count exists from the start, so a peer's poll finds every
   * count (the caller's barrier comes after). */
  if (s == DDP_OK) {
    char key[64];
    snprintf(key, sizeof key, "hpo/n/%d", worker);
    s = ddp_store_set(store, key, "0", 1);
    if (s != DDP_OK) ddp_error_wrap(s, "hpo exchange: publishing worker %d's count", worker);
  }
  if (s != DDP_OK) {
    ddp__hpo_exchange_destroy(x);
    return s;
  }
  *out = x;
  return DDP_OK;
}

/* Queues without flushing (a poll's callback sends, and a flush would
 * reuse the scratch the poll is reading): the queue grows instead. */
ddp_status ddp__hpo_exchange_send(ddp__hpo_exchange *x, const ddp__hpo_message *m) {
  if (x->sent - x->flushed >= x->pending_cap) {
    int64_t cap = 2 * x->pending_cap;
    unsigned char *grown = ddp_realloc(x->pending, (size_t)x->pending_cap * record_bytes(x->traits),
                                       (size_t)cap * record_bytes(x->traits));
    if (!grown) return ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
    x->pending = grown;
    x->pending_cap = cap;
  }
  ddp__hpo_record_encode(m, x->traits,
                         x->pending + (size_t)(x->sent - x->flushed) * record_bytes(x->traits));
  x->sent++;
  return DDP_OK;
}

ddp_status ddp__hpo_exchange_flush(ddp__hpo_exchange *x) {
  int64_t n = x->sent - x->flushed;
  if (n == 0 || x->n_workers == 1) {
    x->flushed = x->sent;
    return DDP_OK;
  }
  const size_t rb = record_bytes(x->traits);
  char count[32];
  DDP_TRY(grow_scratch(x, n + 1));
  for (int64_t i = 0; i < n; i++) {
    snprintf(x->keys[i], 64, "hpo/r/%d/%" PRId64, x->worker, x->flushed + i);
    x->vals[i] = (ddp_store_value){x->pending + (size_t)i * rb, rb};
  }
  snprintf(x->keys[n], 64, "hpo/n/%d", x->worker);
  int w = snprintf(count, sizeof count, "%" PRId64, x->sent);
  x->vals[n] = (ddp_store_value){count, (size_t)w};
  ddp_status s = ddp_store_multi_set(x->store, (const char *const *)x->keys, x->vals, (size_t)n + 1);
  if (s != DDP_OK)
    return ddp_error_wrap(s, "hpo exchange: worker %d sending %" PRId64 " records", x->worker, n);
  x->flushed = x->sent;
  return DDP_OK;
}

/* Peer p's count from a store value (decimal text). */
static ddp_status parse_count(const ddp_store_value *v, const char *key, int64_t *out) {
  char buf[32];
  if (!v->data || v->bytes == 0 || v->bytes >= sizeof buf)
    return ddp_error(DDP_ERR_FORMAT, "hpo exchange: store key %s holds %zu bytes, no count", key,
                     v->bytes);
  memcpy(buf, v->data, v->bytes);
  buf[v->bytes] = '\0';
  char *end;
  long long n = strtoll(buf, &end, 10);
  if (*end || n < 0)
    return ddp_error(DDP_ERR_FORMAT, "hpo exchange: store key %s holds '%s', no count", key, buf);
  *out = n;
  return DDP_OK;
}

ddp_status ddp__hpo_exchange_poll(ddp__hpo_exchange *x, ddp__hpo_arrival fn, void *user,
                                  int64_t *received) {
  *received = 0;
  if (x->n_workers == 1) return DDP_OK;
  int peers = 0;
  for (int p = 0; p < x->n_workers; p++)
    if (p != x->worker) snprintf(x->keys[peers++], 64, "hpo/n/%d", p);
  ddp_status s = ddp_store_multi_get(x->store, (const char *const *)x->keys, (size_t)peers, 0,
                                     x->vals);
  if (s != DDP_OK) return ddp_error_wrap(s, "hpo exchange: reading the workers' counts");
  int64_t counts[1024];
  int64_t *count = peers <= 1024 ? counts : ddp_alloc((size_t)peers * sizeof *count);
  if (!count) s = ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
  for (int i = 0; s == DDP_OK && i < peers; i++) s = parse_count(&x->vals[i], x->keys[i], &count[i]);
  ddp_store_values_free(x->vals, (size_t)peers);
  ddp__hpo_message msg;
  double *values = ddp_alloc((size_t)x->traits * sizeof *values + 1);
  if (!values && s == DDP_OK) s = ddp_error(DDP_ERR_NOMEM, "hpo exchange: out of memory");
  for (int i = 0, p = 0; s == DDP_OK && i < peers; i++, p++) {
    if (p == x->worker) p++;
    int64_t from = x->seen[p], n = count[i] - from;
    if (n <= 0) continue;
    s = grow_scratch(x, n);
    for (int64_t k = 0; s == DDP_OK && k < n; k++)
      snprintf(x->keys[k], 64, "hpo/r/%d/%" PRId64, p, from + k);
    if (s == DDP_OK)
      s = ddp_store_multi_get(x->store, (const char *const *)x->keys, (size_t)n, 0, x->vals);
    if (s != DDP_OK) {
      ddp_error_wrap(s, "hpo exchange: reading worker %d's records %" PRId64 "..%" PRId64, p, from,
                     from + n - 1);
      break;
    }
    for (int64_t k = 0; s == DDP_OK && k < n; k++) {
      msg = (ddp__hpo_message){.ind = {.values = values}};
      s = ddp__hpo_record_decode(x->vals[k].data, x->vals[k].bytes, x->traits, x->keys[k], &msg);
      if (s == DDP_OK) s = fn(&msg, user);
    }
    ddp_store_values_free(x->vals, (size_t)n);
    if (s == DDP_OK) {
      x->seen[p] = count[i];
      *received += n;
    }
  }
  ddp_free(values);
  if (count != counts) ddp_free(count);
  return s;
}

int64_t ddp__hpo_exchange_seen(const ddp__hpo_exchange *x) {
  int64_t n = 0;
  for (int p = 0; p < x->n_workers; p++) n += x->seen[p];
  return n;
}
