/* The RPC engine between worker processes: sync and async round trips with
 * payloads and tensors checked byte for byte, results computed remotely
 * against the same computation done locally, self calls, worker info and
 * transports, many concurrent async calls from every worker with
 * then-callbacks, nested calls (A -> B -> A -> ...) with a pool of one
 * thread, deferred replies, duplicate names, and init through a rendezvous
 * URL. */
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>

#include "ddp/launch.h"
#include "rpc_test_handlers.h"
#include "rpc_test_util.h"

/* ---- Round trips -------------------------------------------------------------- */

/* One echo to `to` of a payload and four tensors of different dtypes, the
 * reply compared byte for byte with what was sent. */
static void echo_once(ddp_rpc_agent *a, const char *to, size_t payload_bytes, int64_t n,
                      uint64_t seed, rt_result *res) {
  uint8_t *payload = ddp_alloc(payload_bytes + 1);
  fill_bytes(payload, payload_bytes, seed);
  ddp_dtype dtypes[4] = {DDP_FLOAT32, DDP_INT64, DDP_UINT8, DDP_FLOAT64};
  ddp_tensor *ts[4];
  for (int i = 0; i < 4; i++) {
    int64_t shape[2] = {n, i + 1};
    ddp_tensor_create(&ts[i], dtypes[i], i == 2 ? 1 : 2, shape);
    fill_bytes(ts[i]->data, (size_t)ts[i]->numel * ddp_dtype_size(dtypes[i]), seed + 1 + (uint64_t)i);
  }
  ddp_rpc_message args = {.payload = payload, .payload_bytes = payload_bytes, .tensors = ts,
                          .num_tensors = 4},
                  out;
  ddp_status st = ddp_rpc_sync(a, to, "echo", &args, DDP_RPC_DEFAULT_TIMEOUT, &out);
  RT_CHECK(res, st == DDP_OK, "echo to %s: %s", to, ddp_last_error());
  if (st == DDP_OK) {
    RT_CHECK(res, out.payload_bytes == payload_bytes, "payload %zu bytes", out.payload_bytes);
    RT_CHECK(res, payload_bytes == 0 || memcmp(out.payload, payload, payload_bytes) == 0,
             "payload differs (%zu bytes to %s)", payload_bytes, to);
    RT_CHECK(res, out.num_tensors == 4, "%d tensors", out.num_tensors);
    for (int i = 0; i < 4 && out.num_tensors == 4; i++) {
      const ddp_tensor *t = out.tensors[i];
      RT_CHECK(res, t->dtype == dtypes[i] && t->ndim == ts[i]->ndim && ddp_tensor_same_shape(t, ts[i]),
               "tensor %d's dtype/shape", i);
      RT_CHECK(res, ((uintptr_t)t->data & 63) == 0, "tensor %d not 64-byte aligned", i);
      RT_CHECK(res, memcmp(t->data, ts[i]->data, (size_t)t->numel * ddp_dtype_size(t->dtype)) == 0,
               "tensor %d (%lld elements) differs after echo to %s", i, (long long)t->numel, to);
    }
    ddp_rpc_message_free(&out);
  }
  for (int i = 0; i < 4; i++) ddp_tensor_destroy(ts[i]);
  ddp_free(payload);
}

static void round_trips_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)arg;
  for (int to = 0; to < size; to++) {
    char name[16];
    snprintf(name, sizeof name, "w%d", to);
    /* Empty, small, one buffer's worth, and large (tensor data read straight
     * into the message, 3 x 8 MiB + ...). */
    echo_once(a, name, 0, 0, 1, res);
    echo_once(a, name, 3, 1, (uint64_t)(rank * 100 + to), res);
    echo_once(a, name, 70000, 4096, (uint64_t)(rank * 100 + to + 7), res);
    echo_once(a, name, 1 << 20, 1 << 18, (uint64_t)(rank * 100 + to + 9), res);
    /* A result computed there against the same computation here. */
    int64_t shape[1] = {1000};
    ddp_tensor *x;
    ddp_tensor_create(&x, DDP_FLOAT32, 1, shape);
    double sum = 0;
    for (int i = 0; i < 1000; i++) {
      ddp_tensor_f32(x)[i] = (float)(i - 500) / 7.0f + (float)rank;
      sum += ddp_tensor_f32(x)[i];
    }
    double scale = 2.5 + to;
    ddp_tensor *xs[1] = {x};
    ddp_rpc_message args = {.payload = &scale, .payload_bytes = 8, .tensors = xs, .num_tensors = 1},
                    out;
    ddp_status st = ddp_rpc_sync(a, name, "scale", &args, 10, &out);
    RT_CHECK(res, st == DDP_OK, "scale on %s: %s", name, ddp_last_error());
    if (st == DDP_OK) {
      double got_sum;
      memcpy(&got_sum, out.payload, 8);
      RT_CHECK(res, got_sum == sum, "sum %.17g, expected %.17g", got_sum, sum);
      RT_CHECK(res, out.num_tensors == 1 && out.tensors[0]->numel == 1000, "shape");
      for (int i = 0; i < 1000 && res->failures == 0; i++)
        RT_CHECK(res, ddp_tensor_f32(out.tensors[0])[i] == (float)scale * ddp_tensor_f32(x)[i],
                 "y[%d] = %g", i, ddp_tensor_f32(out.tensors[0])[i]);
      ddp_rpc_message_free(&out);
    }
    ddp_tensor_destroy(x);
  }
}

static void test_round_trips(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true};
  rt_run(3, &cfg, round_trips_fn, NULL, 60);
}

/* The same with cross-memory attach off: every tensor through the socket. */
static void test_round_trips_no_cma(void **state) {
  (void)state;
  setenv("DDP_RPC_NO_CMA", "1", 1);
  rt_config cfg = {.graceful = true};
  rt_run(2, &cfg, round_trips_fn, NULL, 60);
  unsetenv("DDP_RPC_NO_CMA");
}

/* The same over TCP (forced, on one host). */
static void tcp_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)arg;
  for (int r = 0; r < size; r++)
    RT_CHECK(res, strcmp(ddp_rpc_transport_name(a, r), r == rank ? "self" : "tcp") == 0,
             "transport to %d is %s", r, ddp_rpc_transport_name(a, r));
  echo_once(a, rank ? "w0" : "w1", 1000, 1 << 18, 42 + (uint64_t)rank, res);
}

static void test_tcp_transport(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true, .transport = DDP_RPC_TRANSPORT_TCP};
  rt_run(2, &cfg, tcp_fn, NULL, 60);
  /* Large tensors through the TCP stream too, not read across processes. */
  setenv("DDP_RPC_NO_CMA", "1", 1);
  rt_run(2, &cfg, tcp_fn, NULL, 60);
  unsetenv("DDP_RPC_NO_CMA");
}

/* ---- Worker info ---------------------------------------------------------------- */

static void info_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)arg;
  RT_CHECK(res, ddp_rpc_world_size(a) == size, "world %d", ddp_rpc_world_size(a));
  RT_CHECK(res, ddp_rpc_self(a)->rank == rank, "self rank %d", ddp_rpc_self(a)->rank);
  for (int r = 0; r < size; r++) {
    char name[16];
    snprintf(name, sizeof name, "w%d", r);
    ddp_rpc_worker_info by_name, by_rank;
    RT_CHECK(res, ddp_rpc_get_worker_info(a, name, -1, &by_name) == DDP_OK, "%s", ddp_last_error());
    RT_CHECK(res, ddp_rpc_get_worker_info(a, NULL, r, &by_rank) == DDP_OK, "%s", ddp_last_error());
    RT_CHECK(res, by_name.rank == r && strcmp(by_rank.name, name) == 0, "worker %d", r);
    RT_CHECK(res, by_name.host_index == 0, "one host: host index %d", by_name.host_index);
    RT_CHECK(res, strcmp(ddp_rpc_transport_name(a, r), r == rank ? "self" : "unix") == 0,
             "transport to %d: %s", r, ddp_rpc_transport_name(a, r));
  }
  ddp_rpc_worker_info w;
  RT_CHECK(res, ddp_rpc_get_worker_info(a, "nobody", -1, &w) == DDP_ERR_NOTFOUND, "unknown name");
  RT_CHECK(res, strstr(ddp_last_error(), "'nobody'") && strstr(ddp_last_error(), "'w1'"),
           "message: %s", ddp_last_error());
  RT_CHECK(res, ddp_rpc_get_worker_info(a, NULL, size, &w) == DDP_ERR_NOTFOUND, "bad rank");
  ddp_rpc_message m = {0};
  RT_CHECK(res, ddp_rpc_sync(a, "nobody", "echo", &m, 1, NULL) == DDP_ERR_NOTFOUND, "call nobody");
}

static void test_worker_info(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true};
  rt_run(3, &cfg, info_fn, NULL, 60);
}

/* ---- Many concurrent async calls, then-callbacks ------------------------------------ */

#define ASYNC_CALLS 200

typedef struct cb_state {
  atomic_int ran;
  atomic_int ok;
  atomic_int late; /* callbacks added after completion (run at once) */
  int64_t expect[ASYNC_CALLS];
} cb_state;

static void count_cb(ddp_rpc_future *f, void *user) {
  cb_state *s = user;
  const ddp_rpc_message *m;
  /* The future is complete when its callback runs: its result is there. */
  if (ddp_rpc_future_done(f) && ddp_rpc_future_result(f, &m) == DDP_OK && m->payload_bytes == 16) {
    int64_t v[2];
    memcpy(v, m->payload, 16);
    if (v[0] >= 0 && v[0] < ASYNC_CALLS && s->expect[v[0]] == v[1]) atomic_fetch_add(&s->ok, 1);
  }
  atomic_fetch_add(&s->ran, 1);
}

static void late_cb(ddp_rpc_future *f, void *user) {
  count_cb(f, user);
  atomic_fetch_add(&((cb_state *)user)->late, 1);
}

static void async_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)arg;
  static cb_state s;
  ddp_rpc_future *fs[ASYNC_CALLS];
  int64_t payloads[ASYNC_CALLS][2];
  int64_t shape[1] = {64};
  ddp_tensor *t;
  ddp_tensor_create(&t, DDP_INT64, 1, shape);
  for (int i = 0; i < ASYNC_CALLS; i++) {
    payloads[i][0] = i;
    payloads[i][1] = (int64_t)rank * 1000003 + i * 7919;
    s.expect[i] = payloads[i][1];
    for (int k = 0; k < 64; k++) ddp_tensor_i64(t)[k] = payloads[i][1] + k;
    ddp_tensor *ts[1] = {t};
    ddp_rpc_message m = {.payload = payloads[i], .payload_bytes = 16, .tensors = ts, .num_tensors = 1};
    char to[16];
    snprintf(to, sizeof to, "w%d", (rank + 1 + i % (size - 1)) % size);
    ddp_status st = ddp_rpc_async(a, to, "echo", &m, 30, &fs[i]);
    RT_CHECK(res, st == DDP_OK, "async %d: %s", i, ddp_last_error());
    if (st != DDP_OK) fs[i] = NULL;
    /* The caller may reuse its buffers at once: overwrite them. */
    memset(t->data, 0xAB, 64 * 8);
    if (fs[i] && i % 2 == 0) ddp_rpc_future_then(fs[i], count_cb, &s);
  }
  for (int i = 0; i < ASYNC_CALLS; i++) {
    if (!fs[i]) continue;
    ddp_status st = ddp_rpc_future_wait(fs[i], 30);
    RT_CHECK(res, st == DDP_OK, "wait %d: %s", i, ddp_last_error());
    const ddp_rpc_message *m;
    if (st == DDP_OK && ddp_rpc_future_result(fs[i], &m) == DDP_OK) {
      RT_CHECK(res, m->payload_bytes == 16 && memcmp(m->payload, payloads[i], 16) == 0, "payload %d", i);
      RT_CHECK(res, m->num_tensors == 1, "tensors");
      for (int k = 0; k < 64 && m->num_tensors == 1; k++)
        RT_CHECK(res, ddp_tensor_i64(m->tensors[0])[k] == payloads[i][1] + k, "call %d [%d]", i, k);
    }
    /* A callback added after completion runs at once, here. */
    if (i % 2 == 1) {
      int before = atomic_load(&s.late);
      ddp_rpc_future_then(fs[i], late_cb, &s);
      RT_CHECK(res, atomic_load(&s.late) == before + 1, "late then-callback did not run at once");
    }
  }
  /* The pool runs the early callbacks: wait (bounded) until all ran. */
  for (int spin = 0; spin < 2000 && atomic_load(&s.ran) < ASYNC_CALLS; spin++) rt_sleep_ms(5);
  RT_CHECK(res, atomic_load(&s.ran) == ASYNC_CALLS, "%d of %d callbacks ran", atomic_load(&s.ran), ASYNC_CALLS);
  RT_CHECK(res, atomic_load(&s.ok) == ASYNC_CALLS, "%d callbacks saw their result", atomic_load(&s.ok));
  for (int i = 0; i < ASYNC_CALLS; i++) ddp_rpc_future_destroy(fs[i]);
  ddp_tensor_destroy(t);
}

static void test_async_many(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true};
  rt_run(4, &cfg, async_fn, NULL, 90);
}

/* Both workers flood each other at once with async calls whose tensors go
 * through the stream (60 KiB) and by cross-memory attach (100 KiB), so the
 * sockets fill both ways while each reader must acknowledge what it read:
 * a reader never waits for the writers (it would close a cycle with the
 * peer's), so every call completes. */
#define FLOOD_CALLS 300

static void flood_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  ddp_rpc_future **fs = ddp_calloc(FLOOD_CALLS, sizeof *fs);
  ddp_tensor *ts[FLOOD_CALLS];
  for (int i = 0; i < FLOOD_CALLS; i++) {
    int64_t n = (i % 2 ? 100 : 60) * 1024 / 4;
    ddp_tensor_create(&ts[i], DDP_FLOAT32, 1, &n);
    fill_bytes(ts[i]->data, (size_t)n * 4, (uint64_t)(rank * 100000 + i));
    ddp_tensor *one[1] = {ts[i]};
    ddp_rpc_message m = {.tensors = one, .num_tensors = 1};
    ddp_status st = ddp_rpc_async(a, rank ? "w0" : "w1", "echo", &m, 60, &fs[i]);
    RT_CHECK(res, st == DDP_OK, "flood %d: %s", i, ddp_last_error());
    if (st != DDP_OK) fs[i] = NULL;
  }
  for (int i = 0; i < FLOOD_CALLS; i++) {
    if (!fs[i]) continue;
    ddp_status st = ddp_rpc_future_wait(fs[i], 60);
    RT_CHECK(res, st == DDP_OK, "flood wait %d: %s", i, ddp_last_error());
    const ddp_rpc_message *m;
    if (st == DDP_OK && ddp_rpc_future_result(fs[i], &m) == DDP_OK)
      RT_CHECK(res, m->num_tensors == 1 && memcmp(m->tensors[0]->data, ts[i]->data,
                                                  (size_t)ts[i]->numel * 4) == 0,
               "flood %d differs", i);
    ddp_rpc_future_destroy(fs[i]);
  }
  for (int i = 0; i < FLOOD_CALLS; i++) ddp_tensor_destroy(ts[i]);
  ddp_free(fs);
}

static void test_flood_both_ways(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true, .threads = 2};
  rt_run(2, &cfg, flood_fn, NULL, 120);
}

/* ---- Nested calls with a pool of one thread ------------------------------------------ */

static void nested_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  /* Both workers at once: w0 -> w1 -> w0 -> ... (depth hops), and the other way. */
  for (int64_t depth = 1; depth <= 6; depth++) {
    ddp_rpc_message m = {.payload = &depth, .payload_bytes = sizeof depth}, out;
    ddp_status st = ddp_rpc_sync(a, rank ? "w0" : "w1", "ping", &m, 20, &out);
    RT_CHECK(res, st == DDP_OK, "ping depth %lld: %s", (long long)depth, ddp_last_error());
    if (st == DDP_OK) {
      int64_t hops = 0;
      memcpy(&hops, out.payload, 8);
      RT_CHECK(res, hops == depth + 1, "depth %lld: %lld hops", (long long)depth, (long long)hops);
      ddp_rpc_message_free(&out);
    }
  }
  /* Several concurrent nested calls from one worker. */
  ddp_rpc_future *fs[8];
  int64_t depth = 3;
  ddp_rpc_message m = {.payload = &depth, .payload_bytes = sizeof depth};
  for (int i = 0; i < 8; i++)
    RT_CHECK(res, ddp_rpc_async(a, rank ? "w0" : "w1", "ping", &m, 20, &fs[i]) == DDP_OK, "%s",
             ddp_last_error());
  for (int i = 0; i < 8; i++) {
    RT_CHECK(res, ddp_rpc_future_wait(fs[i], 30) == DDP_OK, "nested %d: %s", i, ddp_last_error());
    ddp_rpc_future_destroy(fs[i]);
  }
}

static void test_nested_pool_of_one(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true, .threads = 1};
  rt_run(2, &cfg, nested_fn, NULL, 60);
}

/* ---- Deferred replies, self calls ----------------------------------------------------- */

static void deferred_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  for (int k = 0; k < 2; k++) {
    const char *to = k == 0 ? (rank ? "w0" : "w1") : ddp_rpc_self(a)->name;
    char text[64];
    int n = snprintf(text, sizeof text, "from %d to %s", rank, to);
    int64_t shape[1] = {5000};
    ddp_tensor *t;
    ddp_tensor_create(&t, DDP_FLOAT32, 1, shape);
    fill_bytes(t->data, 20000, (uint64_t)rank + 3);
    ddp_tensor *ts[1] = {t};
    ddp_rpc_message m = {.payload = text, .payload_bytes = (size_t)n, .tensors = ts, .num_tensors = 1}, out;
    int64_t t0 = ddp_time_ns();
    ddp_status st = ddp_rpc_sync(a, to, "deferred", &m, 10, &out);
    RT_CHECK(res, st == DDP_OK, "deferred to %s: %s", to, ddp_last_error());
    RT_CHECK(res, ddp_time_ns() - t0 >= 20 * 1000000LL, "replied before the deferral ended");
    if (st == DDP_OK) {
      RT_CHECK(res, out.payload_bytes == (size_t)n && memcmp(out.payload, text, (size_t)n) == 0, "payload");
      RT_CHECK(res, out.num_tensors == 1 && memcmp(out.tensors[0]->data, t->data, 20000) == 0, "tensor");
      ddp_rpc_message_free(&out);
    }
    /* Self calls: echo too. */
    echo_once(a, ddp_rpc_self(a)->name, 100, 100, 5, res);
    ddp_tensor_destroy(t);
  }
}

/* User futures (torch.futures.Future) completed by another thread; the
 * caller's time left as a handler sees it. */
typedef struct completer {
  ddp_rpc_future *f;
  bool fail;
  ddp_tensor *t;
  ddp_tensor *ts[1];
} completer;

static void free_tensor_ctx(void *ctx) { ddp_tensor_destroy(ctx); }

static void *complete_later(void *p) {
  completer *c = p;
  rt_sleep_ms(20);
  if (c->fail) {
    ddp_rpc_future_fail(c->f, DDP_ERR_PEER, "it broke (%d)", 7);
  } else {
    c->ts[0] = c->t;
    ddp_rpc_message m = {.tensors = c->ts, .num_tensors = 1, .release = free_tensor_ctx,
                         .release_ctx = c->t};
    ddp_rpc_future_complete(c->f, &m);
  }
  return NULL;
}

static atomic_int user_cb_ran;
static void user_cb(ddp_rpc_future *f, void *user) {
  (void)user;
  if (ddp_rpc_future_done(f)) atomic_fetch_add(&user_cb_ran, 1);
}

static void user_future_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  for (int fail = 0; fail < 2; fail++) {
    completer c = {.fail = fail};
    int64_t n = 3;
    ddp_tensor_create(&c.t, DDP_INT64, 1, &n);
    for (int i = 0; i < 3; i++) ddp_tensor_i64(c.t)[i] = 10 * rank + i;
    RT_CHECK(res, ddp_rpc_future_create(a, &c.f) == DDP_OK, "%s", ddp_last_error());
    ddp_rpc_future_then(c.f, user_cb, NULL);
    pthread_t th;
    pthread_create(&th, NULL, complete_later, &c);
    ddp_status st = ddp_rpc_future_wait(c.f, 10);
    pthread_join(th, NULL);
    if (!fail) {
      RT_CHECK(res, st == DDP_OK, "user future: %s", ddp_last_error());
      ddp_rpc_message out;
      RT_CHECK(res, ddp_rpc_future_take(c.f, &out) == DDP_OK, "take: %s", ddp_last_error());
      RT_CHECK(res, out.num_tensors == 1 && ddp_tensor_i64(out.tensors[0])[2] == 10 * rank + 2, "value");
      ddp_rpc_message_free(&out); /* frees the tensor through its release */
      RT_CHECK(res, ddp_rpc_future_take(c.f, &out) == DDP_ERR_STATE, "second take");
    } else {
      ddp_tensor_destroy(c.t);
      RT_CHECK(res, st == DDP_ERR_PEER && strstr(ddp_last_error(), "it broke (7)"), "failed future: %s",
               ddp_last_error());
      RT_CHECK(res, strcmp(ddp_rpc_future_error(c.f), "it broke (7)") == 0, "error: %s",
               ddp_rpc_future_error(c.f));
    }
    RT_CHECK(res, ddp_rpc_future_fail(c.f, DDP_ERR_IO, "again") == DDP_ERR_STATE, "second completion");
    ddp_rpc_future_destroy(c.f);
  }
  for (int spin = 0; spin < 1000 && atomic_load(&user_cb_ran) < 2; spin++) rt_sleep_ms(5);
  RT_CHECK(res, atomic_load(&user_cb_ran) == 2, "%d user callbacks ran", atomic_load(&user_cb_ran));
  /* The caller's deadline as the handler sees it: 5 s less what it took to get there. */
  ddp_rpc_message out;
  ddp_status st = ddp_rpc_sync(a, rank ? "w0" : "w1", "time_left", NULL, 5, &out);
  RT_CHECK(res, st == DDP_OK, "time_left: %s", ddp_last_error());
  if (st == DDP_OK) {
    double left;
    memcpy(&left, out.payload, sizeof left);
    RT_CHECK(res, left > 0 && left <= 5.01, "time left %.3f s", left);
    ddp_rpc_message_free(&out);
  }
}

static void test_user_futures(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true};
  rt_run(2, &cfg, user_future_fn, NULL, 60);
}

static void test_deferred_and_self(void **state) {
  (void)state;
  rt_config cfg = {.graceful = true, .threads = 1};
  rt_run(2, &cfg, deferred_fn, NULL, 60);
}

/* ---- Duplicate names; init through a rendezvous URL -------------------------------------- */

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  bind(fd, (struct sockaddr *)&sa, sizeof sa);
  socklen_t len = sizeof sa;
  getsockname(fd, (struct sockaddr *)&sa, &len);
  close(fd);
  return ntohs(sa.sin_port);
}

/* Workers started by hand through `url`, with the names given. Each
 * writes its init status and message to results. */
static void start_by_url(int size, const char *const *names, const char *url, rt_result *results,
                         pid_t *pids) {
  fflush(NULL);
  for (int r = 0; r < size; r++) {
    pid_t pid = fork();
    if (pid == 0) {
      alarm(60);
      ddp_rpc_options o = ddp_rpc_defaults();
      o.name = names[r];
      o.rank = r;
      o.world_size = size;
      o.init_method = url;
      o.init_timeout_s = 30;
      ddp_rpc_agent *a;
      ddp_status st = ddp_rpc_init(&o, &a);
      results[r].value[0] = st;
      snprintf(results[r].msg, sizeof results[r].msg, "%s", st == DDP_OK ? "" : ddp_last_error());
      if (st == DDP_OK) {
        /* A call across, then a graceful shutdown. */
        ddp_rpc_message m = {.payload = "hi", .payload_bytes = 2}, out;
        st = ddp_rpc_sync(a, names[(r + 1) % size], "echo", &m, 10, &out);
        results[r].value[1] = st == DDP_OK && out.payload_bytes == 2 && !memcmp(out.payload, "hi", 2);
        ddp_rpc_message_free(&out);
        results[r].value[2] = ddp_rpc_shutdown(a, true, 30);
      }
      _exit(0);
    }
    pids[r] = pid;
  }
}

static void test_duplicate_names(void **state) {
  (void)state;
  rt_result *res = mmap(NULL, sizeof(rt_result) * 3, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(res, 0, sizeof(rt_result) * 3);
  char url[64];
  snprintf(url, sizeof url, "tcp://127.0.0.1:%d", free_port());
  const char *names[3] = {"dup", "other", "dup"};
  pid_t pids[3];
  start_by_url(3, names, url, res, pids);
  for (int r = 0; r < 3; r++) waitpid(pids[r], NULL, 0);
  for (int r = 0; r < 3; r++) {
    assert_int_equal(res[r].value[0], DDP_ERR_INVALID);
    if (!strstr(res[r].msg, "'dup' is used by rank 0 and rank 2")) fail_msg("rank %d: %s", r, res[r].msg);
  }
  munmap(res, sizeof(rt_result) * 3);
}

static void test_init_by_url(void **state) {
  (void)state;
  rt_result *res = mmap(NULL, sizeof(rt_result) * 3, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(res, 0, sizeof(rt_result) * 3);
  char url[64];
  snprintf(url, sizeof url, "tcp://127.0.0.1:%d", free_port());
  const char *names[3] = {"ps", "trainer_1", "trainer_2"};
  pid_t pids[3];
  start_by_url(3, names, url, res, pids);
  for (int r = 0; r < 3; r++) waitpid(pids[r], NULL, 0);
  for (int r = 0; r < 3; r++) {
    if (res[r].value[0] != DDP_OK) fail_msg("rank %d init: %s", r, res[r].msg);
    assert_int_equal(res[r].value[1], 1);
    assert_int_equal(res[r].value[2], DDP_OK);
  }
  munmap(res, sizeof(rt_result) * 3);
}

/* env:// as a launcher sets it: ddp_spawn gives each worker torchrun's
 * variables and DDP_STORE_ADDR (its own store process); init_method NULL. */
static int spawned_worker(int rank, void *arg) {
  (void)arg;
  char name[32];
  snprintf(name, sizeof name, "spawned_%d", rank);
  ddp_rpc_options o = ddp_rpc_defaults();
  o.name = name; /* rank and world size from the environment */
  o.init_timeout_s = 30;
  ddp_rpc_agent *a;
  if (ddp_rpc_init(&o, &a) != DDP_OK) {
    fprintf(stderr, "spawned %d: init: %s\n", rank, ddp_last_error());
    return 1;
  }
  int bad = ddp_rpc_self(a)->rank != rank || ddp_rpc_world_size(a) != 3;
  char to[32];
  snprintf(to, sizeof to, "spawned_%d", (rank + 1) % 3);
  ddp_rpc_message m = {.payload = name, .payload_bytes = strlen(name)}, out;
  if (ddp_rpc_sync(a, to, "echo", &m, 10, &out) != DDP_OK ||
      out.payload_bytes != strlen(name) || memcmp(out.payload, name, strlen(name)) != 0) {
    fprintf(stderr, "spawned %d: echo: %s\n", rank, ddp_last_error());
    bad = 1;
  }
  ddp_rpc_message_free(&out);
  if (ddp_rpc_shutdown(a, true, 30) != DDP_OK) {
    fprintf(stderr, "spawned %d: shutdown: %s\n", rank, ddp_last_error());
    bad = 1;
  }
  return bad;
}

static void test_init_env_spawn(void **state) {
  (void)state;
  ddp_spawn_options so = ddp_spawn_defaults();
  so.timeout_s = 60;
  so.bind = DDP_LAUNCH_BIND_NONE;
  ddp_status st = ddp_spawn(3, spawned_worker, NULL, &so);
  if (st != DDP_OK) fail_msg("ddp_spawn: %s", ddp_last_error());
}

static int setup(void **state) {
  (void)state;
  register_test_handlers();
  return rt_start_store();
}

static int teardown(void **state) {
  (void)state;
  rt_stop_store();
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_trips),      cmocka_unit_test(test_round_trips_no_cma),
      cmocka_unit_test(test_tcp_transport),
      cmocka_unit_test(test_worker_info),      cmocka_unit_test(test_async_many),
      cmocka_unit_test(test_flood_both_ways),
      cmocka_unit_test(test_nested_pool_of_one), cmocka_unit_test(test_deferred_and_self),
      cmocka_unit_test(test_user_futures),
      cmocka_unit_test(test_duplicate_names),  cmocka_unit_test(test_init_by_url),
      cmocka_unit_test(test_init_env_spawn),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
