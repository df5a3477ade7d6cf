/* The point-to-point lane: every send and receive of a group (batches,
 * isend/irecv, blocking send/recv) runs here, outside the queue of
 * collectives. Whoever drives the lane progresses every pending request at
 * once through the backend's p2p_progress, so a send and a receive to the
 * same neighbour move together, a large send does not hold up later ones,
 * and nothing waits behind a collective. Requests to this rank itself are
 * matched here.
 *
 * Who drives (leader/follower): a thread that waits for its batch (work
 * wait, blocking send/recv) drives the lane itself while nobody else does,
 * until its batch is finished, so a completion reaches it with no hand-off
 * between threads; a submit makes one pass without waiting when the lane is
 * free (a small send completes there). The group's lane thread (started by
 * the first point-to-point call) drives only while batches are pending and
 * nobody waits (isends without a waiter, a large tcp send moving in the
 * background) and lets go as soon as a caller waits. Whoever drives
 * enforces every batch's deadline and the group's abort.
 *
 * Batches travel with their work handles (comm_internal.h): a handle from
 * the group's pool keeps its request array, so a pipeline that posts the
 * same shapes every micro-batch allocates nothing after the first. Every
 * batch has a deadline (the group's timeout from its submission); a failure
 * fails the group, as a failed collective does. docs/comm.md, "Point to
 * point", has the design and the reasons. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/comm_internal.h"
#include "comm/flight/flight.h"

/* The longest a driver waits in the backend before it looks at the lane's
 * state again (new batches and waiting callers also wake it, through
 * p2p_wake): bounds how late a deadline or abort is seen. */
#define LANE_WAIT_NS (5 * 1000000LL)
/* Idle: how long the lane sleeps between checks of nothing. */
#define IDLE_WAIT_NS (1000 * 1000000LL)

static void cond_wait_ns(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ns) {
  int64_t at = ddp_time_ns() + ns;
  struct timespec ts = {(time_t)(at / 1000000000LL), (long)(at % 1000000000LL)};
  pthread_cond_timedwait(cv, mu, &ts);
}

ddp_status ddp__p2p_lane_init(ddp_process_group *pg) {
  pthread_condattr_t attr;
  if (pthread_condattr_init(&attr) != 0) return ddp_error(DDP_ERR_SYS, "process group: condattr");
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_mutex_init(&pg->p2p_mu, NULL);
  pthread_cond_init(&pg->p2p_cv, &attr);
  pthread_condattr_destroy(&attr);
  return DDP_OK;
}

/* "recv from rank 1 (tag 3, 4096 bytes; point-to-point #7)" */
static void describe_req(const ddp__p2p_req *r, const ddp__op_args *a, char *out, size_t cap) {
  snprintf(out, cap, "%s %s rank %d (tag %d, %zu bytes; point-to-point #%llu)",
           r->is_send ? "send" : "recv", r->is_send ? "to" : "from", r->peer, r->tag, r->bytes,
           (unsigned long long)a->seq);
}

/* ---- Finishing batches (driver) ------------------------------------------ */

static void batch_finish(ddp_process_group *pg, ddp__p2p_batch *bt, ddp_status st) {
  if (pg->flight) {
    int64_t now = ddp__now_coarse_ns();
    for (int i = 0; i < bt->n; i++)
      ddp__flight_end(pg->flight, &bt->args[i], bt->reqs[i].finished ? DDP_OK : st, now);
  }
  ddp_work *w = bt->work;
  /* done before the handle completes: once complete, an orphaned handle
   * may be recycled (bt reused) at once. */
  pthread_mutex_lock(&pg->p2p_mu);
  pg->p2p_outstanding--;
  bt->done = true;
  if (pg->p2p_waiters > 0) pthread_cond_broadcast(&pg->p2p_cv);
  pthread_mutex_unlock(&pg->p2p_mu);
  ddp__work_complete(pg, w, st);
}

/* Fails every batch the lane holds or has yet to take with the group's
 * sticky error (which the caller has recorded). */
static void fail_all(ddp_process_group *pg) {
  ddp_status st = ddp__group_check(pg);
  if (st == DDP_OK) st = DDP_ERR_ABORTED;
  pthread_mutex_lock(&pg->p2p_mu);
  ddp__p2p_batch *more = pg->p2p_head;
  pg->p2p_head = pg->p2p_tail = NULL;
  pthread_mutex_unlock(&pg->p2p_mu);
  for (int pass = 0; pass < 2; pass++) {
    ddp__p2p_batch *bt = pass == 0 ? pg->p2p_run : more;
    while (bt) {
      ddp__p2p_batch *next = bt->next;
      batch_finish(pg, bt, st);
      bt = next;
    }
  }
  pg->p2p_run = NULL;
}

/* Records `msg` as the group's failure and stops everything on the group,
 * as a failed collective does: the running collective is aborted, queued
 * ones and every pending batch fail with the message. */
static void lane_fail(ddp_process_group *pg, ddp_status st, const char *msg) {
  ddp__group_fail(pg, st, msg);
  atomic_store(&pg->aborted, true);
  if (pg->backend && pg->backend->ops->abort) pg->backend->ops->abort(pg->backend);
  ddp__queue_fail_all(pg);
  fail_all(pg);
}

/* ---- Progress (driver) ---------------------------------------------------- */

/* Matches sends to this rank with receives from it, each the oldest of its
 * tag (batches in submission order, requests in batch order). True when one
 * matched. A size mismatch fails the group. */
static bool match_self(ddp_process_group *pg, bool *failed) {
  bool any = false;
  for (ddp__p2p_batch *rb = pg->p2p_run; rb; rb = rb->next) {
    for (int i = 0; i < rb->n; i++) {
      ddp__p2p_req *r = &rb->reqs[i];
      if (r->finished || r->is_send || r->peer != pg->rank) continue;
      ddp__p2p_req *s = NULL;
      ddp__op_args *sa = NULL;
      for (ddp__p2p_batch *sb = pg->p2p_run; sb && !s; sb = sb->next)
        for (int j = 0; j < sb->n && !s; j++) {
          ddp__p2p_req *c = &sb->reqs[j];
          if (!c->finished && c->is_send && c->peer == pg->rank && c->tag == r->tag) {
            s = c;
            sa = &sb->args[j];
          }
        }
      if (!s) continue;
      if (s->bytes != r->bytes) {
        char d[160], msg[400];
        describe_req(r, &rb->args[i], d, sizeof d);
        snprintf(msg, sizeof msg, "%s (rank %d of %d): %s matched a send to itself of %zu bytes "
                 "(point-to-point #%llu)", rb->name, pg->rank, pg->size, d, s->bytes,
                 (unsigned long long)sa->seq);
        lane_fail(pg, DDP_ERR_INVALID, msg);
        *failed = true;
        return true;
      }
      if (r->bytes) memcpy(r->buf, s->buf, r->bytes);
      r->finished = s->finished = true;
      any = true;
    }
  }
  return any;
}

/* The pointers of every unfinished request to another rank, in submission
 * order, in pg->p2p_active (grown when more are in flight than ever). */
static int gather_active(ddp_process_group *pg, bool *nomem) {
  int k = 0;
  for (ddp__p2p_batch *bt = pg->p2p_run; bt; bt = bt->next)
    for (int i = 0; i < bt->n; i++)
      if (!bt->reqs[i].finished && bt->reqs[i].peer != pg->rank) k++;
  if (k > pg->p2p_active_cap) {
    int cap = k < DDP__P2P_FIRST_CAP ? DDP__P2P_FIRST_CAP : 2 * k;
    ddp__p2p_req **a = ddp_calloc((size_t)cap, sizeof *a);
    if (!a) {
      *nomem = true;
      return 0;
    }
    ddp_free(pg->p2p_active);
    pg->p2p_active = a;
    pg->p2p_active_cap = cap;
  }
  k = 0;
  for (ddp__p2p_batch *bt = pg->p2p_run; bt; bt = bt->next)
    for (int i = 0; i < bt->n; i++)
      if (!bt->reqs[i].finished && bt->reqs[i].peer != pg->rank) pg->p2p_active[k++] = &bt->reqs[i];
  return k;
}

/* The batch and index of request pointer r (for messages). */
static ddp__p2p_batch *owner_of(ddp_process_group *pg, const ddp__p2p_req *r, int *index) {
  for (ddp__p2p_batch *bt = pg->p2p_run; bt; bt = bt->next)
    if (r >= bt->reqs && r < bt->reqs + bt->n) {
      *index = (int)(r - bt->reqs);
      return bt;
    }
  return NULL;
}

/* One round: self matches, the backend's progress (waiting at most
 * max_wait_ns when nothing moved), completions and deadlines. Called by the
 * driver only. blocked: the driver is a caller waiting for its batch
 * (ddp__op_ctx.caller_blocked: the backend may spin before it sleeps). */
static void lane_step(ddp_process_group *pg, int64_t max_wait_ns, bool blocked) {
  if (atomic_load(&pg->failed) || atomic_load(&pg->aborted)) {
    if (!atomic_load(&pg->failed)) {
      char msg[128];
      snprintf(msg, sizeof msg, "process group (rank %d of %d) was aborted", pg->rank, pg->size);
      ddp__group_fail(pg, DDP_ERR_ABORTED, msg);
    }
    fail_all(pg);
    return;
  }
  bool failed = false;
  bool moved = match_self(pg, &failed);
  if (failed) return;
  bool nomem = false;
  int k = gather_active(pg, &nomem);
  if (nomem) {
    char msg[160];
    snprintf(msg, sizeof msg, "point-to-point (rank %d of %d): no memory to track the requests in flight",
             pg->rank, pg->size);
    lane_fail(pg, DDP_ERR_NOMEM, msg);
    return;
  }
  int64_t now = ddp_time_ns(), first_deadline = INT64_MAX;
  for (ddp__p2p_batch *bt = pg->p2p_run; bt; bt = bt->next)
    if (bt->deadline_ns < first_deadline) first_deadline = bt->deadline_ns;
  int64_t wait = moved ? 0 : max_wait_ns;
  if (first_deadline - now < wait) wait = first_deadline - now > 0 ? first_deadline - now : 0;
  if (k > 0) {
    ddp__op_ctx ctx = {
        .op = "point-to-point",
        .seq = 0,
        .deadline_ns = first_deadline,
        .aborted = &pg->aborted,
        .caller_blocked = blocked,
    };
    int culprit = -1;
    /* The lane carries host memory only: straight to the unwrapped backend. */
    ddp__backend *hb = pg->host_backend;
    ddp_status st = hb->ops->p2p_progress(hb, &ctx, pg->p2p_active, k, wait, &culprit);
    if (st != DDP_OK) {
      char why[600], d[160] = "", msg[1024];
      snprintf(why, sizeof why, "%s", ddp_last_error());
      int index = 0;
      ddp__p2p_batch *bt = culprit >= 0 ? owner_of(pg, pg->p2p_active[culprit], &index) : NULL;
      if (bt) {
        describe_req(&bt->reqs[index], &bt->args[index], d, sizeof d);
        snprintf(msg, sizeof msg, "%s (rank %d of %d): %s failed: %s", bt->name, pg->rank, pg->size, d, why);
      } else {
        snprintf(msg, sizeof msg, "point-to-point (rank %d of %d): %s", pg->rank, pg->size, why);
      }
      lane_fail(pg, st, msg);
      return;
    }
  } else if (!moved && pg->p2p_run && wait > 0) {
    /* Only requests to this rank, unmatched: a later batch may match them. */
    pthread_mutex_lock(&pg->p2p_mu);
    if (!pg->p2p_head) cond_wait_ns(&pg->p2p_cv, &pg->p2p_mu, wait);
    pthread_mutex_unlock(&pg->p2p_mu);
  }
  /* Completions, then deadlines. */
  now = ddp_time_ns();
  ddp__p2p_batch **link = &pg->p2p_run;
  while (*link) {
    ddp__p2p_batch *bt = *link;
    int left = 0, first = -1;
    for (int i = 0; i < bt->n; i++)
      if (!bt->reqs[i].finished) {
        left++;
        if (first < 0) first = i;
      }
    if (left == 0) {
      *link = bt->next;
      batch_finish(pg, bt, DDP_OK);
      continue;
    }
    if (now >= bt->deadline_ns) {
      char d[160], msg[512];
      describe_req(&bt->reqs[first], &bt->args[first], d, sizeof d);
      snprintf(msg, sizeof msg, "%s (rank %d of %d): %s did not complete within %.3g s (%d of the "
               "batch's %d operations pending; is the peer posting the matching operation?)",
               bt->name, pg->rank, pg->size, d, (double)pg->timeout_ns / 1e9, left, bt->n);
      lane_fail(pg, DDP_ERR_TIMEOUT, msg);
      return;
    }
    link = &bt->next;
  }
}

/* ---- Driving ----------------------------------------------------------------- */

/* Appends the submitted batches to the driver's list, keeping submission
 * order. Under p2p_mu, by the driver. */
static void take_new(ddp_process_group *pg) {
  if (!pg->p2p_head) return;
  ddp__p2p_batch **tail = &pg->p2p_run;
  while (*tail) tail = &(*tail)->next;
  *tail = pg->p2p_head;
  pg->p2p_head = pg->p2p_tail = NULL;
}

/* Lets go of the lane (under p2p_mu): a waiting caller takes it over, else
 * the lane thread when batches are left that nobody waits for. */
static void let_go(ddp_process_group *pg) {
  pg->p2p_driver = DDP__P2P_NOBODY;
  if (pg->p2p_waiters > 0 || pg->p2p_outstanding > 0) pthread_cond_broadcast(&pg->p2p_cv);
}

/* The lane thread: drives while batches are pending, nobody else drives and
 * no caller waits for the lane; lets go after every step (at most
 * LANE_WAIT_NS, cut short by a waiting caller's p2p_wake). */
static void *lane_main(void *arg) {
  ddp_process_group *pg = arg;
  pthread_mutex_lock(&pg->p2p_mu);
  for (;;) {
    while (!(pg->p2p_stopping && pg->p2p_outstanding == 0) &&
           (pg->p2p_outstanding == 0 || pg->p2p_driver != DDP__P2P_NOBODY || pg->p2p_waiters > 0))
      cond_wait_ns(&pg->p2p_cv, &pg->p2p_mu, IDLE_WAIT_NS);
    if (pg->p2p_stopping && pg->p2p_outstanding == 0) break;
    pg->p2p_driver = DDP__P2P_LANE;
    take_new(pg);
    pthread_mutex_unlock(&pg->p2p_mu);
    lane_step(pg, LANE_WAIT_NS, false);
    pthread_mutex_lock(&pg->p2p_mu);
    pg->p2p_driver = DDP__P2P_NOBODY;
    if (pg->p2p_waiters > 0) pthread_cond_broadcast(&pg->p2p_cv);
  }
  pthread_mutex_unlock(&pg->p2p_mu);
  return NULL;
}

/* Drives the lane from the calling thread until bt is done or deadline_ns
 * passes: takes the lane when nobody drives; when the lane thread drives,
 * wakes it out of its backend wait so that it lets go; when another caller
 * drives, waits for it (it progresses bt too) or for it to let go. */
static void drive_until(ddp_process_group *pg, ddp__p2p_batch *bt, int64_t deadline_ns) {
  pthread_mutex_lock(&pg->p2p_mu);
  while (!bt->done) {
    int64_t left = deadline_ns - ddp_time_ns();
    if (left <= 0) break;
    if (pg->p2p_driver == DDP__P2P_NOBODY) {
      pg->p2p_driver = DDP__P2P_CALLER;
      while (!bt->done) {
        take_new(pg);
        pthread_mutex_unlock(&pg->p2p_mu);
        left = deadline_ns - ddp_time_ns();
        if (left > 0) lane_step(pg, left < LANE_WAIT_NS ? left : LANE_WAIT_NS, true);
        pthread_mutex_lock(&pg->p2p_mu);
        if (left <= 0) break;
      }
      let_go(pg);
      break;
    }
    pg->p2p_waiters++;
    if (pg->p2p_driver == DDP__P2P_LANE) {
      /* Cut the lane thread's backend wait short; it lets go after it. */
      pthread_mutex_unlock(&pg->p2p_mu);
      if (pg->backend->ops->p2p_wake) pg->backend->ops->p2p_wake(pg->backend);
      pthread_mutex_lock(&pg->p2p_mu);
    }
    if (!bt->done && pg->p2p_driver != DDP__P2P_NOBODY)
      cond_wait_ns(&pg->p2p_cv, &pg->p2p_mu, left < LANE_WAIT_NS ? left : LANE_WAIT_NS);
    pg->p2p_waiters--;
  }
  pthread_mutex_unlock(&pg->p2p_mu);
}

void ddp__p2p_wait(ddp_work *w, int64_t deadline_ns) {
  ddp__p2p_batch *bt = w->batch;
  /* A pooled handle keeps its batch when it carries a collective later. */
  if (!bt || bt->work != w || (w->args.kind != DDP__OP_SEND && w->args.kind != DDP__OP_RECV))
    return;
  drive_until(w->pg, bt, deadline_ns);
}

void ddp__p2p_lane_wake(ddp_process_group *pg) {
  pthread_mutex_lock(&pg->p2p_mu);
  pthread_cond_broadcast(&pg->p2p_cv);
  pthread_mutex_unlock(&pg->p2p_mu);
  if (pg->backend && pg->backend->ops->p2p_wake) pg->backend->ops->p2p_wake(pg->backend);
}

void ddp__p2p_lane_destroy(ddp_process_group *pg) {
  /* Pending batches finish or fail by their deadlines; the lane exits once
   * none is left. */
  pthread_mutex_lock(&pg->p2p_mu);
  pg->p2p_stopping = true;
  bool started = pg->p2p_started;
  pthread_cond_broadcast(&pg->p2p_cv);
  pthread_mutex_unlock(&pg->p2p_mu);
  if (started) {
    if (pg->backend && pg->backend->ops->p2p_wake) pg->backend->ops->p2p_wake(pg->backend);
    pthread_join(pg->p2p_thread, NULL);
  }
  ddp_free(pg->p2p_active);
  pg->p2p_active = NULL;
  pg->p2p_active_cap = 0;
  pthread_cond_destroy(&pg->p2p_cv);
  pthread_mutex_destroy(&pg->p2p_mu);
}

/* ---- Submission ------------------------------------------------------------ */

/* Room for n requests in w's batch (grown, never shrunk). */
static ddp_status batch_room(ddp_work *w, int n) {
  ddp__p2p_batch *bt = w->batch;
  if (!bt) {
    bt = ddp_calloc(1, sizeof *bt);
    if (!bt) return DDP_ERR_NOMEM;
    w->batch = bt;
  }
  if (bt->cap >= n) return DDP_OK;
  int cap = n < 4 ? 4 : n;
  ddp__p2p_req *reqs = ddp_calloc((size_t)cap, sizeof *reqs);
  ddp__op_args *args = ddp_calloc((size_t)cap, sizeof *args);
  if (!reqs || !args) {
    ddp_free(reqs);
    ddp_free(args);
    return DDP_ERR_NOMEM;
  }
  ddp_free(bt->reqs);
  ddp_free(bt->args);
  bt->reqs = reqs;
  bt->args = args;
  bt->cap = cap;
  return DDP_OK;
}

ddp_status ddp__p2p_submit(ddp_process_group *pg, const char *name, const ddp_p2p_op *ops,
                           size_t n, ddp_work **work) {
  if (n > (size_t)1 << 24)
    return ddp_error(DDP_ERR_INVALID, "%s: %zu operations in one batch (at most %d)", name, n, 1 << 24);
  ddp_work *w = ddp__work_take(pg);
  if (!w) return DDP_ERR_NOMEM;
  if (batch_room(w, (int)n) != DDP_OK) {
    ddp__work_complete(pg, w, DDP_ERR_NOMEM);
    ddp_work_free(w);
    return ddp_error(DDP_ERR_NOMEM, "%s: no memory for %zu operations", name, n);
  }
  ddp__p2p_batch *bt = w->batch;
  bt->n = (int)n;
  bt->done = n == 0;
  bt->name = name;
  bt->work = w;
  bt->next = NULL;
  for (size_t i = 0; i < n; i++) {
    ddp__p2p_req *r = &bt->reqs[i];
    memset(r, 0, sizeof *r);
    r->is_send = ops[i].kind == DDP_P2P_SEND;
    r->buf = ops[i].buf;
    r->bytes = ops[i].count * ddp_dtype_size(ops[i].dtype);
    r->peer = ops[i].peer;
    r->tag = ops[i].tag;
    bt->args[i] = (ddp__op_args){
        .kind = r->is_send ? DDP__OP_SEND : DDP__OP_RECV,
        .send = r->is_send ? r->buf : NULL,
        .buf = r->is_send ? NULL : r->buf,
        .count = ops[i].count,
        .dtype = ops[i].dtype,
        .root = r->peer,
        .tag = r->tag,
    };
  }
  int64_t now = ddp__now_coarse_ns();
  bt->deadline_ns = ddp__deadline_from(ddp_time_ns(), pg->timeout_ns);
  /* The lane's records come beside the group's collectives, on any
   * thread: the owner's plain claims of record numbers end first
   * (flight.h; once per group, and a wait of a few instructions at most). */
  ddp_status st = pg->flight ? ddp__flight_share(pg->flight, pg->timeout_ns) : DDP_OK;
  pthread_mutex_lock(&pg->p2p_mu);
  /* Numbered and recorded under the lock: the numbers follow submission. */
  for (size_t i = 0; i < n && st == DDP_OK; i++) {
    bt->args[i].seq = ++pg->next_p2p_seq;
    if (pg->flight) ddp__flight_new(pg->flight, &bt->args[i], DDP__FLIGHT_STARTED, now);
  }
  if (n > 0) w->args = bt->args[0];
  if (st == DDP_OK && n > 0 && !pg->p2p_started) {
    int rc = pthread_create(&pg->p2p_thread, NULL, lane_main, pg);
    if (rc != 0) {
      st = ddp_error(DDP_ERR_SYS, "%s (rank %d of %d): cannot start the point-to-point thread: %s",
                     name, pg->rank, pg->size, strerror(rc));
    } else {
      char tname[16];
      snprintf(tname, sizeof tname, "ddp-p2p-r%d", pg->rank);
      pthread_setname_np(pg->p2p_thread, tname);
      pg->p2p_started = true;
    }
  }
  bool pass = false;
  if (st == DDP_OK && n > 0) {
    if (pg->p2p_tail)
      pg->p2p_tail->next = bt;
    else
      pg->p2p_head = bt;
    pg->p2p_tail = bt;
    pg->p2p_outstanding++;
    /* Async with the lane free: one pass here, without waiting (a small
     * send completes in it; a large one is posted). */
    if (work && pg->p2p_driver == DDP__P2P_NOBODY) {
      pg->p2p_driver = DDP__P2P_CALLER;
      take_new(pg);
      pass = true;
    }
  }
  pthread_mutex_unlock(&pg->p2p_mu);
  if (st != DDP_OK || n == 0) {
    if (pg->flight)
      for (size_t i = 0; i < n; i++) ddp__flight_end(pg->flight, &bt->args[i], st, now);
    ddp__work_complete(pg, w, st);
    if (!work || st != DDP_OK) {
      ddp_work_free(w);
      return st;
    }
    *work = w;
    return DDP_OK;
  }
  if (pass) {
    lane_step(pg, 0, false);
    pthread_mutex_lock(&pg->p2p_mu);
    let_go(pg); /* the lane thread takes over what is left */
    pthread_mutex_unlock(&pg->p2p_mu);
  } else if (work && pg->backend->ops->p2p_wake) {
    /* Someone drives: it takes the new batch once its backend wait ends. */
    pg->backend->ops->p2p_wake(pg->backend);
  }
  if (work) {
    *work = w;
    return DDP_OK;
  }
  /* Blocking: this thread drives until its batch is done, then collects the
   * status (ddp_work_wait's own bound applies past the batch's deadline). */
  st = ddp_work_wait(w, -1);
  ddp_work_free(w);
  return st;
}
