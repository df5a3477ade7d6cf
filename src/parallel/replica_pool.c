/* DataParallel's replica threads (replica_pool.h). One mutex and three
 * condition variables: jobs are a few per training step and each part is
 * milliseconds of compute, so a wake-up through the kernel (microseconds)
 * is not worth spinning for on a machine whose cores are all replicas. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "parallel/replica_pool.h"

#define POOL_ERR_BYTES 512

typedef struct replica_slot {
  ddp__replica_pool *pool;
  int index;
  int cpu;                    /* pinned to, or -1 */
  pthread_t thread;
  bool started;
  ddp_status status;          /* of its part of the current job */
  bool finished;              /* its part of the current job has returned */
  char err[POOL_ERR_BYTES];   /* its thread's last-error message then */
  double *sum_buf;            /* allreduce: what it posted */
  size_t sum_count;
  double *sum_scratch;        /* allreduce: its sum, before copying back */
} replica_slot;

struct ddp__replica_pool {
  int n;
  int64_t timeout_ms;
  size_t sum_doubles;
  pthread_mutex_t mu;
  pthread_cond_t work_cv, done_cv, barrier_cv;
  uint64_t job_gen;      /* bumped per job; a worker runs each generation once */
  int done;              /* parts of the current job finished */
  bool stop, broken, failed;
  ddp__replica_job job;
  void *ctx;
  int barrier_count;
  uint64_t barrier_gen;
  replica_slot *slots;
};

static struct timespec deadline_after(int64_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += (time_t)(ms / 1000);
  ts.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  return ts;
}

/* Runs one replica's part and records how it went; wakes everyone waiting
 * on a barrier when it failed, so nobody waits for it. */
static void run_part(ddp__replica_pool *p, replica_slot *s) {
  ddp_status st = p->job(p->ctx, s->index);
  if (st != DDP_OK) snprintf(s->err, sizeof s->err, "%s", ddp_last_error());
  pthread_mutex_lock(&p->mu);
  s->status = st;
  s->finished = true;
  if (st != DDP_OK) {
    p->failed = true;
    pthread_cond_broadcast(&p->barrier_cv);
  }
  p->done++;
  pthread_cond_broadcast(&p->done_cv);
  pthread_mutex_unlock(&p->mu);
}

static void *worker_main(void *arg) {
  replica_slot *s = arg;
  ddp__replica_pool *p = s->pool;
  if (s->cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(s->cpu, &set);
    /* Best effort: a failure leaves the thread where the kernel puts it. */
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    /* An idle replica waits for the next job as long as the wrapper lives;
     * the timed wait only rechecks, it gives up nothing. */
    while (!p->stop && p->job_gen == seen) {
      struct timespec ts = deadline_after(1000);
      pthread_cond_timedwait(&p->work_cv, &p->mu, &ts);
    }
    if (p->stop) break;
    seen = p->job_gen;
    pthread_mutex_unlock(&p->mu);
    run_part(p, s);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

static ddp_status init_sync(ddp__replica_pool *p) {
  pthread_condattr_t ca;
  if (pthread_condattr_init(&ca) != 0) return ddp_error(DDP_ERR_SYS, "DataParallel: condattr");
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->work_cv, &ca);
  pthread_cond_init(&p->done_cv, &ca);
  pthread_cond_init(&p->barrier_cv, &ca);
  pthread_condattr_destroy(&ca);
  return DDP_OK;
}

ddp_status ddp__replica_pool_create(ddp__replica_pool **out, int n, const int *cpus,
                                    int64_t timeout_ms, size_t sum_doubles) {
  *out = NULL;
  ddp__replica_pool *p = ddp_calloc(1, sizeof *p);
  if (!p) return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
  p->n = n;
  p->timeout_ms = timeout_ms;
  p->sum_doubles = sum_doubles;
  p->slots = ddp_calloc((size_t)n, sizeof *p->slots);
  if (!p->slots) {
    ddp_free(p);
    return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
  }
  ddp_status s = init_sync(p);
  if (s != DDP_OK) {
    ddp_free(p->slots);
    ddp_free(p);
    return s;
  }
  for (int r = 0; r < n; r++) {
    replica_slot *slot = &p->slots[r];
    slot->pool = p;
    slot->index = r;
    slot->cpu = r > 0 && cpus ? cpus[r] : -1;
    slot->sum_scratch = ddp_calloc(sum_doubles ? sum_doubles : 1, sizeof(double));
    if (!slot->sum_scratch) {
      ddp__replica_pool_destroy(p);
      return ddp_error(DDP_ERR_NOMEM, "DataParallel: out of memory");
    }
  }
  for (int r = 1; r < n; r++) {
    int e = pthread_create(&p->slots[r].thread, NULL, worker_main, &p->slots[r]);
    if (e != 0) {
      ddp__replica_pool_destroy(p);
      return ddp_error(DDP_ERR_SYS, "DataParallel: cannot start the thread of replica %d: %s", r,
                       strerror(e));
    }
    p->slots[r].started = true;
  }
  *out = p;
  return DDP_OK;
}

void ddp__replica_pool_destroy(ddp__replica_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->work_cv);
  pthread_cond_broadcast(&p->barrier_cv);
  pthread_mutex_unlock(&p->mu);
  bool all_joined = true;
  for (int r = 1; r < p->n; r++) {
    if (!p->slots[r].started) continue;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* pthread_timedjoin_np's clock */
    ts.tv_sec += (time_t)(p->timeout_ms / 1000) + 1;
    if (pthread_timedjoin_np(p->slots[r].thread, NULL, &ts) != 0) {
      /* A part stuck past the timeout: leaving its thread and the pool
       * (which it may still touch) is the only safe choice. */
      ddp_log(DDP_LOG_WARN, "DataParallel: replica %d's thread did not stop; left running", r);
      pthread_detach(p->slots[r].thread);
      all_joined = false;
    }
  }
  if (!all_joined) return;
  for (int r = 0; r < p->n; r++) ddp_free(p->slots[r].sum_scratch);
  pthread_cond_destroy(&p->work_cv);
  pthread_cond_destroy(&p->done_cv);
  pthread_cond_destroy(&p->barrier_cv);
  pthread_mutex_destroy(&p->mu);
  ddp_free(p->slots);
  ddp_free(p);
}

int ddp__replica_pool_cpu(const ddp__replica_pool *p, int replica) {
  return replica >= 0 && replica < p->n ? p->slots[replica].cpu : -1;
}

ddp_status ddp__replica_pool_run(ddp__replica_pool *p, ddp__replica_job job, void *ctx,
                                 const char *what) {
  pthread_mutex_lock(&p->mu);
  if (p->broken) {
    pthread_mutex_unlock(&p->mu);
    return ddp_error(DDP_ERR_TIMEOUT, "DataParallel: a replica timed out earlier; the wrapper "
                                      "cannot be used any more");
  }
  p->job = job;
  p->ctx = ctx;
  p->done = 0;
  p->failed = false;
  p->barrier_count = 0;
  for (int r = 0; r < p->n; r++) p->slots[r].status = DDP_OK, p->slots[r].finished = false;
  p->job_gen++;
  pthread_cond_broadcast(&p->work_cv);
  pthread_mutex_unlock(&p->mu);

  run_part(p, &p->slots[0]);

  struct timespec ts = deadline_after(p->timeout_ms);
  pthread_mutex_lock(&p->mu);
  int rc = 0;
  while (p->done < p->n && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&p->done_cv, &p->mu, &ts);
  if (p->done < p->n) {
    p->broken = true;
    int late = -1;
    for (int r = 1; r < p->n && late < 0; r++)
      if (!p->slots[r].finished) late = r;
    pthread_mutex_unlock(&p->mu);
    return ddp_error(DDP_ERR_TIMEOUT, "DataParallel: replica %d (core %d) did not finish %s "
                                      "within %lld ms", late, late >= 0 ? p->slots[late].cpu : -1,
                     what, (long long)p->timeout_ms);
  }
  pthread_mutex_unlock(&p->mu);
  /* The first failure in replica order; a barrier's "another replica
   * failed" comes after the part that did, so prefer a root cause. */
  int first = -1;
  for (int r = 0; r < p->n; r++) {
    if (p->slots[r].status == DDP_OK) continue;
    if (first < 0 || (p->slots[first].status == DDP_ERR_ABORTED &&
                      p->slots[r].status != DDP_ERR_ABORTED))
      first = r;
  }
  if (first < 0) return DDP_OK;
  const replica_slot *s = &p->slots[first];
  if (s->cpu >= 0)
    return ddp_error(s->status, "DataParallel: replica %d (core %d): %s: %s", first, s->cpu, what,
                     s->err);
  return ddp_error(s->status, "DataParallel: replica %d: %s: %s", first, what, s->err);
}

ddp_status ddp__replica_pool_barrier(ddp__replica_pool *p, int replica) {
  pthread_mutex_lock(&p->mu);
  if (p->failed) {
    pthread_mutex_unlock(&p->mu);
    return ddp_error(DDP_ERR_ABORTED, "another replica failed");
  }
  uint64_t gen = p->barrier_gen;
  if (++p->barrier_count == p->n) {
    p->barrier_count = 0;
    p->barrier_gen++;
    pthread_cond_broadcast(&p->barrier_cv);
    pthread_mutex_unlock(&p->mu);
    return DDP_OK;
  }
  struct timespec ts = deadline_after(p->timeout_ms);
  int rc = 0;
  while (p->barrier_gen == gen && !p->failed && !p->stop && rc != ETIMEDOUT)
    rc = pthread_cond_timedwait(&p->barrier_cv, &p->mu, &ts);
  bool passed = p->barrier_gen != gen;
  bool failed = p->failed;
  pthread_mutex_unlock(&p->mu);
  if (passed) return DDP_OK;
  if (failed) return ddp_error(DDP_ERR_ABORTED, "another replica failed");
  return ddp_error(DDP_ERR_TIMEOUT, "replica %d waited %lld ms for the others at a barrier",
                   replica, (long long)p->timeout_ms);
}

ddp_status ddp__replica_pool_allreduce_sum(ddp__replica_pool *p, int replica, double *buf,
                                           size_t count) {
  replica_slot *me = &p->slots[replica];
  if (count > p->sum_doubles)
    return ddp_error(DDP_ERR_INTERNAL, "replica sum of %zu doubles (room for %zu)", count,
                     p->sum_doubles);
  me->sum_buf = buf;
  me->sum_count = count;
  DDP_TRY(ddp__replica_pool_barrier(p, replica)); /* every replica has posted */
  for (int r = 0; r < p->n; r++)
    if (p->slots[r].sum_count != count)
      return ddp_error(DDP_ERR_STATE, "replica %d sums %zu values, replica %d %zu", r,
                       p->slots[r].sum_count, replica, count);
  /* Each replica sums all of them itself, in replica order: the same
   * additions everywhere, so the same bits, with no replica waiting for
   * another's result. */
  for (size_t i = 0; i < count; i++) {
    double acc = p->slots[0].sum_buf[i];
    for (int r = 1; r < p->n; r++) acc += p->slots[r].sum_buf[i];
    me->sum_scratch[i] = acc;
  }
  DDP_TRY(ddp__replica_pool_barrier(p, replica)); /* nobody reads the posted buffers now */
  memcpy(buf, me->sum_scratch, count * sizeof(double));
  return DDP_OK;
}
