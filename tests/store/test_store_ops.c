/* store: one suite of every operation, run against each kind of store
 * through the abstract handle -- in-process (mem), TCP (a live server on
 * loopback), file (a temporary file), and prefix stores over mem and TCP.
 * Blocking calls are checked both woken by another thread's write and timing
 * out (200 ms). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "store/store_test_util.h"

#define SHORT_MS 200

typedef struct fixture {
  ddp_store *store;
  ddp_store *base;          /* prefix stores: the base handle */
  ddp_store_server *server; /* tcp */
  char path[256];           /* file */
} fixture;

static fixture *fx(void **state) { return *state; }

static int setup_mem(void **state) {
  fixture *f = calloc(1, sizeof *f);
  ddp_store_options o = {.timeout_ms = 10000};
  if (ddp_store_mem_create(&o, &f->store) != DDP_OK) return -1;
  *state = f;
  return 0;
}

static int setup_tcp(void **state) {
  fixture *f = calloc(1, sizeof *f);
  ddp_store_server_options so = {.token = ""};
  if (ddp_store_server_start("127.0.0.1", 0, &so, &f->server) != DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    return -1;
  }
  ddp_store_options o = {.timeout_ms = 10000, .token = ""};
  if (ddp_store_tcp_connect("127.0.0.1", ddp_store_server_port(f->server), &o, &f->store) !=
      DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    return -1;
  }
  *state = f;
  return 0;
}

static int setup_file(void **state) {
  fixture *f = calloc(1, sizeof *f);
  snprintf(f->path, sizeof f->path, "/tmp/ddp_store_test_%d_XXXXXX", (int)getpid());
  int fd = mkstemp(f->path);
  if (fd < 0) return -1;
  close(fd);
  unlink(f->path); /* the store creates it */
  ddp_store_options o = {.timeout_ms = 10000};
  if (ddp_store_file_open(f->path, &o, &f->store) != DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    return -1;
  }
  *state = f;
  return 0;
}

/* A prefix store over the fixture's store; the base keeps a noise key so
 * counts prove the namespace. */
static int wrap_prefix(void **state) {
  fixture *f = *state;
  f->base = f->store;
  if (ddp_store_set(f->base, "noise", "x", 1) != DDP_OK) return -1;
  if (ddp_store_prefix(f->base, "group3/", &f->store) != DDP_OK) return -1;
  return 0;
}

static int setup_prefix_mem(void **state) { return setup_mem(state) || wrap_prefix(state); }
static int setup_prefix_tcp(void **state) { return setup_tcp(state) || wrap_prefix(state); }

static int teardown(void **state) {
  fixture *f = *state;
  ddp_store_destroy(f->store);
  ddp_store_destroy(f->base);
  ddp_store_server_stop(f->server);
  if (f->path[0]) unlink(f->path);
  free(f);
  return 0;
}

static void expect_store_value(ddp_store *s, const char *key, const void *want, size_t want_bytes) {
  void *v = NULL;
  size_t n = 0;
  ddp_status st = ddp_store_get(s, key, 1000, &v, &n);
  if (st != DDP_OK) fail_msg("get(%s): %s", key, ddp_last_error());
  assert_int_equal(n, want_bytes);
  assert_memory_equal(v, want, want_bytes);
  assert_int_equal(((char *)v)[n], '\0');
  ddp_free(v);
}

/* ---- The suite ----------------------------------------------------------- */

static void test_set_get(void **state) {
  ddp_store *s = fx(state)->store;
  assert_int_equal(ddp_store_set(s, "a", "hello", 5), DDP_OK);
  expect_store_value(s, "a", "hello", 5);
  assert_int_equal(ddp_store_set(s, "a", "bye", 3), DDP_OK); /* overwrite */
  expect_store_value(s, "a", "bye", 3);
  const uint8_t bin[6] = {0, 1, 0xff, 0, '\n', 7};
  assert_int_equal(ddp_store_set(s, "bin", bin, sizeof bin), DDP_OK);
  expect_store_value(s, "bin", bin, sizeof bin);
  assert_int_equal(ddp_store_set(s, "empty", NULL, 0), DDP_OK);
  expect_store_value(s, "empty", "", 0);
  /* A 1 MiB value round-trips intact. */
  size_t big = 1 << 20;
  uint8_t *data = malloc(big);
  for (size_t i = 0; i < big; i++) data[i] = (uint8_t)(i * 31 + 7);
  assert_int_equal(ddp_store_set(s, "big", data, big), DDP_OK);
  expect_store_value(s, "big", data, big);
  free(data);
}

static void test_get_times_out(void **state) {
  ddp_store *s = fx(state)->store;
  void *v = (void *)1;
  size_t n = 99;
  int64_t t0 = test_now_ms();
  ddp_status st = ddp_store_get(s, "never", SHORT_MS, &v, &n);
  int64_t took = test_now_ms() - t0;
  assert_int_equal(st, DDP_ERR_TIMEOUT);
  assert_null(v);
  assert_int_equal(n, 0);
  assert_true(took >= SHORT_MS - 20);
  assert_true(took < SHORT_MS + 1000);
  const char *msg = ddp_last_error();
  assert_non_null(strstr(msg, ddp_store_address(s)));
  assert_non_null(strstr(msg, "get(\"never\") timed out after 200 ms"));
  /* Timeout 0: fails at once. */
  t0 = test_now_ms();
  assert_int_equal(ddp_store_get(s, "never", 0, &v, &n), DDP_ERR_TIMEOUT);
  assert_true(test_now_ms() - t0 < 150);
}

static void test_get_woken_by_set(void **state) {
  ddp_store *s = fx(state)->store;
  delayed_set d = {.delay_ms = 150, .keys = {"late"}, .values = {"v1"}, .num_keys = 1};
  assert_int_equal(delayed_set_start(&d, s), DDP_OK);
  int64_t t0 = test_now_ms();
  void *v = NULL;
  size_t n = 0;
  ddp_status st = ddp_store_get(s, "late", 5000, &v, &n);
  int64_t took = test_now_ms() - t0;
  assert_int_equal(delayed_set_join(&d), DDP_OK);
  if (st != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(n, 2);
  assert_memory_equal(v, "v1", 2);
  ddp_free(v);
  assert_true(took >= 100); /* it did block */
  assert_true(took < 2000); /* and was woken, not timed out */
}

static void test_wait_woken_and_timeout(void **state) {
  ddp_store *s = fx(state)->store;
  delayed_set d = {.delay_ms = 150, .keys = {"w1", "w2"}, .values = {"1", "2"}, .num_keys = 2};
  assert_int_equal(delayed_set_start(&d, s), DDP_OK);
  const char *keys[] = {"w1", "w2"};
  int64_t t0 = test_now_ms();
  ddp_status st = ddp_store_wait(s, keys, 2, 5000);
  int64_t took = test_now_ms() - t0;
  assert_int_equal(delayed_set_join(&d), DDP_OK);
  if (st != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_true(took >= 100 && took < 2000);

  const char *some_missing[] = {"w1", "nope"};
  t0 = test_now_ms();
  st = ddp_store_wait(s, some_missing, 2, SHORT_MS);
  took = test_now_ms() - t0;
  assert_int_equal(st, DDP_ERR_TIMEOUT);
  assert_true(took >= SHORT_MS - 20 && took < SHORT_MS + 1000);
  assert_non_null(strstr(ddp_last_error(), "wait([\"w1\", \"nope\"]) timed out after 200 ms"));
  assert_non_null(strstr(ddp_last_error(), "nope"));
  assert_int_equal(ddp_store_wait(s, keys, 0, SHORT_MS), DDP_OK); /* no keys: at once */
}

/* A wait counts a key that is deleted before the others arrive as missing
 * again: it ends only when all exist at once. */
typedef struct churn {
  ddp_store *store;
  ddp_status st;
  pthread_t thread;
} churn;

static void *churn_main(void *arg) {
  churn *c = arg;
  test_sleep_ms(100);
  c->st = ddp_store_delete(c->store, "p1", NULL);
  if (c->st == DDP_OK) c->st = ddp_store_set(c->store, "p2", "2", 1);
  test_sleep_ms(200);
  if (c->st == DDP_OK) c->st = ddp_store_set(c->store, "p1", "1", 1);
  return NULL;
}

static void test_wait_sees_deletes(void **state) {
  ddp_store *s = fx(state)->store;
  assert_int_equal(ddp_store_set(s, "p1", "1", 1), DDP_OK);
  churn c;
  assert_int_equal(ddp_store_clone(s, &c.store), DDP_OK);
  pthread_create(&c.thread, NULL, churn_main, &c);
  const char *keys[] = {"p1", "p2"};
  int64_t t0 = test_now_ms();
  ddp_status st = ddp_store_wait(s, keys, 2, 5000);
  int64_t took = test_now_ms() - t0;
  pthread_join(c.thread, NULL);
  ddp_store_destroy(c.store);
  assert_int_equal(c.st, DDP_OK);
  if (st != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_true(took >= 250 && took < 3000);
}

static void test_add(void **state) {
  ddp_store *s = fx(state)->store;
  int64_t r = 0;
  assert_int_equal(ddp_store_add(s, "count", 5, &r), DDP_OK);
  assert_int_equal(r, 5);
  assert_int_equal(ddp_store_add(s, "count", -7, &r), DDP_OK);
  assert_int_equal(r, -2);
  expect_store_value(s, "count", "-2", 2); /* decimal text, as PyTorch stores it */
  assert_int_equal(ddp_store_add(s, "count", 0, NULL), DDP_OK);
  assert_int_equal(ddp_store_set(s, "text", "abc", 3), DDP_OK);
  assert_int_equal(ddp_store_add(s, "text", 1, &r), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "add(\"text\"): value \"abc\" is not an integer"));
  assert_int_equal(ddp_store_set(s, "max", "9223372036854775807", 19), DDP_OK);
  assert_int_equal(ddp_store_add(s, "max", 1, &r), DDP_ERR_RANGE);
  assert_int_equal(ddp_store_add(s, "max", -1, &r), DDP_OK);
  assert_true(r == INT64_MAX - 1);
}

/* PyTorch's compareSet, case by case. */
static void test_compare_set(void **state) {
  ddp_store *s = fx(state)->store;
  void *cur = NULL;
  size_t n = 0;
  /* Absent, expected non-empty: nothing set, returns expected. */
  assert_int_equal(ddp_store_compare_set(s, "cas", "x", 1, "new", 3, &cur, &n), DDP_OK);
  assert_int_equal(n, 1);
  assert_memory_equal(cur, "x", 1);
  ddp_free(cur);
  int all = 1;
  const char *k[] = {"cas"};
  assert_int_equal(ddp_store_check(s, k, 1, &all), DDP_OK);
  assert_int_equal(all, 0);
  /* Absent, expected empty: set-if-absent. */
  assert_int_equal(ddp_store_compare_set(s, "cas", "", 0, "v1", 2, &cur, &n), DDP_OK);
  assert_int_equal(n, 2);
  assert_memory_equal(cur, "v1", 2);
  ddp_free(cur);
  expect_store_value(s, "cas", "v1", 2);
  /* Present, matching: swapped. */
  assert_int_equal(ddp_store_compare_set(s, "cas", "v1", 2, "v2", 2, &cur, &n), DDP_OK);
  assert_memory_equal(cur, "v2", 2);
  ddp_free(cur);
  /* Present, not matching: unchanged, returns the current value. */
  assert_int_equal(ddp_store_compare_set(s, "cas", "zz", 2, "v3", 2, &cur, &n), DDP_OK);
  assert_memory_equal(cur, "v2", 2);
  ddp_free(cur);
  expect_store_value(s, "cas", "v2", 2);
  /* Present, expected empty: no match (the value is not empty). */
  assert_int_equal(ddp_store_compare_set(s, "cas", "", 0, "v4", 2, NULL, NULL), DDP_OK);
  expect_store_value(s, "cas", "v2", 2);
}

static void test_check_and_delete(void **state) {
  ddp_store *s = fx(state)->store;
  assert_int_equal(ddp_store_set(s, "d1", "1", 1), DDP_OK);
  assert_int_equal(ddp_store_set(s, "d2", "2", 1), DDP_OK);
  const char *both[] = {"d1", "d2"}, *one_missing[] = {"d1", "d3"};
  int all = 0;
  assert_int_equal(ddp_store_check(s, both, 2, &all), DDP_OK);
  assert_int_equal(all, 1);
  assert_int_equal(ddp_store_check(s, one_missing, 2, &all), DDP_OK);
  assert_int_equal(all, 0);
  int deleted = -1;
  assert_int_equal(ddp_store_delete(s, "d1", &deleted), DDP_OK);
  assert_int_equal(deleted, 1);
  assert_int_equal(ddp_store_delete(s, "d1", &deleted), DDP_OK);
  assert_int_equal(deleted, 0);
  assert_int_equal(ddp_store_check(s, both, 2, &all), DDP_OK);
  assert_int_equal(all, 0);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(s, "d1", 0, &v, &n), DDP_ERR_TIMEOUT);
  /* A get blocked on a deleted key is woken by its next set. */
  delayed_set d = {.delay_ms = 100, .keys = {"d1"}, .values = {"again"}, .num_keys = 1};
  assert_int_equal(delayed_set_start(&d, s), DDP_OK);
  assert_int_equal(ddp_store_get(s, "d1", 5000, &v, &n), DDP_OK);
  assert_int_equal(delayed_set_join(&d), DDP_OK);
  assert_memory_equal(v, "again", 5);
  ddp_free(v);
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static void test_num_keys_and_list_keys(void **state) {
  ddp_store *s = fx(state)->store;
  int64_t count = -1;
  assert_int_equal(ddp_store_num_keys(s, &count), DDP_OK);
  assert_int_equal(count, 0);
  char **keys = NULL;
  size_t n = 99;
  assert_int_equal(ddp_store_list_keys(s, &keys, &n), DDP_OK);
  assert_int_equal(n, 0);
  ddp_store_keys_free(keys, n);
  assert_int_equal(ddp_store_set(s, "k2", "b", 1), DDP_OK);
  assert_int_equal(ddp_store_set(s, "k1", "a", 1), DDP_OK);
  assert_int_equal(ddp_store_add(s, "k3", 1, NULL), DDP_OK);
  assert_int_equal(ddp_store_num_keys(s, &count), DDP_OK);
  assert_int_equal(count, 3);
  assert_int_equal(ddp_store_list_keys(s, &keys, &n), DDP_OK);
  assert_int_equal(n, 3);
  qsort(keys, n, sizeof *keys, cmp_str);
  assert_string_equal(keys[0], "k1");
  assert_string_equal(keys[1], "k2");
  assert_string_equal(keys[2], "k3");
  ddp_store_keys_free(keys, n);
  assert_int_equal(ddp_store_delete(s, "k2", NULL), DDP_OK);
  assert_int_equal(ddp_store_num_keys(s, &count), DDP_OK);
  assert_int_equal(count, 2);
}

static void test_append(void **state) {
  ddp_store *s = fx(state)->store;
  assert_int_equal(ddp_store_append(s, "log", "ab", 2), DDP_OK); /* creates */
  assert_int_equal(ddp_store_append(s, "log", "cd", 2), DDP_OK);
  assert_int_equal(ddp_store_append(s, "log", NULL, 0), DDP_OK);
  expect_store_value(s, "log", "abcd", 4);
  for (int i = 0; i < 100; i++) assert_int_equal(ddp_store_append(s, "many", "xyz", 3), DDP_OK);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(s, "many", 0, &v, &n), DDP_OK);
  assert_int_equal(n, 300);
  ddp_free(v);
}

static void test_multi_get_set(void **state) {
  ddp_store *s = fx(state)->store;
  const char *keys[] = {"m1", "m2", "m3"};
  ddp_store_value in[3] = {{"one", 3}, {"", 0}, {"three", 5}};
  assert_int_equal(ddp_store_multi_set(s, keys, in, 3), DDP_OK);
  ddp_store_value out[3];
  assert_int_equal(ddp_store_multi_get(s, keys, 3, 1000, out), DDP_OK);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(out[i].bytes, in[i].bytes);
    assert_memory_equal(out[i].data, in[i].data, in[i].bytes);
  }
  ddp_store_values_free(out, 3);
  assert_null(out[0].data);
  /* Missing key: times out, no values left behind. */
  const char *some[] = {"m1", "m9"};
  assert_int_equal(ddp_store_multi_get(s, some, 2, SHORT_MS, out), DDP_ERR_TIMEOUT);
  assert_null(out[0].data);
  assert_null(out[1].data);
  /* Woken by a later set. */
  delayed_set d = {.delay_ms = 100, .keys = {"m9"}, .values = {"nine"}, .num_keys = 1};
  assert_int_equal(delayed_set_start(&d, s), DDP_OK);
  assert_int_equal(ddp_store_multi_get(s, some, 2, 5000, out), DDP_OK);
  assert_int_equal(delayed_set_join(&d), DDP_OK);
  assert_memory_equal(out[1].data, "nine", 4);
  ddp_store_values_free(out, 2);
}

/* Eight threads add concurrently (each on its own handle): no lost update. */
typedef struct adder {
  ddp_store *store;
  pthread_t thread;
  ddp_status st;
} adder;

static void *adder_main(void *arg) {
  adder *a = arg;
  a->st = DDP_OK;
  for (int i = 0; i < 200 && a->st == DDP_OK; i++) a->st = ddp_store_add(a->store, "sum", 1, NULL);
  return NULL;
}

static void test_concurrent_add(void **state) {
  ddp_store *s = fx(state)->store;
  adder a[8];
  for (int i = 0; i < 8; i++) {
    assert_int_equal(ddp_store_clone(s, &a[i].store), DDP_OK);
    pthread_create(&a[i].thread, NULL, adder_main, &a[i]);
  }
  for (int i = 0; i < 8; i++) {
    pthread_join(a[i].thread, NULL);
    assert_int_equal(a[i].st, DDP_OK);
    ddp_store_destroy(a[i].store);
  }
  int64_t r;
  assert_int_equal(ddp_store_add(s, "sum", 0, &r), DDP_OK);
  assert_int_equal(r, 1600);
}

static void test_bad_arguments(void **state) {
  ddp_store *s = fx(state)->store;
  assert_int_equal(ddp_store_set(s, "", "x", 1), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "the key is empty"));
  assert_int_equal(ddp_store_set(s, NULL, "x", 1), DDP_ERR_INVALID);
  assert_int_equal(ddp_store_set(s, "k", NULL, 3), DDP_ERR_INVALID);
  char *long_key = malloc(DDP_STORE_MAX_KEY_BYTES + 2);
  memset(long_key, 'k', DDP_STORE_MAX_KEY_BYTES + 1);
  long_key[DDP_STORE_MAX_KEY_BYTES + 1] = '\0';
  assert_int_equal(ddp_store_set(s, long_key, "x", 1), DDP_ERR_RANGE);
  assert_non_null(strstr(ddp_last_error(), "exceeds the limit of 4096"));
  free(long_key);
  /* The store still works afterwards. */
  assert_int_equal(ddp_store_set(s, "ok", "1", 1), DDP_OK);
  expect_store_value(s, "ok", "1", 1);
}

/* ---- Prefix isolation ----------------------------------------------------- */

static void test_prefix_isolation(void **state) {
  fixture *f = fx(state);
  ddp_store *other;
  assert_int_equal(ddp_store_prefix(f->base, "group4/", &other), DDP_OK);
  assert_int_equal(ddp_store_set(f->store, "k", "three", 5), DDP_OK);
  assert_int_equal(ddp_store_set(other, "k", "four", 4), DDP_OK);
  expect_store_value(f->store, "k", "three", 5);
  expect_store_value(other, "k", "four", 4);
  expect_store_value(f->base, "group3/k", "three", 5);
  int64_t count;
  assert_int_equal(ddp_store_num_keys(f->store, &count), DDP_OK);
  assert_int_equal(count, 1); /* not "noise", not group4's */
  char **keys;
  size_t n;
  assert_int_equal(ddp_store_list_keys(other, &keys, &n), DDP_OK);
  assert_int_equal(n, 1);
  assert_string_equal(keys[0], "k");
  ddp_store_keys_free(keys, n);
  int deleted;
  assert_int_equal(ddp_store_delete(other, "k", &deleted), DDP_OK);
  expect_store_value(f->store, "k", "three", 5);
  /* Errors name the namespace. */
  void *v;
  size_t vn;
  assert_int_equal(ddp_store_get(other, "k", 0, &v, &vn), DDP_ERR_TIMEOUT);
  assert_non_null(strstr(ddp_last_error(), "prefix \"group4/\": get(\"k\")"));
  /* The prefix keeps its base alive after the caller lets go of it. */
  ddp_store *base = f->base;
  f->base = NULL;
  ddp_store_destroy(base);
  expect_store_value(f->store, "k", "three", 5);
  ddp_store_destroy(other);
}

#define SUITE(setup)                                                                 \
  cmocka_unit_test_setup_teardown(test_set_get, setup, teardown),                    \
      cmocka_unit_test_setup_teardown(test_get_times_out, setup, teardown),          \
      cmocka_unit_test_setup_teardown(test_get_woken_by_set, setup, teardown),       \
      cmocka_unit_test_setup_teardown(test_wait_woken_and_timeout, setup, teardown), \
      cmocka_unit_test_setup_teardown(test_wait_sees_deletes, setup, teardown),      \
      cmocka_unit_test_setup_teardown(test_add, setup, teardown),                    \
      cmocka_unit_test_setup_teardown(test_compare_set, setup, teardown),            \
      cmocka_unit_test_setup_teardown(test_check_and_delete, setup, teardown),       \
      cmocka_unit_test_setup_teardown(test_num_keys_and_list_keys, setup, teardown), \
      cmocka_unit_test_setup_teardown(test_append, setup, teardown),                 \
      cmocka_unit_test_setup_teardown(test_multi_get_set, setup, teardown),          \
      cmocka_unit_test_setup_teardown(test_concurrent_add, setup, teardown),         \
      cmocka_unit_test_setup_teardown(test_bad_arguments, setup, teardown)

int main(int argc, char **argv) {
  /* argv[1] picks one kind (ctest runs each as its own test). */
  const char *kind = argc > 1 ? argv[1] : "all";
  const struct CMUnitTest mem[] = {SUITE(setup_mem)};
  const struct CMUnitTest tcp[] = {SUITE(setup_tcp)};
  const struct CMUnitTest file[] = {SUITE(setup_file)};
  const struct CMUnitTest prefix[] = {
      SUITE(setup_prefix_mem),
      SUITE(setup_prefix_tcp),
      cmocka_unit_test_setup_teardown(test_prefix_isolation, setup_prefix_mem, teardown),
      cmocka_unit_test_setup_teardown(test_prefix_isolation, setup_prefix_tcp, teardown),
  };
  int failed = 0;
  int all = !strcmp(kind, "all");
  if (all || !strcmp(kind, "mem"))
    failed += cmocka_run_group_tests_name("store mem", mem, NULL, NULL);
  if (all || !strcmp(kind, "tcp"))
    failed += cmocka_run_group_tests_name("store tcp", tcp, NULL, NULL);
  if (all || !strcmp(kind, "file"))
    failed += cmocka_run_group_tests_name("store file", file, NULL, NULL);
  if (all || !strcmp(kind, "prefix"))
    failed += cmocka_run_group_tests_name("store prefix", prefix, NULL, NULL);
  return failed ? 1 : 0;
}
