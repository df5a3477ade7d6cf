/* Elastic membership (--nnodes MIN:MAX, --rdzv-backend c10d), torchrun's
 * dynamic rendezvous in the job's store: the nodes meet in numbered rounds,
 * each round a fresh group of MIN..MAX nodes with its own world.
 *
 * Round k closes when MAX nodes have arrived, or when at least MIN have and
 * last_call_s has passed since the last arrival (torchrun's last call: each
 * arrival restarts it, so a node that is a moment late still makes it). Nodes
 * are numbered by arrival (GROUP_RANK = slot). A node that arrives after the
 * close joins round k+1 at once; its arrival there is what the running nodes
 * watch for: a round of fewer than MAX nodes stops its workers for it (a
 * scale event, not counted against --max-restarts), and everyone meets in
 * round k+1. A failure (a worker's, or a node gone silent) is published in
 * round/k/failed; the surviving nodes go to round k+1, which closes without
 * the dead node after the last call, as long as MIN remain.
 *
 * Keys, under "ddprun/<run id>/":
 *   elastic              "MIN:MAX", by the first node: another is refused
 *   round/latest         the last round that closed (where a newcomer starts)
 *   round/<k>/arrivals   add()ed by each arriving node: its slot is count - 1
 *   round/<k>/node/<s>   "<nproc> <host>" of slot s
 *   round/<k>/closed     "<n> <restarts> [reason]": n nodes (slots 0..n-1),
 *                        the job's failures before this round; n = 0 ends
 *                        the job for every waiter (reason), n = -1 gave up
 *                        below MIN (later arrivals go on to round k+1)
 *   round/<k>/master     "<port> <addr>": MASTER_PORT, MASTER_ADDR, by slot 0
 *   round/<k>/beat/<s>   add()ed by slot s at every poll
 *   attempt/<k>/failed   the round's first failure (compare_set; the key of
 *                        the static agent, so the flight gather and the
 *                        announcement are shared)
 *   round/<k>/rescaled   set by a node that stopped for a scale event
 *   round/<k>/ended      add()ed by each node whose workers are gone
 * The workers' keys live under "attempt/<k>/" (DDP_STORE_PREFIX).
 *
 * Nothing here polls the store: a node waits on store watches (pushed
 * changes, docs/store.md). While a round is being formed it watches its
 * closed and arrivals keys; while the round runs, one watch (agent->
 * round_watch) on its failed, ended and rescaled keys, the next round's
 * arrivals and the other nodes' beats tells the monitor's poll hook what
 * changed, so each tick costs one write (this node's beat) and a read of
 * what the watch already received. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

/* How long one wait on the store lasts before the loop looks at the clock,
 * the signals and the arrivals again. */
#define SLICE_MS 100
#define BEAT_CHECK_S 0.5

static void rkey(char *buf, size_t bytes, int32_t round, const char *what) {
  snprintf(buf, bytes, "round/%d/%s", (int)round, what);
}

static void failed_key(char *buf, size_t bytes, int32_t round) {
  snprintf(buf, bytes, "attempt/%d/failed", (int)round);
}

static int exists(ddp__agent *a, const char *key, ddp_status *st) {
  const char *keys[] = {key};
  int yes = 0;
  *st = ddp_store_check(a->store, keys, 1, &yes);
  return *st == DDP_OK && yes;
}

/* A stopping signal (SIGINT, SIGTERM, SIGHUP) that arrived while waiting. */
static int stop_signal(void) {
  int sigs[16], n = ddp__signals_take(sigs, 16);
  for (int i = 0; i < n; i++)
    if (sigs[i] == SIGINT || sigs[i] == SIGTERM || sigs[i] == SIGHUP) return sigs[i];
  return 0;
}

typedef struct round_record {
  int32_t n;        /* nodes; 0: the job ended; -1: abandoned below MIN */
  int32_t restarts; /* failures of the job before this round */
  char reason[512];
} round_record;

static ddp_status read_closed(ddp__agent *a, int32_t round, round_record *rec) {
  char key[64];
  rkey(key, sizeof key, round, "closed");
  void *v = NULL;
  size_t bytes = 0;
  DDP_TRY(ddp_store_get(a->store, key, 0, &v, &bytes));
  int n = 0, restarts = 0, used = 0;
  ddp_status st = DDP_OK;
  if (sscanf(v, "%d %d %n", &n, &restarts, &used) < 2)
    st = ddp_error(DDP_ERR_FORMAT, "rendezvous %s: round %d's record \"%s\" is not \"<nodes> <restarts>\"",
                   a->world.run_id, (int)round, (char *)v);
  rec->n = n;
  rec->restarts = restarts;
  snprintf(rec->reason, sizeof rec->reason, "%s", used ? (char *)v + used : "");
  ddp_free(v);
  return st;
}

/* The job's failures before round k: those before round k-1, plus one when
 * round k-1 failed (a scale event's round did not). */
static ddp_status restarts_before(ddp__agent *a, int32_t round, int32_t *out) {
  *out = 0;
  if (round == 0) return DDP_OK;
  round_record prev;
  ddp_status st = read_closed(a, round - 1, &prev);
  if (st == DDP_ERR_TIMEOUT || st == DDP_ERR_NOTFOUND) {
    ddp_clear_error(); /* a round nobody closed: nothing ran in it */
    return DDP_OK;
  }
  DDP_TRY(st);
  char key[64];
  failed_key(key, sizeof key, round - 1);
  int failed = exists(a, key, &st);
  DDP_TRY(st);
  *out = prev.restarts + failed;
  return DDP_OK;
}

/* compare_set: the first close of a round stands. */
static ddp_status close_round(ddp__agent *a, int32_t round, int32_t n, const char *reason) {
  int32_t restarts;
  DDP_TRY(restarts_before(a, round, &restarts));
  char key[64], value[600];
  rkey(key, sizeof key, round, "closed");
  snprintf(value, sizeof value, "%d %d %s", (int)n, (int)restarts, reason ? reason : "");
  DDP_TRY(ddp_store_compare_set(a->store, key, "", 0, value, strlen(value), NULL, NULL));
  if (n > 0) {
    char latest[16];
    snprintf(latest, sizeof latest, "%d", (int)round);
    DDP_TRY(ddp_store_set(a->store, "round/latest", latest, strlen(latest)));
  }
  return DDP_OK;
}

/* Opens a watch on keys and reads their state now into values (absent:
 * data NULL). On DDP_ERR_UNSUPPORTED (a store without watches) the message
 * says that elastic rounds need the TCP store. */
static ddp_status open_watch(ddp__agent *a, const char *const *keys, size_t n, ddp_store_value *values,
                             ddp_store_watcher **out) {
  ddp_status st = ddp_store_watch_open(a->store, keys, n, values, out);
  if (st == DDP_ERR_UNSUPPORTED)
    return ddp_error_wrap(st, "rendezvous %s: elastic rounds need a store with watches (--rdzv-backend c10d)",
                          a->world.run_id);
  return st;
}

static int64_t value_int(const ddp_store_value *v) { return v->data ? atoll(v->data) : 0; }

/* Waits for round `round` to close, closing it when this node sees it full
 * or its last call over. Below MIN for --rdzv-timeout: an error saying so.
 * A watch on the round's closed and arrivals keys says when either changes;
 * the wait slices (SLICE_MS) only look at the clock and the signals. */
static ddp_status wait_close(ddp__agent *a, int32_t round, double deadline_s, round_record *rec) {
  char arrivals[64], closed[64];
  rkey(arrivals, sizeof arrivals, round, "arrivals");
  rkey(closed, sizeof closed, round, "closed");
  const char *keys[] = {closed, arrivals};
  ddp_store_value now_values[2];
  ddp_store_watcher *w = NULL;
  DDP_TRY(open_watch(a, keys, 2, now_values, &w));
  int is_closed = now_values[0].data != NULL;
  int64_t count = value_int(&now_values[1]);
  ddp_store_values_free(now_values, 2);
  double start = ddp_time_s(), changed = start;
  int64_t last = -1;
  ddp_status st = DDP_OK;
  while (!is_closed) {
    double now = ddp_time_s();
    if (count != last) {
      last = count;
      changed = now;
    }
    if (count >= a->elastic_max) {
      st = close_round(a, round, a->elastic_max, NULL);
    } else if (count >= a->elastic_min && now - changed >= a->last_call_s) {
      st = close_round(a, round, (int32_t)count, NULL);
    } else if (count < a->elastic_min && now - start >= a->rdzv_timeout_s) {
      char why[300];
      snprintf(why, sizeof why, "round %d had %lld of at least %d nodes after the join timeout (%g s)",
               (int)round, (long long)count, (int)a->elastic_min, a->rdzv_timeout_s);
      (void)close_round(a, round, -1, why); /* later arrivals go on to round k+1 */
      ddp_clear_error();
      st = ddp_error(DDP_ERR_TIMEOUT,
                     "rendezvous %s at %s: %s; node on %s gives up (are MIN nodes running ddprun with the "
                     "same --rdzv-id and endpoint? --nnodes %d:%d)",
                     a->world.run_id, a->world.store_addr, why, a->host, (int)a->elastic_min,
                     (int)a->elastic_max);
    }
    if (st) break;
    int sig = stop_signal();
    if (sig) {
      a->stop_signal = sig;
      st = ddp_error(DDP_ERR_ABORTED, "node on %s: stopped by signal %d while waiting for round %d to close",
                     a->host, sig, (int)round);
      break;
    }
    if (deadline_s > 0 && now > deadline_s) {
      st = ddp_error(DDP_ERR_TIMEOUT, "node on %s: the job timeout passed while waiting for round %d", a->host,
                     (int)round);
      break;
    }
    ddp_store_event ev;
    st = ddp_store_watch_next(w, SLICE_MS, &ev);
    if (st == DDP_ERR_TIMEOUT) {
      ddp_clear_error();
      st = DDP_OK;
    } else if (st == DDP_ERR_RANGE) {
      /* Fell behind (it cannot, reading every slice; but if it did): a new
       * watch's snapshot tells the state again. */
      ddp_clear_error();
      ddp_store_watch_close(w);
      w = NULL;
      st = open_watch(a, keys, 2, now_values, &w);
      if (st) break;
      is_closed = now_values[0].data != NULL;
      count = value_int(&now_values[1]);
      ddp_store_values_free(now_values, 2);
    } else if (st) {
      break;
    } else if (!strcmp(ev.key, closed)) {
      is_closed = ev.kind == DDP_STORE_EVENT_SET;
    } else {
      count = ev.kind == DDP_STORE_EVENT_SET ? atoll(ev.value) : 0;
    }
  }
  ddp_store_watch_close(w);
  if (st) return st;
  return read_closed(a, round, rec);
}

/* The round's nodes: nproc and host of slots 0..n-1, then the world. */
static ddp_status learn_round(ddp__agent *a, int32_t round, int32_t n) {
  ddp__world *w = &a->world;
  char (*names)[48] = ddp_calloc((size_t)n, sizeof *names);
  const char **keys = ddp_calloc((size_t)n, sizeof *keys);
  ddp_store_value *values = ddp_calloc((size_t)n, sizeof *values);
  ddp_status s = DDP_OK;
  if (!names || !keys || !values) {
    s = ddp_error(DDP_ERR_NOMEM, "launch: out of memory for %d nodes", (int)n);
    goto out;
  }
  for (int32_t i = 0; i < n; i++) {
    char what[16];
    snprintf(what, sizeof what, "node/%d", (int)i);
    rkey(names[i], sizeof names[i], round, what);
    keys[i] = names[i];
  }
  /* Every slot below n published before it could be counted (add, then
   * set): the wait is for a node between the two. */
  s = ddp_store_multi_get(a->store, keys, (size_t)n, (int64_t)(a->rdzv_timeout_s * 1000.0), values);
  if (s) {
    s = ddp_error_wrap(s, "rendezvous %s: round %d's %d nodes did not all describe themselves", w->run_id,
                       (int)round, (int)n);
    goto out;
  }
  w->world_size = 0;
  for (int32_t i = 0; i < n; i++) {
    int nproc = 0, used = 0;
    if (sscanf(values[i].data, "%d %n", &nproc, &used) != 1 || nproc < 1) {
      s = ddp_error(DDP_ERR_FORMAT, "rendezvous %s: round %d's node %d published \"%s\"", w->run_id, (int)round,
                    (int)i, (const char *)values[i].data);
      goto out;
    }
    snprintf(a->node_hosts[i], sizeof a->node_hosts[i], "%s", (const char *)values[i].data + used);
    if (i == w->node_rank) w->rank_offset = w->world_size;
    w->world_size += nproc;
  }
out:
  if (values) ddp_store_values_free(values, (size_t)n);
  ddp_free(values);
  ddp_free(keys);
  ddp_free(names);
  return s;
}

/* MASTER_ADDR / MASTER_PORT of the round, chosen by its slot 0: a free port
 * of its host, and its address as its --master-addr gives it (torchrun's
 * --local-addr; whichever node is slot 0 this round), else its host name. */
static ddp_status round_master(ddp__agent *a, int32_t round) {
  ddp__world *w = &a->world;
  char key[64];
  rkey(key, sizeof key, round, "master");
  if (w->node_rank == 0) {
    int32_t port;
    DDP_TRY(ddp__free_port("0.0.0.0", &port));
    char value[DDP_LAUNCH_HOST_BYTES + 16];
    snprintf(value, sizeof value, "%d %s", (int)port, a->node_addr[0] ? a->node_addr : a->host);
    DDP_TRY(ddp_store_set(a->store, key, value, strlen(value)));
  }
  void *v = NULL;
  size_t bytes = 0;
  DDP_TRY(ddp_store_get(a->store, key, (int64_t)(a->rdzv_timeout_s * 1000.0), &v, &bytes));
  int port = 0, used = 0;
  ddp_status s = DDP_OK;
  if (sscanf(v, "%d %n", &port, &used) != 1 || used == 0 || strlen((char *)v + used) >= sizeof w->master_addr)
    s = ddp_error(DDP_ERR_FORMAT, "rendezvous %s: round %d's master \"%s\"", w->run_id, (int)round, (char *)v);
  else {
    w->master_port = port;
    snprintf(w->master_addr, sizeof w->master_addr, "%s", (char *)v + used);
  }
  ddp_free(v);
  return s;
}

/* The first node fixes MIN:MAX for the run id; a node with others is refused. */
static ddp_status check_bounds(ddp__agent *a) {
  char mine[32];
  snprintf(mine, sizeof mine, "%d:%d", (int)a->elastic_min, (int)a->elastic_max);
  void *v = NULL;
  size_t bytes = 0;
  DDP_TRY(ddp_store_compare_set(a->store, "elastic", "", 0, mine, strlen(mine), &v, &bytes));
  ddp_status s = DDP_OK;
  if (bytes != strlen(mine) || memcmp(v, mine, bytes) != 0)
    s = ddp_error(DDP_ERR_INVALID,
                  "rendezvous %s at %s: this node (%s) has --nnodes %s, but the job's nodes have %.*s; give every "
                  "node the same --nnodes (or another --rdzv-id for another job)",
                  a->world.run_id, a->world.store_addr, a->host, mine, (int)bytes, (char *)v);
  ddp_free(v);
  return s;
}

/* ---- The running round's watch ------------------------------------------- */

/* Takes one change (or a key's state in a snapshot) into what the agent
 * knows of the running round. */
static void note(ddp__agent *a, const char *key, const ddp_store_value *value) {
  char k[64];
  int set = value->data != NULL;
  failed_key(k, sizeof k, a->attempt);
  if (!strcmp(key, k)) {
    a->watch_failed |= set;
    return;
  }
  rkey(k, sizeof k, a->attempt + 1, "arrivals");
  if (!strcmp(key, k)) {
    a->watch_arrived |= set;
    return;
  }
  rkey(k, sizeof k, a->attempt, "ended");
  if (!strcmp(key, k)) {
    a->watch_ended = value_int(value);
    return;
  }
  rkey(k, sizeof k, a->attempt, "rescaled");
  if (!strcmp(key, k)) {
    a->watch_rescaled |= set;
    return;
  }
  rkey(k, sizeof k, a->attempt, "beat/");
  size_t len = strlen(k);
  if (!strncmp(key, k, len)) {
    int slot = atoi(key + len);
    if (slot >= 0 && slot < a->world.nnodes) {
      a->beats[slot] = value_int(value);
      a->beat_seen_s[slot] = ddp_time_s();
    }
  }
}

/* (Re)opens the watch on the running round's keys; its snapshot is the
 * starting state, and every node's silence is counted from now. */
static ddp_status watch_round(ddp__agent *a) {
  ddp_store_watch_close(a->round_watch);
  a->round_watch = NULL;
  a->watch_failed = a->watch_arrived = a->watch_rescaled = 0;
  a->watch_ended = 0;
  int32_t n = a->world.nnodes;
  size_t cap = (size_t)n + 4;
  char (*names)[64] = ddp_calloc(cap, sizeof *names);
  const char **keys = ddp_calloc(cap, sizeof *keys);
  ddp_store_value *values = ddp_calloc(cap, sizeof *values);
  ddp_status st = DDP_OK;
  if (!names || !keys || !values) {
    st = ddp_error(DDP_ERR_NOMEM, "launch: out of memory for a watch of %d nodes", (int)n);
    goto out;
  }
  size_t k = 0;
  failed_key(names[k++], sizeof names[0], a->attempt);
  rkey(names[k++], sizeof names[0], a->attempt + 1, "arrivals");
  rkey(names[k++], sizeof names[0], a->attempt, "ended");
  rkey(names[k++], sizeof names[0], a->attempt, "rescaled");
  for (int32_t r = 0; r < n; r++) {
    if (r == a->world.node_rank) continue; /* our own beats tell us nothing */
    char what[24];
    snprintf(what, sizeof what, "beat/%d", (int)r);
    rkey(names[k++], sizeof names[0], a->attempt, what);
  }
  for (size_t i = 0; i < k; i++) keys[i] = names[i];
  st = open_watch(a, keys, k, values, &a->round_watch);
  if (st) goto out;
  for (size_t i = 0; i < k; i++) note(a, keys[i], &values[i]);
  double now = ddp_time_s();
  for (int32_t r = 0; r < n; r++) a->beat_seen_s[r] = now;
  ddp_store_values_free(values, k);
out:
  ddp_free(values);
  ddp_free(keys);
  ddp_free(names);
  return st;
}

/* Takes the round watch's changes: those that arrive within timeout_ms (0:
 * those already here), returning after the first batch. */
static ddp_status drain(ddp__agent *a, int64_t timeout_ms) {
  if (!a->round_watch) return ddp_error(DDP_ERR_STATE, "node on %s: no round watch", a->host);
  for (;;) {
    ddp_store_event ev;
    ddp_status st = ddp_store_watch_next(a->round_watch, timeout_ms, &ev);
    if (st == DDP_ERR_TIMEOUT) {
      ddp_clear_error();
      return DDP_OK;
    }
    if (st == DDP_ERR_RANGE) { /* fell behind its bound: a fresh snapshot */
      ddp_clear_error();
      return watch_round(a);
    }
    DDP_TRY(st);
    ddp_store_value v = {ev.kind == DDP_STORE_EVENT_SET ? (void *)ev.value : NULL, ev.value_bytes};
    note(a, ev.key, &v);
    timeout_ms = 0;
  }
}

ddp_status ddp__elastic_join(ddp__agent *a, int32_t round, double deadline_s) {
  ddp__world *w = &a->world;
  if (round == 0) DDP_TRY(check_bounds(a));
  /* A newcomer starts at the last round that closed, not at 0. */
  void *v = NULL;
  size_t bytes = 0;
  ddp_status st = ddp_store_get(a->store, "round/latest", 0, &v, &bytes);
  if (st == DDP_OK) {
    int latest = atoi(v);
    if (latest > round) round = latest;
  } else if (st == DDP_ERR_TIMEOUT || st == DDP_ERR_NOTFOUND) {
    ddp_clear_error();
  } else {
    return st;
  }
  ddp_free(v);
  round_record rec;
  int64_t count;
  for (;; round++) {
    char key[64], mine[DDP_LAUNCH_HOST_BYTES + 32];
    rkey(key, sizeof key, round, "arrivals");
    DDP_TRY(ddp_store_add(a->store, key, 1, &count));
    char what[32];
    snprintf(what, sizeof what, "node/%lld", (long long)(count - 1));
    rkey(key, sizeof key, round, what);
    snprintf(mine, sizeof mine, "%d %s", (int)w->nproc, a->host);
    DDP_TRY(ddp_store_set(a->store, key, mine, strlen(mine)));
    DDP_TRY(wait_close(a, round, deadline_s, &rec));
    if (rec.n == 0)
      return ddp_error(DDP_ERR_ABORTED,
                       "rendezvous %s at %s: node on %s waited in round %d, but the job ended: %s (a --rdzv-id "
                       "names one job; start another with a new one)",
                       w->run_id, w->store_addr, a->host, (int)round, rec.reason);
    if (count <= rec.n) break;
    if (rec.n < 0)
      fprintf(stderr, "ddprun: node on %s: round %d gave up (%s): trying round %d\n", a->host, (int)round,
              rec.reason, (int)round + 1);
    else
      fprintf(stderr, "ddprun: node on %s arrived at round %d after it closed (%d nodes): waiting for round %d\n",
              a->host, (int)round, (int)rec.n, (int)round + 1);
  }
  w->node_rank = (int32_t)(count - 1);
  w->nnodes = rec.n;
  w->restarts = rec.restarts;
  a->attempt = round;
  a->scale_event = 0;
  a->remote_failure[0] = '\0';
  a->read_outcome = 0;
  memset(a->beats, 0, (size_t)a->elastic_max * sizeof *a->beats);
  memset(a->beat_seen_s, 0, (size_t)a->elastic_max * sizeof *a->beat_seen_s);
  a->next_beat_check_s = ddp_time_s() + BEAT_CHECK_S;
  DDP_TRY(learn_round(a, round, rec.n));
  DDP_TRY(round_master(a, round));
  return watch_round(a);
}

static ddp_status beat(ddp__agent *a) {
  char key[64], what[24];
  snprintf(what, sizeof what, "beat/%d", (int)a->world.node_rank);
  rkey(key, sizeof key, a->attempt, what);
  return ddp_store_add(a->store, key, 1, NULL);
}

/* A node of the round whose beat count has not moved (no change on the
 * round watch) for silence_limit_s: its slot, or -1. */
static ddp_status silent_node(ddp__agent *a, int32_t *slot, double *silent_s) {
  *slot = -1;
  DDP_TRY(drain(a, 0));
  double now = ddp_time_s();
  for (int32_t r = 0; r < a->world.nnodes; r++) {
    if (r == a->world.node_rank) continue;
    if (now - a->beat_seen_s[r] > a->silence_limit_s) {
      *slot = r;
      *silent_s = now - a->beat_seen_s[r];
      return DDP_OK;
    }
  }
  return DDP_OK;
}

/* Reads the others' beats every BEAT_CHECK_S; a silent one is announced as
 * the round's failure. 1 when it did. */
static int check_silence(ddp__agent *a) {
  double now = ddp_time_s();
  if (now < a->next_beat_check_s) return 0;
  a->next_beat_check_s = now + BEAT_CHECK_S;
  int32_t slot;
  double silent = 0;
  if (silent_node(a, &slot, &silent) != DDP_OK) return -1;
  if (slot < 0) return 0;
  char failure[256];
  snprintf(failure, sizeof failure,
           "node %d (%s) has been silent for %.1f s (keep-alive limit %g s): its ddprun died or hangs", (int)slot,
           a->node_hosts[slot], silent, a->silence_limit_s);
  ddp__agent_announce_failure(a, a->attempt, failure);
  return 1;
}

int ddp__elastic_poll(void *ctx) {
  ddp__agent *a = ctx;
  if (beat(a) != DDP_OK || drain(a, 0) != DDP_OK) return -1;
  if (a->watch_failed) return 1;
  int silent = check_silence(a);
  if (silent) return silent;
  if (a->world.nnodes < a->elastic_max && a->watch_arrived) {
    /* Said before the workers stop: the other nodes' workers will fail
     * on ours, and must take that for the scale event, not a failure. */
    char rescaled[64];
    rkey(rescaled, sizeof rescaled, a->attempt, "rescaled");
    if (ddp_store_set(a->store, rescaled, "1", 1) != DDP_OK) return -1;
    a->scale_event = 1;
    return 1;
  }
  return 0;
}

int ddp__elastic_rescaling(ddp__agent *a, int32_t round) {
  char key[64];
  rkey(key, sizeof key, round, "rescaled");
  ddp_status st;
  int yes = exists(a, key, &st);
  if (st) ddp_clear_error();
  return yes;
}

void ddp__elastic_leave(ddp__agent *a, int32_t round, int rescaled) {
  char key[64];
  if (rescaled) {
    rkey(key, sizeof key, round, "rescaled");
    if (ddp_store_set(a->store, key, "1", 1) != DDP_OK) ddp_clear_error();
  }
  rkey(key, sizeof key, round, "ended");
  if (ddp_store_add(a->store, key, 1, NULL) != DDP_OK) ddp_clear_error(); /* the next join reports a lost store */
}

void ddp__elastic_abort(ddp__agent *a, int32_t round, const char *reason) {
  if (close_round(a, round, 0, reason) != DDP_OK) ddp_clear_error();
}

ddp_status ddp__elastic_finish(ddp__agent *a, int32_t round, double deadline_s, int *outcome) {
  char ended[64], failed[64];
  rkey(ended, sizeof ended, round, "ended");
  failed_key(failed, sizeof failed, round);
  *outcome = 0;
  if (round != a->attempt || !a->round_watch)
    return ddp_error(DDP_ERR_STATE, "node on %s: finishing round %d, but the watch is on round %d", a->host,
                     (int)round, (int)a->attempt);
  int64_t count;
  DDP_TRY(ddp_store_add(a->store, ended, 1, &count));
  if (count > a->watch_ended) a->watch_ended = count;
  for (;;) {
    if (a->watch_failed) {
      void *v = NULL;
      size_t bytes = 0;
      if (ddp_store_get(a->store, failed, 0, &v, &bytes) == DDP_OK) {
        snprintf(a->remote_failure, sizeof a->remote_failure, "%s", (char *)v);
        ddp_free(v);
      } else {
        ddp_clear_error();
      }
      *outcome = 1;
      return DDP_OK;
    }
    if (a->watch_ended >= a->world.nnodes) {
      /* A node that stopped for a scale event marked the round before it
       * ended it, so the watch reported the mark first. */
      *outcome = a->watch_rescaled ? 2 : 0;
      break;
    }
    DDP_TRY(beat(a));
    int silent = check_silence(a);
    if (silent < 0) return ddp_error(DDP_ERR_CLOSED, "node on %s lost the job's store at %s", a->host,
                                     a->world.store_addr);
    int sig = stop_signal();
    if (sig) {
      a->stop_signal = sig;
      return ddp_error(DDP_ERR_ABORTED, "node on %s: stopped by signal %d while waiting for the other nodes",
                       a->host, sig);
    }
    if (deadline_s > 0 && ddp_time_s() > deadline_s)
      return ddp_error(DDP_ERR_TIMEOUT, "node on %s: the job timeout passed while waiting for the other nodes",
                       a->host);
    DDP_TRY(drain(a, SLICE_MS));
  }
  if (*outcome == 0) {
    /* The job is done: the node hosting the store lingers until every node
     * has read that (ddp__agent_close, attempt/<k>/read). */
    char read[64];
    snprintf(read, sizeof read, "attempt/%d/read", (int)round);
    DDP_TRY(ddp_store_add(a->store, read, 1, NULL));
    a->read_outcome = 1;
  }
  return DDP_OK;
}
