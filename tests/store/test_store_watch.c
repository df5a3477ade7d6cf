/* store (watches): every change of a key reaches every watcher, in order and
 * with its value (deletes as DELETE events), for 1,000 watchers of one key
 * (the test raises its own file limit, and says SKIP if it cannot); a
 * watcher whose connection drops (cut by a proxy in between) gets an error
 * and the others carry on; a watcher that does not read is dropped past its
 * bound with an error naming the key and the bound, while the others see
 * every change; the callback form; a prefix store's watch; and the stores
 * without watches saying so. */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cmocka.h>

#include "store/store_test_util.h"

#define MANY_WATCHERS 1000
#define CHANGES 100
#define CALLBACK_WATCHERS 3

static int many_skipped; /* the file limit could not be raised far enough */
static char many_skip_reason[256];

static ddp_store_server *start_server(const ddp_store_server_options *opts) {
  ddp_store_server *s = NULL;
  ddp_store_server_options none = {.token = ""};
  if (ddp_store_server_start("127.0.0.1", 0, opts ? opts : &none, &s) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  return s;
}

static ddp_store *connect_to(uint16_t port, int64_t timeout_ms) {
  ddp_store_options o = {.timeout_ms = timeout_ms, .token = ""};
  ddp_store *st = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", port, &o, &st) != DDP_OK) fail_msg("%s", ddp_last_error());
  return st;
}

static ddp_store_server_stats watches_eventually(ddp_store_server *s, uint64_t watches) {
  ddp_store_server_stats st;
  for (int i = 0; i < 500; i++) {
    ddp_store_server_get_stats(s, &st);
    if (st.watches == watches) break;
    test_sleep_ms(10);
  }
  return st;
}

/* Change i of the sequence: a set of "v<i>", except every 25th is a delete
 * (of the value the change before set). */
static int change_is_delete(int i) { return i % 25 == 24; }

static void apply_change(ddp_store *st, const char *key, int i) {
  if (change_is_delete(i)) {
    int deleted = 0;
    assert_int_equal(ddp_store_delete(st, key, &deleted), DDP_OK);
    assert_int_equal(deleted, 1);
  } else {
    char v[32];
    snprintf(v, sizeof v, "v%d", i);
    assert_int_equal(ddp_store_set(st, key, v, strlen(v)), DDP_OK);
  }
}

/* Checks that ev is change i (0-based) of key. */
static void expect_change(const ddp_store_event *ev, const char *key, int i) {
  assert_string_equal(ev->key, key);
  assert_int_equal(ev->seq, (uint64_t)i + 1);
  if (change_is_delete(i)) {
    assert_int_equal(ev->kind, DDP_STORE_EVENT_DELETE);
    assert_int_equal(ev->value_bytes, 0);
  } else {
    char v[32];
    snprintf(v, sizeof v, "v%d", i);
    assert_int_equal(ev->kind, DDP_STORE_EVENT_SET);
    assert_int_equal(ev->value_bytes, strlen(v));
    assert_memory_equal(ev->value, v, strlen(v));
    assert_int_equal(((const char *)ev->value)[ev->value_bytes], '\0');
  }
}

/* ---- The callback form: what each callback saw -------------------------- */

typedef struct seen {
  pthread_mutex_t mu;
  int count;      /* changes seen */
  int bad;        /* first mismatch: change index + 1 */
  int errors;     /* error callbacks */
  ddp_status last_error;
  size_t value_bytes; /* slow test: the size every change must have */
} seen;

static void record_small(void *ctx, const ddp_store_event *ev, ddp_status status) {
  seen *s = ctx;
  pthread_mutex_lock(&s->mu);
  if (!ev) {
    s->errors++;
    s->last_error = status;
  } else {
    int i = s->count++;
    char v[32];
    snprintf(v, sizeof v, "v%d", i);
    int ok = ev->seq == (uint64_t)i + 1 &&
             (change_is_delete(i)
                  ? ev->kind == DDP_STORE_EVENT_DELETE && ev->value_bytes == 0
                  : ev->kind == DDP_STORE_EVENT_SET && ev->value_bytes == strlen(v) &&
                        !memcmp(ev->value, v, strlen(v)));
    if (!ok && !s->bad) s->bad = i + 1;
  }
  pthread_mutex_unlock(&s->mu);
}

static int seen_count(seen *s) {
  pthread_mutex_lock(&s->mu);
  int n = s->count;
  pthread_mutex_unlock(&s->mu);
  return n;
}

/* ---- 1,000 watchers of one key ------------------------------------------- */

static void test_many_watchers_see_every_change_in_order(void **state) {
  (void)state;
  if (many_skipped) {
    print_message("SKIP part: %s\n", many_skip_reason);
    skip();
  }
  ddp_store_server *server = start_server(NULL);
  uint16_t port = ddp_store_server_port(server);
  ddp_store *st = connect_to(port, 10000);
  const char *key = "job/state";
  assert_int_equal(ddp_store_set(st, key, "start", 5), DDP_OK);

  ddp_store_watcher **w = calloc(MANY_WATCHERS, sizeof *w);
  assert_non_null(w);
  for (int i = 0; i < MANY_WATCHERS; i++) {
    ddp_store_value initial = {0};
    if (ddp_store_watch_open(st, &key, 1, &initial, &w[i]) != DDP_OK)
      fail_msg("watcher %d: %s", i, ddp_last_error());
    /* The snapshot is the state at registration. */
    assert_int_equal(initial.bytes, 5);
    assert_memory_equal(initial.data, "start", 5);
    ddp_store_values_free(&initial, 1);
  }
  seen cb[CALLBACK_WATCHERS];
  ddp_store_watcher *cbw[CALLBACK_WATCHERS];
  for (int i = 0; i < CALLBACK_WATCHERS; i++) {
    memset(&cb[i], 0, sizeof cb[i]);
    pthread_mutex_init(&cb[i].mu, NULL);
    assert_int_equal(ddp_store_watch(st, key, record_small, &cb[i], NULL, &cbw[i]), DDP_OK);
  }
  ddp_store_server_stats stats;
  ddp_store_server_get_stats(server, &stats);
  assert_int_equal(stats.watches, MANY_WATCHERS + CALLBACK_WATCHERS);

  /* Another key's changes must not show up between this key's. (add(key,
   * 0) as a read: test_prefix_and_unsupported.) */
  assert_int_equal(ddp_store_set(st, "other", "x", 1), DDP_OK);
  for (int i = 0; i < CHANGES; i++) apply_change(st, key, i);

  for (int i = 0; i < MANY_WATCHERS; i++) {
    for (int j = 0; j < CHANGES; j++) {
      ddp_store_event ev;
      if (ddp_store_watch_next(w[i], 10000, &ev) != DDP_OK)
        fail_msg("watcher %d, change %d: %s", i, j, ddp_last_error());
      expect_change(&ev, key, j);
    }
    /* Nothing more: the next wait times out, and the watch stays good. */
    ddp_store_event ev;
    assert_int_equal(ddp_store_watch_next(w[i], 0, &ev), DDP_ERR_TIMEOUT);
  }
  for (int i = 0; i < CALLBACK_WATCHERS; i++) {
    for (int t = 0; t < 1000 && seen_count(&cb[i]) < CHANGES; t++) test_sleep_ms(10);
    ddp_store_watch_close(cbw[i]);
    assert_int_equal(cb[i].count, CHANGES);
    assert_int_equal(cb[i].bad, 0);
    assert_int_equal(cb[i].errors, 0); /* close is not an error to the callback */
    pthread_mutex_destroy(&cb[i].mu);
  }
  /* One more change after the first watcher closed: the rest see it. */
  ddp_store_watch_close(w[0]);
  assert_int_equal(ddp_store_set(st, key, "last", 4), DDP_OK);
  for (int i = 1; i < MANY_WATCHERS; i++) {
    ddp_store_event ev;
    assert_int_equal(ddp_store_watch_next(w[i], 10000, &ev), DDP_OK);
    assert_int_equal(ev.seq, CHANGES + 1);
    assert_memory_equal(ev.value, "last", 4);
    ddp_store_watch_close(w[i]);
  }
  free(w);
  stats = watches_eventually(server, 0);
  assert_int_equal(stats.watches, 0);
  assert_int_equal(stats.watches_dropped, 0);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- A watcher whose connection drops ------------------------------------
 * A TCP proxy between one watcher and the server; cutting it drops that
 * watcher's connection only. */

typedef struct proxy {
  int listen_fd;
  uint16_t port, upstream;
  int cut;      /* atomic: close every connection and stop */
  int pairs[16][2];
  int num_pairs;
  pthread_t thread;
} proxy;

static int connect_local(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static void *proxy_main(void *arg) {
  proxy *p = arg;
  char buf[65536];
  while (!__atomic_load_n(&p->cut, __ATOMIC_ACQUIRE)) {
    struct pollfd fds[1 + 32];
    int n = 0;
    fds[n++] = (struct pollfd){.fd = p->listen_fd, .events = POLLIN};
    for (int i = 0; i < p->num_pairs; i++)
      for (int k = 0; k < 2; k++) fds[n++] = (struct pollfd){.fd = p->pairs[i][k], .events = POLLIN};
    if (poll(fds, (nfds_t)n, 20) <= 0) continue;
    if ((fds[0].revents & POLLIN) && p->num_pairs < 16) {
      int down = accept(p->listen_fd, NULL, NULL);
      int up = down >= 0 ? connect_local(p->upstream) : -1;
      if (down >= 0 && up >= 0) {
        p->pairs[p->num_pairs][0] = down;
        p->pairs[p->num_pairs][1] = up;
        p->num_pairs++;
      }
      continue; /* the fds array no longer matches the pairs */
    }
    for (int i = 0; i < p->num_pairs; i++)
      for (int k = 0; k < 2; k++) {
        if (!(fds[1 + 2 * i + k].revents & (POLLIN | POLLHUP))) continue;
        ssize_t got = recv(p->pairs[i][k], buf, sizeof buf, 0);
        if (got > 0) {
          ssize_t off = 0;
          while (off < got) {
            ssize_t put = send(p->pairs[i][1 - k], buf + off, (size_t)(got - off), MSG_NOSIGNAL);
            if (put <= 0) break;
            off += put;
          }
        }
      }
  }
  for (int i = 0; i < p->num_pairs; i++) {
    close(p->pairs[i][0]);
    close(p->pairs[i][1]);
  }
  return NULL;
}

static void proxy_start(proxy *p, uint16_t upstream) {
  memset(p, 0, sizeof *p);
  p->upstream = upstream;
  p->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  assert_int_equal(bind(p->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(p->listen_fd, 16), 0);
  socklen_t len = sizeof a;
  getsockname(p->listen_fd, (struct sockaddr *)&a, &len);
  p->port = ntohs(a.sin_port);
  pthread_create(&p->thread, NULL, proxy_main, p);
}

static void proxy_cut(proxy *p) {
  __atomic_store_n(&p->cut, 1, __ATOMIC_RELEASE);
  pthread_join(p->thread, NULL);
  close(p->listen_fd);
}

static void test_dropped_connection_is_an_error_to_that_watcher_only(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  uint16_t port = ddp_store_server_port(server);
  proxy px;
  proxy_start(&px, port);
  ddp_store *st = connect_to(port, 10000);
  ddp_store *via_proxy = connect_to(px.port, 10000);
  const char *keys[] = {"a", "b"};
  ddp_store_watcher *direct = NULL, *cut = NULL, *other = NULL;
  assert_int_equal(ddp_store_watch_open(st, keys, 2, NULL, &direct), DDP_OK);
  assert_int_equal(ddp_store_watch_open(st, keys + 1, 1, NULL, &other), DDP_OK);
  ddp_store_value initial[2] = {{0}};
  assert_int_equal(ddp_store_watch_open(via_proxy, keys, 2, initial, &cut), DDP_OK);
  assert_null(initial[0].data); /* both absent */
  assert_null(initial[1].data);
  assert_int_equal(watches_eventually(server, 3).watches, 3);

  assert_int_equal(ddp_store_set(st, "a", "1", 1), DDP_OK);
  ddp_store_event ev;
  assert_int_equal(ddp_store_watch_next(cut, 5000, &ev), DDP_OK);
  assert_string_equal(ev.key, "a");
  assert_int_equal(ddp_store_watch_next(direct, 5000, &ev), DDP_OK);
  assert_string_equal(ev.key, "a");

  proxy_cut(&px);
  /* That watcher: an error naming the call and its keys, and again after. */
  assert_int_equal(ddp_store_watch_next(cut, 5000, &ev), DDP_ERR_CLOSED);
  const char *msg = ddp_last_error();
  if (!strstr(msg, "watch([\"a\", \"b\"])") || !strstr(msg, "connection closed"))
    fail_msg("unexpected message: %s", msg);
  assert_int_equal(ddp_store_watch_next(cut, 0, &ev), DDP_ERR_CLOSED);
  /* The server forgot it; the others carry on, in order. */
  assert_int_equal(watches_eventually(server, 2).watches, 2);
  assert_int_equal(ddp_store_set(st, "b", "2", 1), DDP_OK);
  assert_int_equal(ddp_store_set(st, "a", "3", 1), DDP_OK);
  assert_int_equal(ddp_store_watch_next(direct, 5000, &ev), DDP_OK);
  assert_true(!strcmp(ev.key, "b") && ev.seq == 2 && !memcmp(ev.value, "2", 1));
  assert_int_equal(ddp_store_watch_next(direct, 5000, &ev), DDP_OK);
  assert_true(!strcmp(ev.key, "a") && ev.seq == 3 && !memcmp(ev.value, "3", 1));
  assert_int_equal(ddp_store_watch_next(other, 5000, &ev), DDP_OK);
  assert_true(!strcmp(ev.key, "b") && ev.seq == 1);

  ddp_store_watch_close(cut);
  ddp_store_watch_close(direct);
  ddp_store_watch_close(other);
  ddp_store_destroy(via_proxy);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- A slow watcher -------------------------------------------------------- */

#define SLOW_BOUND 8
#define SLOW_VALUE_BYTES (256 * 1024) /* so the sockets' buffers fill */

/* The largest buffer (bytes) /proc/sys/net/ipv4/tcp_<name> lets a socket
 * grow to (its third figure), or `fallback`. */
static long tcp_buffer_max(const char *name, long fallback) {
  char path[64];
  snprintf(path, sizeof path, "/proc/sys/net/ipv4/%s", name);
  FILE *f = fopen(path, "r");
  long lo, mid, hi;
  int n = f ? fscanf(f, "%ld %ld %ld", &lo, &mid, &hi) : 0;
  if (f) fclose(f);
  return n == 3 ? hi : fallback;
}

/* Enough changes that the slow watcher's socket buffers (its send and
 * receive buffers at their largest) fill and its bound is passed on any
 * machine, whatever its TCP tuning: at least 120. */
static int slow_changes(void) {
  long kernel = tcp_buffer_max("tcp_rmem", 6 << 20) + tcp_buffer_max("tcp_wmem", 4 << 20);
  long n = kernel / SLOW_VALUE_BYTES + 1 + SLOW_BOUND + 8;
  return n < 120 ? 120 : n > 1000 ? 1000 : (int)n;
}

static void record_big(void *ctx, const ddp_store_event *ev, ddp_status status) {
  seen *s = ctx;
  pthread_mutex_lock(&s->mu);
  if (!ev) {
    s->errors++;
    s->last_error = status;
  } else {
    int i = s->count++;
    const uint8_t *v = ev->value;
    int ok = ev->seq == (uint64_t)i + 1 && ev->value_bytes == s->value_bytes &&
             v[0] == (uint8_t)i && v[ev->value_bytes - 1] == (uint8_t)i;
    if (!ok && !s->bad) s->bad = i + 1;
  }
  pthread_mutex_unlock(&s->mu);
}

static void test_slow_watcher_is_dropped_others_unaffected(void **state) {
  (void)state;
  ddp_store_server_options so = {.token = ""};
  so.limits.max_watch_pending = SLOW_BOUND;
  ddp_store_server *server = start_server(&so);
  uint16_t port = ddp_store_server_port(server);
  ddp_store *st = connect_to(port, 20000);
  const char *key = "big";
  ddp_store_watcher *slow = NULL;
  assert_int_equal(ddp_store_watch_open(st, &key, 1, NULL, &slow), DDP_OK);
  seen fast[2];
  ddp_store_watcher *fw[2];
  for (int i = 0; i < 2; i++) {
    memset(&fast[i], 0, sizeof fast[i]);
    pthread_mutex_init(&fast[i].mu, NULL);
    fast[i].value_bytes = SLOW_VALUE_BYTES;
    assert_int_equal(ddp_store_watch(st, key, record_big, &fast[i], NULL, &fw[i]), DDP_OK);
  }
  const int changes = slow_changes();
  uint8_t *value = malloc(SLOW_VALUE_BYTES);
  assert_non_null(value);
  for (int i = 0; i < changes; i++) {
    memset(value, i, SLOW_VALUE_BYTES);
    assert_int_equal(ddp_store_set(st, key, value, SLOW_VALUE_BYTES), DDP_OK);
    /* Pace the writer to the fast watchers (they must not fall behind). */
    for (int t = 0; t < 2000 && (seen_count(&fast[0]) < i - 2 || seen_count(&fast[1]) < i - 2); t++)
      test_sleep_ms(1);
  }
  free(value);
  for (int i = 0; i < 2; i++) {
    for (int t = 0; t < 3000 && seen_count(&fast[i]) < changes; t++) test_sleep_ms(10);
    ddp_store_watch_close(fw[i]);
    assert_int_equal(fast[i].count, changes);
    assert_int_equal(fast[i].bad, 0);
    assert_int_equal(fast[i].errors, 0);
    pthread_mutex_destroy(&fast[i].mu);
  }
  ddp_store_server_stats stats;
  ddp_store_server_get_stats(server, &stats);
  assert_int_equal(stats.watches_dropped, 1);
  /* The slow one: what was queued before the drop, in order, then the error
   * naming the key and the bound. */
  int got = 0;
  ddp_store_event ev;
  ddp_status rc;
  while ((rc = ddp_store_watch_next(slow, 10000, &ev)) == DDP_OK) {
    assert_int_equal(ev.seq, (uint64_t)got + 1);
    assert_int_equal(ev.value_bytes, SLOW_VALUE_BYTES);
    assert_int_equal(((const uint8_t *)ev.value)[0], (uint8_t)got);
    got++;
  }
  assert_int_equal(rc, DDP_ERR_RANGE);
  const char *msg = ddp_last_error();
  char bound[64];
  snprintf(bound, sizeof bound, "bound is %d notifications", SLOW_BOUND);
  if (!strstr(msg, "\"big\"") || !strstr(msg, bound) || !strstr(msg, "dropped"))
    fail_msg("unexpected message: %s", msg);
  assert_true(got >= SLOW_BOUND && got < changes);
  print_message("slow watcher got %d of %d changes before it was dropped\n", got, changes);
  assert_int_equal(ddp_store_watch_next(slow, 0, &ev), DDP_ERR_RANGE); /* final */
  ddp_store_watch_close(slow);
  /* The store still serves. */
  void *v = NULL;
  size_t n = 0;
  assert_int_equal(ddp_store_get(st, key, 1000, &v, &n), DDP_OK);
  assert_int_equal(n, SLOW_VALUE_BYTES);
  ddp_free(v);
  assert_int_equal(watches_eventually(server, 0).watches, 0);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- Prefix stores, and stores without watches ------------------------------ */

static void test_prefix_and_unsupported(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  ddp_store *st = connect_to(ddp_store_server_port(server), 10000);
  ddp_store *pre = NULL;
  assert_int_equal(ddp_store_prefix(st, "job1/", &pre), DDP_OK);
  const char *key = "count";
  ddp_store_watcher *w = NULL;
  assert_int_equal(ddp_store_watch_open(pre, &key, 1, NULL, &w), DDP_OK);
  int64_t r = 0;
  assert_int_equal(ddp_store_add(pre, "count", 2, &r), DDP_OK);  /* created: a change */
  assert_int_equal(ddp_store_add(pre, "count", 0, &r), DDP_OK);  /* a read: none */
  assert_int_equal(ddp_store_add(st, "job1/count", 3, &r), DDP_OK);
  ddp_store_event ev;
  assert_int_equal(ddp_store_watch_next(w, 5000, &ev), DDP_OK);
  assert_true(!strcmp(ev.key, "count") && ev.seq == 1 && !strcmp(ev.value, "2"));
  assert_int_equal(ddp_store_watch_next(w, 5000, &ev), DDP_OK);
  assert_true(!strcmp(ev.key, "count") && ev.seq == 2 && !strcmp(ev.value, "5"));
  assert_int_equal(ddp_store_watch_next(w, 0, &ev), DDP_ERR_TIMEOUT);
  ddp_store_watch_close(w);
  /* Bad arguments. */
  const char *twice[] = {"x", "x"};
  assert_int_equal(ddp_store_watch_open(st, twice, 2, NULL, &w), DDP_ERR_INVALID);
  assert_null(w);
  ddp_store_destroy(pre);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);

  ddp_store *mem = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &mem), DDP_OK);
  assert_int_equal(ddp_store_watch_open(mem, &key, 1, NULL, &w), DDP_ERR_UNSUPPORTED);
  if (!strstr(ddp_last_error(), "no watches")) fail_msg("unexpected message: %s", ddp_last_error());
  ddp_store_destroy(mem);
}

/* The watchers' connections and the server's are in this one process. */
static void raise_file_limit(void) {
  const rlim_t need = 2 * (MANY_WATCHERS + CALLBACK_WATCHERS) + 200;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    many_skipped = 1;
    snprintf(many_skip_reason, sizeof many_skip_reason, "getrlimit: %s", strerror(errno));
    return;
  }
  if (rl.rlim_cur >= need) return;
  rlim_t want = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
  rl.rlim_cur = want;
  if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || want < need) {
    many_skipped = 1;
    snprintf(many_skip_reason, sizeof many_skip_reason,
             "%d watchers need %lu file descriptors; the hard limit (ulimit -Hn) is %lu",
             MANY_WATCHERS, (unsigned long)need, (unsigned long)rl.rlim_max);
  }
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  raise_file_limit();
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_many_watchers_see_every_change_in_order),
      cmocka_unit_test(test_dropped_connection_is_an_error_to_that_watcher_only),
      cmocka_unit_test(test_slow_watcher_is_dropped_others_unaffected),
      cmocka_unit_test(test_prefix_and_unsupported),
  };
  int failed = cmocka_run_group_tests(tests, NULL, NULL);
  if (failed) return failed;
  if (many_skipped) {
    printf("SKIP: the 1,000-watcher case did not run: %s\n", many_skip_reason);
    return 77;
  }
  return 0;
}
