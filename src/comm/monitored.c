/* The monitored barrier (torch.distributed.monitored_barrier): through the
 * group's store rather than the backend, so that it can say which ranks did
 * not arrive. Rank 0 waits for every rank's arrival key with the timeout,
 * then releases the others (or tells them why it failed); the others wait
 * for that release with the same timeout.
 *   mb/<n>/<rank>    arrival of rank at the group's n-th monitored barrier
 *   mb/<n>/release   "ok", or the failure rank 0 reports */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "comm/comm_internal.h"
#include "core/core_internal.h"

#define MAX_LISTED_RANKS 16

static int64_t ms_until(int64_t deadline_ns) {
  int64_t left = (deadline_ns - ddp_time_ns()) / 1000000;
  return left > 0 ? left : 0;
}

static bool key_exists(ddp_store *store, const char *key) {
  const char *keys[1] = {key};
  int exists = 0;
  return ddp_store_check(store, keys, 1, &exists) == DDP_OK && exists;
}

/* Rank 0: waits for the others; returns DDP_OK or the error naming them. */
static ddp_status wait_arrivals(ddp_process_group *pg, uint64_t n, double timeout_s,
                                int64_t deadline, bool wait_all) {
  int32_t *missing = ddp_calloc((size_t)pg->size, sizeof *missing);
  if (!missing) return ddp_error(DDP_ERR_NOMEM, "monitored barrier: out of memory");
  int32_t num_missing = 0;
  ddp_status st = DDP_OK;
  for (int r = 1; r < pg->size; r++) {
    char key[64];
    snprintf(key, sizeof key, "mb/%" PRIu64 "/%d", n, r);
    const char *keys[1] = {key};
    ddp_status w = num_missing ? (key_exists(pg->store, key) ? DDP_OK : DDP_ERR_TIMEOUT)
                               : ddp_store_wait(pg->store, keys, 1, ms_until(deadline));
    if (w == DDP_ERR_TIMEOUT) {
      missing[num_missing++] = r;
      if (!wait_all) break;
    } else if (w != DDP_OK) {
      st = ddp_error_wrap(w, "monitored barrier #%" PRIu64, n);
      break;
    }
  }
  if (st == DDP_OK && num_missing) {
    char list[512];
    ddp__format_ranks(missing, num_missing, MAX_LISTED_RANKS, list, sizeof list);
    st = ddp_error(DDP_ERR_TIMEOUT, "monitored barrier: %s %s did not arrive within %.3g s",
                   num_missing == 1 ? "rank" : "ranks", list, timeout_s);
  }
  ddp_free(missing);
  return st;
}

ddp_status ddp_monitored_barrier(ddp_process_group *pg, double timeout_s, bool wait_all) {
  if (!pg) return ddp_error(DDP_ERR_INVALID, "monitored_barrier: process group is NULL");
  DDP_TRY(ddp__group_check(pg));
  if (timeout_s <= 0) timeout_s = (double)pg->timeout_ns / 1e9;
  int64_t timeout_ns = timeout_s > 9e9 ? INT64_MAX / 4 : (int64_t)(timeout_s * 1e9);
  /* Ordered after what this rank already submitted. */
  DDP_TRY(ddp__queue_drain(pg));
  pthread_mutex_lock(&pg->mu);
  uint64_t n = ++pg->monitored_barriers;
  pthread_mutex_unlock(&pg->mu);
  int64_t deadline = ddp__deadline_after(timeout_ns);
  char key[64], release[64];
  snprintf(key, sizeof key, "mb/%" PRIu64 "/%d", n, pg->rank);
  snprintf(release, sizeof release, "mb/%" PRIu64 "/release", n);
  if (n > 1) { /* the previous barrier's keys have been read by now */
    char old[64];
    snprintf(old, sizeof old, "mb/%" PRIu64 "/%d", n - 1, pg->rank);
    ddp_store_delete(pg->store, old, NULL);
  }
  ddp_status st;
  if (pg->rank == 0) {
    st = wait_arrivals(pg, n, timeout_s, deadline, wait_all);
    char why[1100];
    int len = st == DDP_OK ? snprintf(why, sizeof why, "ok")
                           : snprintf(why, sizeof why, "%s", ddp_last_error());
    ddp_status rs = ddp_store_set(pg->store, release, why, (size_t)len);
    if (st == DDP_OK && rs != DDP_OK) st = ddp_error_wrap(rs, "monitored barrier #%" PRIu64, n);
    if (st != DDP_OK) ddp_error(st, "%s", why); /* restore the message */
    if (n > 1) {
      char old[64];
      snprintf(old, sizeof old, "mb/%" PRIu64 "/release", n - 1);
      ddp_store_delete(pg->store, old, NULL);
    }
    return st;
  }
  st = ddp_store_set(pg->store, key, "1", 1);
  if (st != DDP_OK) return ddp_error_wrap(st, "monitored barrier #%" PRIu64, n);
  void *value = NULL;
  size_t bytes = 0;
  /* Rank 0 answers by its deadline; a little slack for it to write. */
  st = ddp_store_get(pg->store, release, ms_until(deadline) + 2000, &value, &bytes);
  if (st == DDP_ERR_TIMEOUT)
    return ddp_error(DDP_ERR_TIMEOUT, "monitored barrier: rank 0 did not release rank %d within %.3g s (rank 0 may be the one missing)",
                     pg->rank, timeout_s);
  if (st != DDP_OK) return ddp_error_wrap(st, "monitored barrier #%" PRIu64, n);
  if (bytes == 2 && memcmp(value, "ok", 2) == 0) {
    ddp_free(value);
    return DDP_OK;
  }
  st = ddp_error(DDP_ERR_TIMEOUT, "%s (reported by rank 0)", (const char *)value);
  ddp_free(value);
  return st;
}
