/* Functions the RPC tests register on every worker, and message helpers. */
#ifndef DDP_TESTS_RPC_TEST_HANDLERS_H
#define DDP_TESTS_RPC_TEST_HANDLERS_H

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "ddp/rpc.h"

/* echo: the reply is the args (it points into them: no copy). */
static ddp_status h_echo(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)call, (void)user;
  *reply = *args;
  reply->release = NULL;
  reply->release_ctx = NULL;
  return DDP_OK;
}

typedef struct owned_reply {
  ddp_tensor *t;
  ddp_tensor *ts[1]; /* the reply's tensor list: {t} */
  double sum;
} owned_reply;

static void owned_reply_free(void *ctx) {
  owned_reply *o = ctx;
  ddp_tensor_destroy(o->t);
  ddp_free(o);
}

/* scale: payload = a double s; one float32 tensor x; replies y = s * x (a
 * new tensor, released by the engine after sending) and the payload sum(x)
 * as a double. A payload that is not 8 bytes is refused (DDP_ERR_INVALID). */
static ddp_status h_scale(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)call, (void)user;
  if (args->payload_bytes != sizeof(double))
    return ddp_error(DDP_ERR_INVALID, "payload of %zu bytes, expected 8 (a double)",
                     args->payload_bytes);
  if (args->num_tensors != 1 || args->tensors[0]->dtype != DDP_FLOAT32)
    return ddp_error(DDP_ERR_INVALID, "expected one float32 tensor, got %d tensors",
                     args->num_tensors);
  double s;
  memcpy(&s, args->payload, sizeof s);
  const ddp_tensor *x = args->tensors[0];
  owned_reply *o = ddp_calloc(1, sizeof *o);
  if (!o) return ddp_error(DDP_ERR_NOMEM, "scale: out of memory");
  ddp_status st = ddp_tensor_create(&o->t, DDP_FLOAT32, x->ndim, x->shape);
  if (st != DDP_OK) {
    ddp_free(o);
    return st;
  }
  for (int64_t i = 0; i < x->numel; i++) {
    ddp_tensor_f32(o->t)[i] = (float)s * ddp_tensor_f32(x)[i];
    o->sum += ddp_tensor_f32(x)[i];
  }
  o->ts[0] = o->t;
  reply->payload = &o->sum;
  reply->payload_bytes = sizeof o->sum;
  reply->tensors = o->ts;
  reply->num_tensors = 1;
  reply->release = owned_reply_free;
  reply->release_ctx = o;
  return DDP_OK;
}

/* slow: sleeps the payload's int64 milliseconds, then replies with it. */
static ddp_status h_slow(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)call, (void)user;
  int64_t ms = 0;
  if (args->payload_bytes == sizeof ms) memcpy(&ms, args->payload, sizeof ms);
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
  *reply = *args;
  reply->release = NULL;
  return DDP_OK;
}

/* ping: payload = int64 depth; depth > 0 calls "ping" back on the caller
 * with depth - 1 (nested RPC) and replies with the count of hops below
 * plus one. */
static ddp_status h_ping(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)user;
  int64_t depth;
  if (args->payload_bytes != sizeof depth) return ddp_error(DDP_ERR_INVALID, "ping: bad payload");
  memcpy(&depth, args->payload, sizeof depth);
  int64_t hops = 1;
  if (depth > 0) {
    int64_t next = depth - 1;
    ddp_rpc_message m = {.payload = &next, .payload_bytes = sizeof next}, r;
    DDP_TRY(ddp_rpc_sync(ddp_rpc_call_agent(call), ddp_rpc_call_caller(call)->name, "ping", &m,
                         DDP_RPC_DEFAULT_TIMEOUT, &r));
    int64_t below = 0;
    if (r.payload_bytes == sizeof below) memcpy(&below, r.payload, sizeof below);
    ddp_rpc_message_free(&r);
    hops += below;
  }
  int64_t *out = ddp_alloc(sizeof *out);
  if (!out) return ddp_error(DDP_ERR_NOMEM, "ping: out of memory");
  *out = hops;
  reply->payload = out;
  reply->payload_bytes = sizeof *out;
  reply->release = ddp_free;
  reply->release_ctx = out;
  return DDP_OK;
}

/* deferred: takes the args, defers the reply, and a thread of its own
 * sends them back 20 ms later. */
typedef struct deferred_job {
  ddp_rpc_reply *reply;
  ddp_rpc_message args;
} deferred_job;

static void *deferred_main(void *arg) {
  deferred_job *j = arg;
  struct timespec ts = {0, 20 * 1000000L};
  nanosleep(&ts, NULL);
  ddp_rpc_reply_send(j->reply, &j->args); /* releases the args after sending */
  ddp_free(j);
  return NULL;
}

static ddp_status h_deferred(ddp_rpc_call *call, const ddp_rpc_message *args,
                             ddp_rpc_message *reply, void *user) {
  (void)args, (void)reply, (void)user;
  deferred_job *j = ddp_calloc(1, sizeof *j);
  if (!j) return ddp_error(DDP_ERR_NOMEM, "deferred: out of memory");
  DDP_TRY(ddp_rpc_call_take_args(call, &j->args));
  DDP_TRY(ddp_rpc_call_defer(call, &j->reply));
  pthread_t t;
  if (pthread_create(&t, NULL, deferred_main, j) != 0) return ddp_error(DDP_ERR_SYS, "thread");
  pthread_detach(t);
  return DDP_OK;
}

/* time_left: replies with the caller's time left as the handler sees it (a double). */
static ddp_status h_time_left(ddp_rpc_call *call, const ddp_rpc_message *args,
                              ddp_rpc_message *reply, void *user) {
  (void)args, (void)user;
  double *left = ddp_alloc(sizeof *left);
  if (!left) return ddp_error(DDP_ERR_NOMEM, "time_left: out of memory");
  *left = ddp_rpc_call_time_left_s(call);
  reply->payload = left;
  reply->payload_bytes = sizeof *left;
  reply->release = ddp_free;
  reply->release_ctx = left;
  return DDP_OK;
}

static void register_test_handlers(void) {
  ddp_rpc_register("time_left", h_time_left, NULL);
  ddp_rpc_register("echo", h_echo, NULL);
  ddp_rpc_register("scale", h_scale, NULL);
  ddp_rpc_register("slow", h_slow, NULL);
  ddp_rpc_register("ping", h_ping, NULL);
  ddp_rpc_register("deferred", h_deferred, NULL);
}

/* Fills a tensor's bytes from a seed (a simple LCG: every byte differs). */
static inline void fill_bytes(void *p, size_t n, uint64_t seed) {
  uint8_t *b = p;
  uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (size_t i = 0; i < n; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b[i] = (uint8_t)(x >> 56);
  }
}

#endif /* DDP_TESTS_RPC_TEST_HANDLERS_H */
