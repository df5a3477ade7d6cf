/* store: differential test. 4,000 random operations over a small key space
 * run against the TCP store and the file store, each checked against a plain
 * model kept in this file (an array of keys, with PyTorch's semantics written
 * out directly), so the three implementations of the semantics -- the
 * server's, the file log's and the model's -- must agree call by call. */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/store.h"

enum { NKEYS = 12, MAXV = 64, OPS = 20000 };

typedef struct model {
  int present[NKEYS];
  char value[NKEYS][MAXV * 8];
  size_t len[NKEYS];
} model;

static const char *key_name(int i) {
  static const char *names[NKEYS] = {"a",   "b",   "c",   "d", "e",       "f",
                                     "g/1", "g/2", "g/3", "h", "counter", "x"};
  return names[i];
}

/* The value as add reads it: 0 when absent; -1 when not a decimal int64
 * (optional '-', then digits), -2 when out of range. */
static int model_int(const model *m, int k, int64_t *out) {
  *out = 0;
  if (!m->present[k]) return 0;
  char buf[MAXV * 8 + 1];
  memcpy(buf, m->value[k], m->len[k]);
  buf[m->len[k]] = '\0';
  size_t i = buf[0] == '-' ? 1 : 0;
  if (buf[i] == '\0') return -1;
  for (; buf[i]; i++)
    if (buf[i] < '0' || buf[i] > '9') return -1;
  errno = 0;
  long long v = strtoll(buf, NULL, 10);
  if (errno == ERANGE) return -2;
  *out = v;
  return 0;
}

static void random_value(ddp_rng *rng, char *v, size_t *len) {
  /* Mostly small integers (so add has work), sometimes text or empty. */
  switch (ddp_rng_below(rng, 4)) {
    case 0: *len = (size_t)snprintf(v, MAXV, "%d", (int)ddp_rng_below(rng, 200) - 100); break;
    case 1: *len = 0; break;
    default:
      *len = 1 + ddp_rng_below(rng, 8);
      for (size_t i = 0; i < *len; i++) v[i] = (char)('a' + ddp_rng_below(rng, 3));
  }
}

static void expect_get(ddp_store *s, const model *m, int k) {
  void *v = NULL;
  size_t n = 0;
  ddp_status st = ddp_store_get(s, key_name(k), 0, &v, &n);
  if (m->present[k]) {
    if (st != DDP_OK) fail_msg("get(%s): %s", key_name(k), ddp_last_error());
    assert_int_equal(n, m->len[k]);
    assert_memory_equal(v, m->value[k], n);
  } else {
    assert_int_equal(st, DDP_ERR_TIMEOUT);
  }
  ddp_free(v);
}

static void run_ops(ddp_store *s, uint64_t seed) {
  model m;
  memset(&m, 0, sizeof m);
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int op = 0; op < OPS; op++) {
    int k = (int)ddp_rng_below(&rng, NKEYS);
    const char *key = key_name(k);
    char v[MAXV], e[MAXV];
    size_t vl, el;
    switch (ddp_rng_below(&rng, 10)) {
      case 0: /* set */
        random_value(&rng, v, &vl);
        assert_int_equal(ddp_store_set(s, key, v, vl), DDP_OK);
        memcpy(m.value[k], v, vl);
        m.len[k] = vl;
        m.present[k] = 1;
        break;
      case 1: /* get */ expect_get(s, &m, k); break;
      case 2: { /* add */
        int64_t delta = (int64_t)ddp_rng_below(&rng, 21) - 10, got = 0, cur;
        ddp_status st = ddp_store_add(s, key, delta, &got);
        int rc = model_int(&m, k, &cur);
        if (rc != 0) {
          assert_int_equal(st, rc == -1 ? DDP_ERR_FORMAT : DDP_ERR_RANGE);
        } else {
          if (st != DDP_OK) fail_msg("op %d add(%s): %s", op, key, ddp_last_error());
          assert_true(got == cur + delta);
          m.len[k] = (size_t)snprintf(m.value[k], MAXV, "%" PRId64, cur + delta);
          m.present[k] = 1;
        }
        break;
      }
      case 3: { /* compare_set */
        if (m.present[k] && ddp_rng_below(&rng, 2)) {
          memcpy(e, m.value[k], m.len[k]);
          el = m.len[k];
        } else {
          random_value(&rng, e, &el);
        }
        random_value(&rng, v, &vl);
        void *cur = NULL;
        size_t cn = 0;
        assert_int_equal(ddp_store_compare_set(s, key, e, el, v, vl, &cur, &cn), DDP_OK);
        const char *want;
        size_t wl;
        if (!m.present[k]) {
          if (el == 0) {
            memcpy(m.value[k], v, vl);
            m.len[k] = vl;
            m.present[k] = 1;
            want = v;
            wl = vl;
          } else {
            want = e;
            wl = el;
          }
        } else if (m.len[k] == el && !memcmp(m.value[k], e, el)) {
          memcpy(m.value[k], v, vl);
          m.len[k] = vl;
          want = v;
          wl = vl;
        } else {
          want = m.value[k];
          wl = m.len[k];
        }
        assert_int_equal(cn, wl);
        assert_memory_equal(cur, want, wl);
        ddp_free(cur);
        break;
      }
      case 4: { /* delete */
        int deleted = -1;
        assert_int_equal(ddp_store_delete(s, key, &deleted), DDP_OK);
        assert_int_equal(deleted, m.present[k]);
        m.present[k] = 0;
        m.len[k] = 0;
        break;
      }
      case 5: /* append */
        random_value(&rng, v, &vl);
        if (m.len[k] + vl > sizeof m.value[k]) break;
        assert_int_equal(ddp_store_append(s, key, v, vl), DDP_OK);
        if (!m.present[k]) m.len[k] = 0;
        memcpy(m.value[k] + m.len[k], v, vl);
        m.len[k] += vl;
        m.present[k] = 1;
        break;
      case 6: { /* check + wait(0) */
        const char *keys[3];
        int idx[3], all = 1;
        for (int i = 0; i < 3; i++) {
          idx[i] = (int)ddp_rng_below(&rng, NKEYS);
          keys[i] = key_name(idx[i]);
          all &= m.present[idx[i]];
        }
        int got = -1;
        assert_int_equal(ddp_store_check(s, keys, 3, &got), DDP_OK);
        assert_int_equal(got, all);
        assert_int_equal(ddp_store_wait(s, keys, 3, 0), all ? DDP_OK : DDP_ERR_TIMEOUT);
        break;
      }
      case 7: { /* multi_set + multi_get */
        const char *keys[3];
        ddp_store_value vals[3];
        char bufs[3][MAXV];
        int idx[3];
        for (int i = 0; i < 3; i++) {
          idx[i] = (int)ddp_rng_below(&rng, NKEYS);
          keys[i] = key_name(idx[i]);
          random_value(&rng, bufs[i], &vals[i].bytes);
          vals[i].data = bufs[i];
        }
        assert_int_equal(ddp_store_multi_set(s, keys, vals, 3), DDP_OK);
        for (int i = 0; i < 3; i++) { /* later entries win, as applied in order */
          memcpy(m.value[idx[i]], bufs[i], vals[i].bytes);
          m.len[idx[i]] = vals[i].bytes;
          m.present[idx[i]] = 1;
        }
        ddp_store_value out[3];
        assert_int_equal(ddp_store_multi_get(s, keys, 3, 0, out), DDP_OK);
        for (int i = 0; i < 3; i++) {
          assert_int_equal(out[i].bytes, m.len[idx[i]]);
          assert_memory_equal(out[i].data, m.value[idx[i]], out[i].bytes);
        }
        ddp_store_values_free(out, 3);
        break;
      }
      case 8: { /* num_keys + list_keys */
        int64_t count = -1;
        int want = 0;
        for (int i = 0; i < NKEYS; i++) want += m.present[i];
        assert_int_equal(ddp_store_num_keys(s, &count), DDP_OK);
        assert_int_equal(count, want);
        char **keys;
        size_t n;
        assert_int_equal(ddp_store_list_keys(s, &keys, &n), DDP_OK);
        assert_int_equal(n, (size_t)want);
        for (size_t i = 0; i < n; i++) {
          int found = 0;
          for (int j = 0; j < NKEYS; j++)
            if (!strcmp(keys[i], key_name(j))) found = m.present[j];
          if (!found) fail_msg("list_keys returned %s", keys[i]);
        }
        ddp_store_keys_free(keys, n);
        break;
      }
      default: /* get of a random key */ expect_get(s, &m, (int)ddp_rng_below(&rng, NKEYS));
    }
  }
  for (int k = 0; k < NKEYS; k++) expect_get(s, &m, k);
}

static void test_tcp_matches_model(void **state) {
  (void)state;
  ddp_store_server *server;
  ddp_store_server_options so = {.token = ""};
  assert_int_equal(ddp_store_server_start("127.0.0.1", 0, &so, &server), DDP_OK);
  ddp_store_options o = {.timeout_ms = 10000, .token = ""};
  ddp_store *s;
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", ddp_store_server_port(server), &o, &s),
                   DDP_OK);
  run_ops(s, 7);
  ddp_store_destroy(s);
  ddp_store_server_stop(server);
}

static void test_file_matches_model(void **state) {
  (void)state;
  char path[128];
  snprintf(path, sizeof path, "/tmp/ddp_store_model_%d_XXXXXX", (int)getpid());
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  unlink(path);
  ddp_store_options o = {.timeout_ms = 10000};
  ddp_store *s;
  assert_int_equal(ddp_store_file_open(path, &o, &s), DDP_OK);
  run_ops(s, 8);
  ddp_store_destroy(s);
  /* A second handle replays the whole log to the same state. */
  ddp_store *again, *mem;
  assert_int_equal(ddp_store_file_open(path, &o, &again), DDP_OK);
  assert_int_equal(ddp_store_mem_create(&o, &mem), DDP_OK);
  run_ops(mem, 8); /* the same operations on the mem store: same end state */
  for (int k = 0; k < NKEYS; k++) {
    void *a = NULL, *b = NULL;
    size_t an = 0, bn = 0;
    ddp_status sa = ddp_store_get(again, key_name(k), 0, &a, &an);
    ddp_status sb = ddp_store_get(mem, key_name(k), 0, &b, &bn);
    assert_int_equal(sa, sb);
    assert_int_equal(an, bn);
    if (an) assert_memory_equal(a, b, an);
    ddp_free(a);
    ddp_free(b);
  }
  ddp_store_destroy(again);
  ddp_store_destroy(mem);
  unlink(path);
}

static void test_mem_matches_model(void **state) {
  (void)state;
  ddp_store *s;
  assert_int_equal(ddp_store_mem_create(NULL, &s), DDP_OK);
  run_ops(s, 9);
  ddp_store_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_mem_matches_model),
      cmocka_unit_test(test_tcp_matches_model),
      cmocka_unit_test(test_file_matches_model),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
