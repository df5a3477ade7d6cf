/* Remote references between 3 worker processes (w0 owns every value; w1
 * drives; w2 is a third worker): values created, passed on (user to user,
 * user to owner, owner to user), used (to_here, methods, local_value) and
 * dropped in every order. The owner counts frees in each value's destroy
 * callback; after each step every worker's reference messages are flushed
 * and the owner's count must be exactly what the references still held
 * imply: a value is never freed while a reference can reach it, and always
 * once none can. A reference never released is named at shutdown. */
#include <fcntl.h>
#include <stdatomic.h>

#include "ddp/rpc_autograd.h"
#include "rpc_test_util.h"

#define SLOTS 32

/* ---- Per-process state (each worker is its own process) ----------------- */

static ddp_rref *slots[SLOTS];           /* references this worker holds */
static _Atomic int64_t frees;            /* owner: values destroyed */
static _Atomic uint64_t freed_markers;   /* owner: bit m set when marker m was freed */
static ddp_rpc_agent *self_agent;

static void value_destroy(void *ptr, void *user) {
  (void)user;
  ddp_tensor *t = ptr;
  int m = (int)ddp_tensor_f32(t)[0];
  atomic_fetch_add(&frees, 1);
  if (m >= 0 && m < 64) atomic_fetch_or(&freed_markers, 1ull << m);
  ddp_tensor_destroy(t);
}

/* ctor "make": payload = a float marker; the value is a (4) tensor of it. */
static ddp_status ctor_make(ddp_rpc_call *call, const ddp_rpc_message *args,
                            ddp_rref_value *out, void *user) {
  (void)call, (void)user;
  if (args->payload_bytes != sizeof(float))
    return ddp_error(DDP_ERR_INVALID, "make: payload of %zu bytes, expected a float marker",
                     args->payload_bytes);
  float m;
  memcpy(&m, args->payload, sizeof m);
  ddp_tensor *t;
  DDP_TRY(ddp_tensor_create(&t, DDP_FLOAT32, 1, (int64_t[]){4}));
  for (int i = 0; i < 4; i++) ddp_tensor_f32(t)[i] = m + (float)i * 0.25f;
  *out = (ddp_rref_value){.ptr = t, .is_tensor = true, .destroy = value_destroy};
  return DDP_OK;
}

static ddp_status ctor_fail(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rref_value *out,
                            void *user) {
  (void)call, (void)args, (void)out, (void)user;
  return ddp_error(DDP_ERR_INVALID, "the answer is not 42 today");
}

/* method "add": payload = a float a; replies value[0] + a as a float. */
static ddp_status method_add(ddp_rpc_call *call, void *value, const ddp_rpc_message *args,
                             ddp_rpc_message *reply, void *user) {
  (void)call, (void)user;
  static _Thread_local float result;
  float a;
  if (args->payload_bytes != sizeof a) return ddp_error(DDP_ERR_INVALID, "add: a float");
  memcpy(&a, args->payload, sizeof a);
  result = ddp_tensor_f32(value)[0] + a;
  reply->payload = &result;
  reply->payload_bytes = sizeof result;
  return DDP_OK;
}

/* ---- Plain functions the driver calls on the others ----------------------- */

typedef struct cmd {
  int32_t slot, dst_slot;
  char to[16];
  float marker;
  uint8_t token[DDP_RREF_TOKEN_BYTES];
} cmd;

static _Thread_local int64_t reply_words[4];

/* hold: makes slots[slot] from the token. */
static ddp_status f_hold(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)user, (void)reply;
  cmd c;
  if (args->payload_bytes != sizeof c) return ddp_error(DDP_ERR_INVALID, "hold: a cmd");
  memcpy(&c, args->payload, sizeof c);
  return ddp_rref_from_token(ddp_rpc_call_agent(call), c.token, &slots[c.slot]);
}

/* drop: releases slots[slot]. */
static ddp_status f_drop(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)call, (void)user, (void)reply;
  cmd c;
  memcpy(&c, args->payload, sizeof c);
  if (!slots[c.slot]) return ddp_error(DDP_ERR_STATE, "drop: slot %d is empty", c.slot);
  ddp_rref_release(slots[c.slot]);
  slots[c.slot] = NULL;
  return DDP_OK;
}

/* pass: forks slots[slot] to worker c.to, which holds it in dst_slot. */
static ddp_status f_pass(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                         void *user) {
  (void)user, (void)reply;
  cmd c;
  memcpy(&c, args->payload, sizeof c);
  cmd h = {.slot = c.dst_slot};
  DDP_TRY(ddp_rref_fork(slots[c.slot], h.token));
  ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
  return ddp_rpc_sync(ddp_rpc_call_agent(call), c.to, "hold", &m, 30, NULL);
}

/* fetch: to_here of slots[slot]; replies its first element. */
static ddp_status f_fetch(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)call, (void)user;
  cmd c;
  memcpy(&c, args->payload, sizeof c);
  ddp_rpc_message out;
  DDP_TRY(ddp_rref_to_here(slots[c.slot], 30, &out));
  reply_words[0] = (int64_t)ddp_tensor_f32(out.tensors[0])[0];
  ddp_rpc_message_free(&out);
  reply->payload = reply_words;
  reply->payload_bytes = sizeof(int64_t);
  return DDP_OK;
}

/* share (on the owner): a local value with marker, held in slot, and a
 * token for the caller in the reply. */
static ddp_status f_share(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)user;
  cmd c;
  memcpy(&c, args->payload, sizeof c);
  ddp_rref_value v;
  ddp_rpc_message margs = {.payload = &c.marker, .payload_bytes = sizeof c.marker};
  DDP_TRY(ctor_make(call, &margs, &v, NULL));
  DDP_TRY(ddp_rref_create_local(ddp_rpc_call_agent(call), &v, "shared", &slots[c.slot]));
  static _Thread_local uint8_t token[DDP_RREF_TOKEN_BYTES];
  DDP_TRY(ddp_rref_fork(slots[c.slot], token));
  reply->payload = token;
  reply->payload_bytes = sizeof token;
  return DDP_OK;
}

static ddp_status f_flush(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)args, (void)reply, (void)user;
  return ddp_rref_flush(ddp_rpc_call_agent(call), 30);
}

/* stats (on the owner): frees, freed markers, values alive. */
static ddp_status f_stats(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                          void *user) {
  (void)args, (void)user;
  reply_words[0] = atomic_load(&frees);
  reply_words[1] = (int64_t)atomic_load(&freed_markers);
  reply_words[2] = ddp_rref_owned_count(ddp_rpc_call_agent(call));
  reply->payload = reply_words;
  reply->payload_bytes = 3 * sizeof(int64_t);
  return DDP_OK;
}

static void register_all(void) {
  ddp_rref_register_ctor("make", ctor_make, NULL);
  ddp_rref_register_ctor("fail", ctor_fail, NULL);
  ddp_rref_register_method("add", method_add, NULL);
  ddp_rpc_register("hold", f_hold, NULL);
  ddp_rpc_register("drop", f_drop, NULL);
  ddp_rpc_register("pass", f_pass, NULL);
  ddp_rpc_register("fetch", f_fetch, NULL);
  ddp_rpc_register("share", f_share, NULL);
  ddp_rpc_register("flush", f_flush, NULL);
  ddp_rpc_register("stats", f_stats, NULL);
}

/* ---- The driver (w1) ------------------------------------------------------------ */

static ddp_status call_cmd(const char *to, const char *fn, const cmd *c, int64_t *words) {
  ddp_rpc_message m = {.payload = c, .payload_bytes = sizeof *c}, out;
  DDP_TRY(ddp_rpc_sync(self_agent, to, fn, &m, 30, &out));
  if (words && out.payload_bytes >= sizeof(int64_t))
    memcpy(words, out.payload, out.payload_bytes < 32 ? out.payload_bytes : 32);
  ddp_rpc_message_free(&out);
  return DDP_OK;
}

/* Every reference message of every worker acknowledged (chains go from
 * one worker to the next: a child's fork request, then its acceptance by
 * the parent, then the parent's delete: three rounds cover them). */
static void flush_all(rt_result *res) {
  cmd c = {0};
  for (int round = 0; round < 3; round++)
    for (int w = 0; w < 3; w++) {
      char name[8];
      snprintf(name, sizeof name, "w%d", w);
      ddp_status s = call_cmd(name, "flush", &c, NULL);
      RT_CHECK(res, s == DDP_OK, "flush %s: %s", name, ddp_last_error());
    }
}

/* After a flush: the owner has freed exactly `expect_frees` values, and
 * marker m is freed or not as said. */
static void expect_owner(rt_result *res, int64_t expect_frees, int marker, bool marker_freed,
                         const char *step) {
  flush_all(res);
  int64_t w[4] = {0};
  cmd c = {0};
  ddp_status s = call_cmd("w0", "stats", &c, w);
  RT_CHECK(res, s == DDP_OK, "stats: %s", ddp_last_error());
  RT_CHECK(res, w[0] == expect_frees, "%s: the owner freed %lld values, expected %lld", step,
           (long long)w[0], (long long)expect_frees);
  RT_CHECK(res, ((w[1] >> marker) & 1) == (uint64_t)marker_freed,
           "%s: marker %d %s on the owner", step, marker, marker_freed ? "not freed" : "freed");
}

static int64_t expected_frees;

static void drop(rt_result *res, const char *who, int slot) {
  cmd c = {.slot = slot};
  if (!strcmp(who, "w1")) {
    ddp_rref_release(slots[slot]);
    slots[slot] = NULL;
    return;
  }
  ddp_status s = call_cmd(who, "drop", &c, NULL);
  RT_CHECK(res, s == DDP_OK, "drop on %s: %s", who, ddp_last_error());
}

static void pass(rt_result *res, const char *from, int slot, const char *to, int dst_slot) {
  cmd c = {.slot = slot, .dst_slot = dst_slot};
  snprintf(c.to, sizeof c.to, "%s", to);
  ddp_status s;
  if (!strcmp(from, "w1")) {
    cmd h = {.slot = dst_slot};
    s = ddp_rref_fork(slots[slot], h.token);
    ddp_rpc_message m = {.payload = &h, .payload_bytes = sizeof h};
    if (s == DDP_OK) s = ddp_rpc_sync(self_agent, to, "hold", &m, 30, NULL);
  } else {
    s = call_cmd(from, "pass", &c, NULL);
  }
  RT_CHECK(res, s == DDP_OK, "pass %s -> %s: %s", from, to, ddp_last_error());
}

static ddp_rref *make(rt_result *res, float marker) {
  ddp_rref *r = NULL;
  ddp_rpc_message a = {.payload = &marker, .payload_bytes = sizeof marker};
  ddp_status s = ddp_rref_remote(self_agent, "w0", "make", &a, 30, &r);
  RT_CHECK(res, s == DDP_OK, "remote: %s", ddp_last_error());
  return r;
}

static void check_fetch(rt_result *res, const char *who, int slot, int marker) {
  cmd c = {.slot = slot};
  int64_t w[4] = {0};
  ddp_status s = call_cmd(who, "fetch", &c, w);
  RT_CHECK(res, s == DDP_OK && w[0] == marker, "fetch on %s: %lld (%s), expected %d", who,
           (long long)w[0], s == DDP_OK ? "ok" : ddp_last_error(), marker);
}

/* Three holders (w1 the creator, w2 a child of w1's, w0 the owner through
 * w2) dropped in order `perm`: freed exactly at the third drop. */
static void three_holders(rt_result *res, int marker, const int perm[3], bool early) {
  slots[0] = make(res, (float)marker);
  if (!slots[0]) return;
  pass(res, "w1", 0, "w2", 1);
  if (early) {
    /* Dropped before the child is confirmed: G2 keeps the value. */
    drop(res, "w1", 0);
    char step[96];
    snprintf(step, sizeof step, "marker %d, w1 dropped before its child was confirmed", marker);
    expect_owner(res, expected_frees, marker, false, step);
  }
  check_fetch(res, "w2", 1, marker);
  pass(res, "w2", 1, "w0", 2);
  static const char *who[3] = {"w1", "w2", "w0"};
  static const int slot_of[3] = {0, 1, 2};
  char step[96];
  int dropped = early ? 1 : 0;
  for (int i = 0; i < 3; i++) {
    int h = perm[i];
    if (early && h == 0) continue;
    drop(res, who[h], slot_of[h]);
    dropped++;
    bool last = dropped == 3;
    if (last) expected_frees++;
    snprintf(step, sizeof step, "marker %d, order %d%d%d%s, after dropping %s's", marker, perm[0],
             perm[1], perm[2], early ? " (w1 first, early)" : "", who[h]);
    expect_owner(res, expected_frees, marker, last, step);
    if (!last && h != 0 && slots[0]) check_fetch(res, "w1", 0, marker);
  }
}

static void driver(rt_result *res) {
  /* Create, use, drop. */
  slots[0] = make(res, 1);
  RT_CHECK(res, slots[0] && !ddp_rref_is_owner(slots[0]) && ddp_rref_owner(slots[0]) == 0 &&
                    !strcmp(ddp_rref_owner_name(slots[0]), "w0"),
           "owner, owner_name, is_owner");
  check_fetch(res, "w1", 0, 1);
  float a = 0.5f, sum = 0;
  ddp_rpc_message m = {.payload = &a, .payload_bytes = sizeof a}, out;
  ddp_status s = ddp_rref_rpc_sync(slots[0], "add", &m, 30, &out);
  RT_CHECK(res, s == DDP_OK && out.payload_bytes == 4, "method add: %s", ddp_last_error());
  if (s == DDP_OK) memcpy(&sum, out.payload, 4), ddp_rpc_message_free(&out);
  RT_CHECK(res, sum == 1.5f, "add gave %g, expected 1.5", sum);
  void *v = (void *)1;
  s = ddp_rref_local_value(slots[0], &v);
  RT_CHECK(res, s == DDP_ERR_STATE && !v && strstr(ddp_last_error(), "'w0'"),
           "local_value off the owner: %s", ddp_last_error());
  expect_owner(res, 0, 1, false, "created and used");
  drop(res, "w1", 0);
  expected_frees++;
  expect_owner(res, expected_frees, 1, true, "created, used, dropped");

  /* Dropped at once, before the owner confirmed it. */
  slots[0] = make(res, 2);
  drop(res, "w1", 0);
  expected_frees++;
  expect_owner(res, expected_frees, 2, true, "dropped before confirmation");

  /* Three holders, every order of drops, and the parent dropping before
   * its child is confirmed. */
  static const int perms[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                  {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
  for (int p = 0; p < 6; p++) three_holders(res, 10 + p, perms[p], false);
  three_holders(res, 20, perms[0], true);
  three_holders(res, 21, perms[1], true);

  /* Owner to user: the owner's own reference dropped first, then the user's. */
  cmd c = {.slot = 5, .marker = 30};
  ddp_rpc_message cm = {.payload = &c, .payload_bytes = sizeof c};
  s = ddp_rpc_sync(self_agent, "w0", "share", &cm, 30, &out);
  RT_CHECK(res, s == DDP_OK && out.payload_bytes == DDP_RREF_TOKEN_BYTES, "share: %s",
           ddp_last_error());
  if (s == DDP_OK) {
    s = ddp_rref_from_token(self_agent, out.payload, &slots[6]);
    RT_CHECK(res, s == DDP_OK, "from_token: %s", ddp_last_error());
    ddp_rpc_message_free(&out);
    drop(res, "w0", 5);
    expect_owner(res, expected_frees, 30, false, "owner-made, owner's reference dropped");
    check_fetch(res, "w1", 6, 30);
    /* Passed on by the user to a third worker, then the user drops. */
    pass(res, "w1", 6, "w2", 7);
    drop(res, "w1", 6);
    expect_owner(res, expected_frees, 30, false, "owner-made, passed to w2, w1 dropped");
    drop(res, "w2", 7);
    expected_frees++;
    expect_owner(res, expected_frees, 30, true, "owner-made, last reference dropped");
  }

  /* A ctor that fails: every use says why; dropping leaks nothing. */
  ddp_rref *bad = NULL;
  s = ddp_rref_remote(self_agent, "w0", "fail", NULL, 30, &bad);
  RT_CHECK(res, s == DDP_OK, "remote fail: %s", ddp_last_error());
  if (bad) {
    s = ddp_rref_to_here(bad, 30, &out);
    RT_CHECK(res, s == DDP_ERR_INVALID && strstr(ddp_last_error(), "not 42") &&
                      strstr(ddp_last_error(), "'fail'"),
             "to_here of a failed ctor: %s (%s)", ddp_status_name(s), ddp_last_error());
    ddp_rref_release(bad);
  }
  /* An unknown ctor likewise. */
  s = ddp_rref_remote(self_agent, "w0", "nope", NULL, 30, &bad);
  if (s == DDP_OK) {
    s = ddp_rref_to_here(bad, 30, &out);
    RT_CHECK(res, s == DDP_ERR_NOTFOUND && strstr(ddp_last_error(), "'nope'"),
             "to_here of an unknown ctor: %s", ddp_last_error());
    ddp_rref_release(bad);
  }
  flush_all(res);
  int64_t w[4] = {0};
  c = (cmd){0};
  s = call_cmd("w0", "stats", &c, w);
  RT_CHECK(res, s == DDP_OK && w[2] == 0, "values alive on the owner at the end: %lld",
           (long long)w[2]);
  RT_CHECK(res, w[0] == expected_frees, "frees %lld, expected %lld", (long long)w[0],
           (long long)expected_frees);
}

static void lifetimes_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  self_agent = a;
  if (rank == 1) driver(res);
}

static void test_lifetimes(void **state) {
  (void)state;
  register_all();
  /* The owner registers each fork request 200 ms late: a parent that let go
   * before its child is known would free the value (G2). */
  setenv("DDP_RREF_TEST_FORK_DELAY_MS", "200", 1);
  rt_config cfg = {.threads = 4, .graceful = true};
  rt_run(3, &cfg, lifetimes_fn, NULL, 120);
}

/* ---- A leak named at shutdown ------------------------------------------------- */

static void leak_fn(int rank, int size, ddp_rpc_agent *a, rt_result *res, void *arg) {
  (void)size, (void)arg;
  self_agent = a;
  ddp_rref *kept = NULL;
  char name[160] = "";
  if (rank == 1) {
    kept = slots[0] = make(res, 7);
    if (kept) snprintf(name, sizeof name, "%s", ddp_rref_name(kept));
    check_fetch(res, "w1", 0, 7);
  }
  /* stderr to a file around the shutdown, to read what it says. */
  char path[64];
  snprintf(path, sizeof path, "/tmp/test_rref_leak_%d_%d.txt", (int)getpid(), rank);
  fflush(stderr);
  int saved = dup(2);
  int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
  dup2(fd, 2);
  ddp_status s = ddp_rpc_shutdown(a, true, 30);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  RT_CHECK(res, s == DDP_OK, "shutdown: %s", ddp_last_error());
  char text[4096] = "";
  FILE *f = fopen(path, "r");
  if (f) {
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    fclose(f);
  }
  unlink(path);
  fputs(text, stderr);
  if (rank == 1)
    RT_CHECK(res, name[0] && strstr(text, name) && strstr(text, "still held at shutdown"),
             "w1's shutdown does not name %s: '%.600s'", name, text);
  if (rank == 0)
    RT_CHECK(res, strstr(text, "freed at shutdown") && strstr(text, "rank(s) 1"),
             "the owner's shutdown does not name the reference held on rank 1: '%.600s'", text);
  if (rank == 2) RT_CHECK(res, !strstr(text, "rref"), "w2 reports a leak: '%.600s'", text);
}

static void test_leak_named(void **state) {
  (void)state;
  unsetenv("DDP_RREF_TEST_FORK_DELAY_MS");
  register_all();
  rt_config cfg = {.threads = 4, .graceful = true, .no_shutdown = true};
  rt_run(3, &cfg, leak_fn, NULL, 60);
}

static int setup(void **state) {
  (void)state;
  return rt_start_store();
}

static int teardown(void **state) {
  (void)state;
  rt_stop_store();
  return 0;
}

/* ---- One registry: rpc's named tables behind every register call ------- */

static ddp_status grow_ctor(ddp_rpc_call *call, const ddp_rpc_message *args, ddp_rref_value *out,
                            void *user) {
  (void)call, (void)args, (void)out, (void)user;
  return DDP_OK;
}
static ddp_status grow_method(ddp_rpc_call *call, void *value, const ddp_rpc_message *args,
                              ddp_rpc_message *reply, void *user) {
  (void)call, (void)value, (void)args, (void)reply, (void)user;
  return DDP_OK;
}
static ddp_status grow_dist(ddp_dist_call *call, const ddp_rpc_message *args, ddp_rpc_message *reply,
                            void *user) {
  (void)call, (void)args, (void)reply, (void)user;
  return DDP_OK;
}

/* The RRef and dist_autograd registries had fixed tables of 128 that took
 * any bytes: now 300 of each register, and a name that breaks rpc's rule
 * (a space, or 64 bytes) is refused naming the rule. */
static void test_registries_grow_and_validate(void **state) {
  (void)state;
  char name[64];
  for (int i = 0; i < 300; i++) {
    snprintf(name, sizeof name, "grow.ctor.%d", i);
    assert_int_equal(ddp_rref_register_ctor(name, grow_ctor, NULL), DDP_OK);
    snprintf(name, sizeof name, "grow.method.%d", i);
    assert_int_equal(ddp_rref_register_method(name, grow_method, NULL), DDP_OK);
    snprintf(name, sizeof name, "grow.dist.%d", i);
    assert_int_equal(ddp_dist_register(name, grow_dist, NULL), DDP_OK);
  }
  assert_int_equal(ddp_rref_register_ctor("has space", grow_ctor, NULL), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "has the character ' '"));
  char long_name[80];
  memset(long_name, 'x', 64);
  long_name[64] = '\0';
  assert_int_equal(ddp_dist_register(long_name, grow_dist, NULL), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "at most 63"));
  assert_int_equal(ddp_rref_register_method("", grow_method, NULL), DDP_ERR_INVALID);
  assert_int_equal(ddp_rref_register_ctor("grow.null", NULL, NULL), DDP_ERR_INVALID);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lifetimes),
      cmocka_unit_test(test_leak_named),
      cmocka_unit_test(test_registries_grow_and_validate),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
