/* store (TCP): what the server and client promise beyond the operations --
 * tokens, connecting before the server is up, clear errors for a port in
 * use and an unreachable server, garbage / truncated / oversized input and
 * silent clients on a live server while a well-behaved client keeps working,
 * a killed server failing waits at once with its address, a killed client
 * being dropped, pipelined requests, limits, and a 256-client rendezvous. */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "net/net.h"
#include "store/protocol.h"
#include "store/store_test_util.h"

static ddp_store_server *start_server(const ddp_store_server_options *opts) {
  ddp_store_server *s = NULL;
  ddp_store_server_options none = {.token = ""};
  if (ddp_store_server_start("127.0.0.1", 0, opts ? opts : &none, &s) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  return s;
}

static ddp_store *connect_to(uint16_t port, const char *token, int64_t timeout_ms) {
  ddp_store_options o = {.timeout_ms = timeout_ms, .token = token ? token : ""};
  ddp_store *st = NULL;
  if (ddp_store_tcp_connect("127.0.0.1", port, &o, &st) != DDP_OK) fail_msg("%s", ddp_last_error());
  return st;
}

/* Polls the server's stats until pred holds or 5 s pass. */
static ddp_store_server_stats stats_eventually(ddp_store_server *s, uint64_t clients,
                                               uint64_t waiters) {
  ddp_store_server_stats st;
  for (int i = 0; i < 500; i++) {
    ddp_store_server_get_stats(s, &st);
    if (st.clients == clients && st.waiters == waiters) break;
    test_sleep_ms(10);
  }
  return st;
}

static void test_token(void **state) {
  (void)state;
  ddp_store_server_options so = {.token = "s3cret"};
  ddp_store_server *server = start_server(&so);
  uint16_t port = ddp_store_server_port(server);
  ddp_store_options o = {.timeout_ms = 2000, .token = "wrong"};
  ddp_store *st = NULL;
  int64_t t0 = test_now_ms();
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", port, &o, &st), DDP_ERR_AUTH);
  assert_true(test_now_ms() - t0 < 1000); /* refused at once, not retried */
  assert_null(st);
  assert_non_null(strstr(ddp_last_error(), "token refused"));
  assert_non_null(strstr(ddp_last_error(), "127.0.0.1:"));
  o.token = "";
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", port, &o, &st), DDP_ERR_AUTH);
  assert_non_null(strstr(ddp_last_error(), "requires a token"));
  /* The token can come from the environment. */
  setenv("DDP_STORE_TOKEN", "s3cret", 1);
  o.token = NULL;
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", port, &o, &st), DDP_OK);
  unsetenv("DDP_STORE_TOKEN");
  assert_int_equal(ddp_store_set(st, "k", "v", 1), DDP_OK);
  ddp_store_destroy(st);
  ddp_store_server_stats stats;
  ddp_store_server_get_stats(server, &stats);
  assert_int_equal(stats.clients_dropped, 2);
  ddp_store_server_stop(server);
}

typedef struct late_server {
  uint16_t port;
  int64_t delay_ms;
  ddp_store_server *server;
  pthread_t thread;
} late_server;

static void *late_server_main(void *arg) {
  late_server *l = arg;
  test_sleep_ms(l->delay_ms);
  ddp_store_server_options so = {.token = ""};
  if (ddp_store_server_start("127.0.0.1", l->port, &so, &l->server) != DDP_OK)
    fprintf(stderr, "late server: %s\n", ddp_last_error());
  return NULL;
}

/* A free port: bind to 0, read it, close. */
static uint16_t free_port(void) {
  ddp_store_server *s = start_server(NULL);
  uint16_t port = ddp_store_server_port(s);
  ddp_store_server_stop(s);
  return port;
}

static void test_connect_retries_until_server_starts(void **state) {
  (void)state;
  late_server l = {.port = free_port(), .delay_ms = 400};
  pthread_create(&l.thread, NULL, late_server_main, &l);
  ddp_store_options o = {.timeout_ms = 10000, .token = ""};
  ddp_store *st = NULL;
  int64_t t0 = test_now_ms();
  ddp_status rc = ddp_store_tcp_connect("127.0.0.1", l.port, &o, &st);
  int64_t took = test_now_ms() - t0;
  pthread_join(l.thread, NULL);
  if (rc != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_true(took >= 350 && took < 3000);
  assert_int_equal(ddp_store_set(st, "up", "1", 1), DDP_OK);
  ddp_store_destroy(st);
  ddp_store_server_stop(l.server);
}

static void test_connect_timeout_names_address(void **state) {
  (void)state;
  uint16_t port = free_port();
  ddp_store_options o = {.timeout_ms = 10000, .connect_timeout_ms = 300, .token = ""};
  ddp_store *st = NULL;
  int64_t t0 = test_now_ms();
  assert_int_equal(ddp_store_tcp_connect("127.0.0.1", port, &o, &st), DDP_ERR_TIMEOUT);
  int64_t took = test_now_ms() - t0;
  assert_true(took >= 250 && took < 1500);
  char want[64];
  snprintf(want, sizeof want, "store 127.0.0.1:%u: cannot connect within", port);
  assert_non_null(strstr(ddp_last_error(), want));
  assert_non_null(strstr(ddp_last_error(), "refused"));
}

static void test_address_in_use(void **state) {
  (void)state;
  ddp_store_server *a = start_server(NULL);
  uint16_t port = ddp_store_server_port(a);
  ddp_store_server *b = NULL;
  assert_int_equal(ddp_store_server_start("127.0.0.1", port, NULL, &b), DDP_ERR_ADDRINUSE);
  assert_null(b);
  char want[200];
  snprintf(want, sizeof want,
           "cannot listen on 127.0.0.1:%u: address already in use (another job or a stale process "
           "holds it; choose another MASTER_PORT or stop it)",
           port);
  assert_string_equal(ddp_last_error(), want);
  ddp_store_server_stop(a);
}

static void test_ipv6_loopback(void **state) {
  (void)state;
  ddp_store_server *server = NULL;
  ddp_store_server_options so = {.token = ""};
  if (ddp_store_server_start("::1", 0, &so, &server) != DDP_OK) {
    print_message("SKIP: no IPv6 loopback here (%s)\n", ddp_last_error());
    skip();
  }
  uint16_t port = ddp_store_server_port(server);
  char want[64];
  snprintf(want, sizeof want, "[::1]:%u", port);
  assert_string_equal(ddp_store_server_address(server), want);
  ddp_store_options o = {.timeout_ms = 5000, .token = ""};
  ddp_store *st = NULL;
  assert_int_equal(ddp_store_tcp_connect("::1", port, &o, &st), DDP_OK);
  assert_string_equal(ddp_store_address(st), want);
  assert_int_equal(ddp_store_set(st, "v6", "yes", 3), DDP_OK);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(st, "v6", 0, &v, &n), DDP_OK);
  assert_memory_equal(v, "yes", 3);
  ddp_free(v);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- Hostile input ------------------------------------------------------- */

static int raw_connect(uint16_t port) {
  int fd;
  if (ddp__net_connect("127.0.0.1", port, ddp_time_ns() + 2000000000LL, &fd) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  return fd;
}

static void raw_send(int fd, const void *data, size_t len) {
  ddp__net_write_full(fd, data, len, ddp_time_ns() + 2000000000LL); /* may fail: peer gone */
}

static void raw_hello(int fd, const char *token) {
  ddp__buf b = {0};
  ddp__store_encode_hello(&b, token);
  raw_send(fd, b.data, b.len);
  ddp__buf_free(&b);
  uint8_t reply[64];
  size_t got;
  assert_int_equal(ddp__net_read_some(fd, reply, sizeof reply, &got, ddp_time_ns() + 2000000000LL),
                   DDP_OK);
  assert_int_equal(reply[4], DDP__WIRE_OK);
}

/* Reads until the server closes the connection (it must, within 2 s). Returns
 * the first reply's status byte, or -1 if none arrived. */
static int expect_closed(int fd) {
  uint8_t buf[4096];
  size_t got, total = 0;
  int first = -1;
  int64_t deadline = ddp_time_ns() + 2000000000LL;
  for (;;) {
    ddp_status st = ddp__net_read_some(fd, buf, sizeof buf, &got, deadline);
    if (st == DDP_OK) {
      if (total == 0 && got >= 5) first = buf[4];
      total += got;
      continue;
    }
    if (st == DDP_ERR_TIMEOUT) fail_msg("the server kept a misbehaving client open");
    break; /* closed or reset */
  }
  close(fd);
  return first;
}

/* The well-behaved client that must not notice anything. */
typedef struct steady {
  ddp_store *store;
  int stop; /* atomic */
  int ops;
  ddp_status st;
  pthread_t thread;
} steady;

static void *steady_main(void *arg) {
  steady *s = arg;
  s->st = DDP_OK;
  while (!__atomic_load_n(&s->stop, __ATOMIC_RELAXED) && s->st == DDP_OK) {
    char v[32];
    int n = snprintf(v, sizeof v, "%d", s->ops);
    s->st = ddp_store_set(s->store, "steady", v, (size_t)n);
    void *got = NULL;
    size_t bytes;
    if (s->st == DDP_OK) s->st = ddp_store_get(s->store, "steady", 1000, &got, &bytes);
    if (s->st == DDP_OK && (bytes != (size_t)n || memcmp(got, v, bytes))) s->st = DDP_ERR_INTERNAL;
    ddp_free(got);
    s->ops++;
  }
  return NULL;
}

static void frame(ddp__buf *b, const uint8_t *body, size_t len) {
  ddp__buf_u32(b, (uint32_t)len);
  ddp__buf_put(b, body, len);
}

static void test_hostile_input_while_others_work(void **state) {
  (void)state;
  ddp_store_server_options so = {.token = "", .handshake_timeout_ms = 300};
  so.limits.max_value_bytes = 1 << 20;
  so.limits.max_message_bytes = 2 << 20;
  ddp_store_server *server = start_server(&so);
  uint16_t port = ddp_store_server_port(server);
  steady good = {.store = connect_to(port, NULL, 5000)};
  pthread_create(&good.thread, NULL, steady_main, &good);

  ddp_rng rng;
  ddp_rng_seed(&rng, 1234);
  /* 1. Random garbage instead of a handshake. */
  for (int round = 0; round < 20; round++) {
    int fd = raw_connect(port);
    uint8_t junk[512];
    size_t n = 1 + ddp_rng_below(&rng, sizeof junk);
    for (size_t i = 0; i < n; i++) junk[i] = (uint8_t)ddp_rng_next(&rng);
    raw_send(fd, junk, n);
    shutdown(fd, SHUT_WR);
    expect_closed(fd);
  }
  /* 2. Bad magic, bad version: refused with a reason. */
  {
    int fd = raw_connect(port);
    ddp__buf b = {0};
    uint8_t body[13] = {DDP__OP_HELLO, 'H', 'T', 'T', 'P', 1, 0, 0, 0, 0, 0, 0, 0};
    frame(&b, body, sizeof body);
    raw_send(fd, b.data, b.len);
    assert_int_equal(expect_closed(fd), DDP__WIRE_VERSION);
    ddp__buf_free(&b);
  }
  /* 3. An HTTP request, as a port scanner would send. */
  {
    int fd = raw_connect(port);
    const char *http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    raw_send(fd, http, strlen(http));
    expect_closed(fd); /* "GET " reads as a 542 MB frame: over the limit */
  }
  /* 3b. Before the handshake nothing bigger than a hello is buffered: a
   *     64 KiB frame is refused as soon as its header arrives. */
  {
    int fd = raw_connect(port);
    uint8_t header[5] = {0x00, 0x00, 0x01, 0x00, DDP__OP_HELLO};
    raw_send(fd, header, sizeof header);
    assert_int_equal(expect_closed(fd), DDP__WIRE_TOO_LARGE);
  }
  /* 4. After the handshake: a frame header announcing 4 GB. */
  {
    int fd = raw_connect(port);
    raw_hello(fd, NULL);
    uint8_t huge[4] = {0xf0, 0xff, 0xff, 0xff};
    raw_send(fd, huge, 4);
    assert_int_equal(expect_closed(fd), DDP__WIRE_TOO_LARGE);
  }
  /* 5. A set whose value length is over the value limit (the frame is small). */
  {
    int fd = raw_connect(port);
    raw_hello(fd, NULL);
    ddp__buf b = {0};
    size_t at = ddp__buf_frame_begin(&b);
    ddp__buf_u8(&b, DDP__OP_SET);
    ddp__buf_bytes(&b, "k", 1);
    ddp__buf_u32(&b, 0x7fffffff); /* claims 2 GB follow */
    ddp__buf_frame_end(&b, at);
    raw_send(fd, b.data, b.len);
    assert_int_equal(expect_closed(fd), DDP__WIRE_TOO_LARGE);
    ddp__buf_free(&b);
  }
  /* 6. A key length that runs past the frame; a wait claiming 10^9 keys; an
   *    unknown opcode; an empty frame; a key with a NUL byte. */
  {
    const uint8_t bodies[][16] = {
        {DDP__OP_GET, 0, 0, 0, 0, 0, 0, 0, 0, 200, 0, 0, 0, 'a'},
        {DDP__OP_WAIT, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xca, 0x9a, 0x3b},
        {99},
        {0},
        {DDP__OP_DELETE, 3, 0, 0, 0, 'a', 0, 'b'},
    };
    const size_t lens[] = {14, 13, 1, 0, 8};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
      int fd = raw_connect(port);
      raw_hello(fd, NULL);
      ddp__buf b = {0};
      frame(&b, bodies[i], lens[i]);
      raw_send(fd, b.data, b.len);
      int status = expect_closed(fd);
      assert_true(status == DDP__WIRE_MALFORMED || status == DDP__WIRE_TOO_LARGE);
      ddp__buf_free(&b);
    }
  }
  /* 7. Truncated: half a frame, then the client goes away. */
  for (int round = 0; round < 10; round++) {
    int fd = raw_connect(port);
    raw_hello(fd, NULL);
    ddp__buf b = {0};
    size_t at = ddp__buf_frame_begin(&b);
    ddp__buf_u8(&b, DDP__OP_SET);
    ddp__buf_bytes(&b, "trunc", 5);
    ddp__buf_bytes(&b, "0123456789", 10);
    ddp__buf_frame_end(&b, at);
    raw_send(fd, b.data, 1 + ddp_rng_below(&rng, b.len - 1));
    close(fd);
    ddp__buf_free(&b);
  }
  /* 8. A request before the handshake. */
  {
    int fd = raw_connect(port);
    uint8_t body[9] = {DDP__OP_PING};
    ddp__buf b = {0};
    frame(&b, body, sizeof body);
    raw_send(fd, b.data, b.len);
    assert_int_equal(expect_closed(fd), DDP__WIRE_STATE);
    ddp__buf_free(&b);
  }
  /* 9. Silent clients (connect, send nothing; or 2 bytes of a header) are
   *    dropped after the handshake timeout, not kept forever. */
  {
    int quiet = raw_connect(port);
    int partial = raw_connect(port);
    raw_send(partial, "\x10\x00", 2);
    int64_t t0 = test_now_ms();
    expect_closed(quiet);
    expect_closed(partial);
    assert_true(test_now_ms() - t0 < 1500);
  }
  /* 10. Mutations of valid requests: whatever they parse as, the server
   *     answers or drops, and never stops serving. */
  for (int round = 0; round < 200; round++) {
    int fd = raw_connect(port);
    raw_hello(fd, NULL);
    ddp__buf b = {0};
    size_t at = ddp__buf_frame_begin(&b);
    ddp__buf_u8(&b, (uint8_t)(1 + ddp_rng_below(&rng, DDP__OP_MAX_)));
    ddp__buf_i64(&b, 0);
    ddp__buf_bytes(&b, "mut", 3);
    ddp__buf_bytes(&b, "value", 5);
    ddp__buf_frame_end(&b, at);
    int flips = 1 + (int)ddp_rng_below(&rng, 4);
    for (int i = 0; i < flips; i++)
      b.data[ddp_rng_below(&rng, b.len)] ^= (uint8_t)(1u << ddp_rng_below(&rng, 8));
    raw_send(fd, b.data, b.len);
    shutdown(fd, SHUT_WR);
    /* The server replies and/or closes; either way the connection ends
     * because we shut our side (a blocked wait ends on our hang-up). */
    uint8_t buf[256];
    size_t got;
    while (ddp__net_read_some(fd, buf, sizeof buf, &got, ddp_time_ns() + 2000000000LL) == DDP_OK) {
    }
    close(fd);
    ddp__buf_free(&b);
  }

  __atomic_store_n(&good.stop, 1, __ATOMIC_RELAXED);
  pthread_join(good.thread, NULL);
  if (good.st != DDP_OK) fail_msg("the good client failed: %s", ddp_last_error());
  assert_true(good.ops > 10);
  ddp_store_server_stats stats = stats_eventually(server, 1, 0);
  assert_int_equal(stats.clients, 1); /* only the good one is left */
  assert_int_equal(stats.waiters, 0);
  assert_true(stats.clients_dropped >= 40);
  ddp_store_destroy(good.store);
  ddp_store_server_stop(server);
}

/* Requests sent back to back are answered in order; a blocked wait holds the
 * requests behind it until it ends. */
static void test_pipelined_requests(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  int fd = raw_connect(ddp_store_server_port(server));
  raw_hello(fd, NULL);
  ddp__buf b = {0};
  size_t at = ddp__buf_frame_begin(&b);
  ddp__buf_u8(&b, DDP__OP_WAIT);
  ddp__buf_i64(&b, 100); /* 100 ms */
  ddp__buf_u32(&b, 1);
  ddp__buf_bytes(&b, "absent", 6);
  ddp__buf_frame_end(&b, at);
  for (int i = 0; i < 3; i++) {
    at = ddp__buf_frame_begin(&b);
    ddp__buf_u8(&b, DDP__OP_PING);
    ddp__buf_i64(&b, 1000 + i);
    ddp__buf_frame_end(&b, at);
  }
  int64_t t0 = test_now_ms();
  raw_send(fd, b.data, b.len);
  ddp__buf_free(&b);
  uint8_t reply[512];
  size_t have = 0, got;
  /* 1 timeout reply + 3 ping replies (4 + 1 + 8 bytes each). */
  while (have < 3 * 13 + 5) {
    assert_int_equal(ddp__net_read_some(fd, reply + have, sizeof reply - have, &got,
                                        ddp_time_ns() + 2000000000LL),
                     DDP_OK);
    have += got;
  }
  assert_true(test_now_ms() - t0 >= 90);
  assert_int_equal(reply[4], DDP__WIRE_TIMEOUT);
  size_t off = 4 + ddp__load_u32(reply);
  for (int i = 0; i < 3; i++) {
    if (off + 13 > have) {
      assert_int_equal(
          ddp__net_read_full(fd, reply + have, off + 13 - have, ddp_time_ns() + 2000000000LL),
          DDP_OK);
      have = off + 13;
    }
    assert_int_equal(ddp__load_u32(reply + off), 9);
    assert_int_equal(reply[off + 4], DDP__WIRE_OK);
    ddp__reader r = {reply + off + 5, reply + off + 13, 0};
    assert_int_equal(ddp__rd_i64(&r), 1000 + i);
    off += 13;
  }
  close(fd);
  ddp_store_server_stop(server);
}

/* A client that pipelines large gets and reads slowly: the server stops
 * reading it while 4 MiB of replies wait, resumes as they drain, and every
 * reply arrives whole and in order. */
static void test_slow_reader_backpressure(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  uint16_t port = ddp_store_server_port(server);
  ddp_store *st = connect_to(port, NULL, 10000);
  const size_t big = 4u << 20;
  uint8_t *value = malloc(big);
  for (size_t i = 0; i < big; i++) value[i] = (uint8_t)(i * 7 + 3);
  assert_int_equal(ddp_store_set(st, "big", value, big), DDP_OK);
  int fd = raw_connect(port);
  raw_hello(fd, NULL);
  ddp__buf b = {0};
  enum { N = 8 };
  for (int i = 0; i < N; i++) {
    size_t at = ddp__buf_frame_begin(&b);
    ddp__buf_u8(&b, DDP__OP_GET);
    ddp__buf_i64(&b, 1000);
    ddp__buf_bytes(&b, "big", 3);
    ddp__buf_frame_end(&b, at);
  }
  raw_send(fd, b.data, b.len);
  ddp__buf_free(&b);
  test_sleep_ms(200); /* let the server fill the socket and stop */
  /* Meanwhile another client is served normally. */
  assert_int_equal(ddp_store_set(st, "other", "1", 1), DDP_OK);
  const size_t reply = 4 + 1 + 4 + big;
  uint8_t *buf = malloc(reply);
  for (int i = 0; i < N; i++) {
    assert_int_equal(ddp__net_read_full(fd, buf, reply, ddp_time_ns() + 10000000000LL), DDP_OK);
    assert_int_equal(ddp__load_u32(buf), reply - 4);
    assert_int_equal(buf[4], DDP__WIRE_OK);
    assert_int_equal(ddp__load_u32(buf + 5), big);
    assert_memory_equal(buf + 9, value, big);
  }
  close(fd);
  free(buf);
  free(value);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

static void test_limits_are_clear_errors(void **state) {
  (void)state;
  ddp_store_server_options so = {.token = ""};
  so.limits.max_key_bytes = 16;
  so.limits.max_value_bytes = 1000;
  ddp_store_server *server = start_server(&so);
  ddp_store *st = connect_to(ddp_store_server_port(server), NULL, 5000);
  char big[2000];
  memset(big, 'v', sizeof big);
  assert_int_equal(ddp_store_set(st, "k", big, sizeof big), DDP_ERR_RANGE);
  assert_non_null(
      strstr(ddp_last_error(), "value of 2000 bytes exceeds the store's limit of 1000"));
  assert_int_equal(ddp_store_set(st, "a_key_longer_than_16", "v", 1), DDP_ERR_RANGE);
  assert_non_null(strstr(ddp_last_error(), "exceeds the store's limit of 16"));
  /* Appends cannot grow a value past the limit either... the server's table
   * accounts bytes; the connection still works. */
  assert_int_equal(ddp_store_set(st, "k", big, 1000), DDP_OK);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* Timeouts near INT64_MAX (from the API or from a client on the wire) mean
 * "a very long time", never an overflowed deadline. */
static void test_huge_timeouts(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  uint16_t port = ddp_store_server_port(server);
  ddp_store *st = connect_to(port, NULL, INT64_MAX);
  delayed_set d = {.delay_ms = 100, .keys = {"late"}, .values = {"1"}, .num_keys = 1};
  assert_int_equal(delayed_set_start(&d, st), DDP_OK);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(st, "late", INT64_MAX, &v, &n), DDP_OK);
  assert_int_equal(delayed_set_join(&d), DDP_OK);
  ddp_free(v);
  int fd = raw_connect(port);
  raw_hello(fd, NULL);
  ddp__buf b = {0};
  size_t at = ddp__buf_frame_begin(&b);
  ddp__buf_u8(&b, DDP__OP_GET);
  ddp__buf_i64(&b, INT64_MAX);
  ddp__buf_bytes(&b, "never", 5);
  ddp__buf_frame_end(&b, at);
  raw_send(fd, b.data, b.len);
  ddp__buf_free(&b);
  ddp_store_server_stats stats = stats_eventually(server, 2, 1); /* st and the raw client */
  assert_int_equal(stats.clients, 2);
  assert_int_equal(stats.waiters, 1);
  close(fd);
  stats = stats_eventually(server, 1, 0);
  assert_int_equal(stats.waiters, 0);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- Processes dying ------------------------------------------------------ */

static const char *store_tool(char *buf, size_t cap) {
  const char *dir = getenv("DDP_BIN_DIR");
  snprintf(buf, cap, "%s/ddp-store", dir ? dir : "build/bin");
  return buf;
}

/* Runs `ddp-store serve --port 0 --bind 127.0.0.1`; returns its pid and port. */
static pid_t spawn_server(uint16_t *port) {
  int pipefd[2];
  assert_int_equal(pipe(pipefd), 0);
  char tool[512];
  store_tool(tool, sizeof tool);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], STDOUT_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    execl(tool, "ddp-store", "serve", "--port", "0", "--bind", "127.0.0.1", (char *)NULL);
    _exit(127);
  }
  close(pipefd[1]);
  char line[128] = {0};
  size_t n = 0;
  while (n < sizeof line - 1) {
    ssize_t r = read(pipefd[0], line + n, 1);
    if (r <= 0 || line[n] == '\n') break;
    n++;
  }
  close(pipefd[0]);
  line[n] = '\0';
  unsigned p = 0;
  if (sscanf(line, "listening on 127.0.0.1:%u", &p) != 1) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fail_msg("ddp-store serve printed \"%s\" (tool %s)", line, tool);
  }
  *port = (uint16_t)p;
  return pid;
}

typedef struct killer {
  pid_t pid;
  int64_t delay_ms;
  pthread_t thread;
} killer;

static void *killer_main(void *arg) {
  killer *k = arg;
  test_sleep_ms(k->delay_ms);
  kill(k->pid, SIGKILL);
  return NULL;
}

static void test_server_killed_fails_waits_fast(void **state) {
  (void)state;
  uint16_t port;
  pid_t pid = spawn_server(&port);
  ddp_store *st = connect_to(port, NULL, 10000);
  assert_int_equal(ddp_store_set(st, "alive", "1", 1), DDP_OK);
  killer k = {.pid = pid, .delay_ms = 300};
  pthread_create(&k.thread, NULL, killer_main, &k);
  const char *keys[] = {"never"};
  int64_t t0 = test_now_ms();
  ddp_status rc = ddp_store_wait(st, keys, 1, 5000);
  int64_t took = test_now_ms() - t0;
  pthread_join(k.thread, NULL);
  waitpid(pid, NULL, 0);
  assert_int_equal(rc, DDP_ERR_CLOSED);
  assert_true(took < 2000); /* not the 5 s timeout */
  char want[128];
  snprintf(want, sizeof want, "store 127.0.0.1:%u: wait([\"never\"]): connection closed", port);
  assert_non_null(strstr(ddp_last_error(), want));
  /* The next call tries to reconnect and fails within its own timeout. */
  void *v;
  size_t n;
  t0 = test_now_ms();
  rc = ddp_store_get(st, "alive", 500, &v, &n);
  took = test_now_ms() - t0;
  assert_int_not_equal(rc, DDP_OK);
  assert_true(took < 1500);
  snprintf(want, sizeof want, "store 127.0.0.1:%u", port);
  assert_non_null(strstr(ddp_last_error(), want));
  ddp_store_destroy(st);
}

static void test_client_killed_server_carries_on(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  uint16_t port = ddp_store_server_port(server);
  ddp_store *st = connect_to(port, NULL, 5000);
  /* A real process blocked in a wait, killed with SIGKILL. */
  char tool[512], addr[64];
  store_tool(tool, sizeof tool);
  snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
  pid_t pid = fork();
  if (pid == 0) {
    execl(tool, "ddp-store", "wait", "--addr", addr, "--timeout", "30", "never", (char *)NULL);
    _exit(127);
  }
  ddp_store_server_stats stats = stats_eventually(server, 2, 1);
  assert_int_equal(stats.waiters, 1);
  kill(pid, SIGKILL);
  int status;
  waitpid(pid, &status, 0);
  assert_true(WIFSIGNALED(status));
  stats = stats_eventually(server, 1, 0);
  assert_int_equal(stats.clients, 1);
  assert_int_equal(stats.waiters, 0);
  /* And a client that dies halfway through sending a large set. */
  int fd = raw_connect(port);
  raw_hello(fd, NULL);
  ddp__buf b = {0};
  size_t at = ddp__buf_frame_begin(&b);
  ddp__buf_u8(&b, DDP__OP_SET);
  ddp__buf_bytes(&b, "half", 4);
  ddp__buf_u32(&b, 1 << 20);
  ddp__buf_frame_end(&b, at);
  uint32_t body = (uint32_t)(b.len - 4 + (1 << 20));
  b.data[0] = (uint8_t)body;
  b.data[1] = (uint8_t)(body >> 8);
  b.data[2] = (uint8_t)(body >> 16);
  b.data[3] = (uint8_t)(body >> 24);
  raw_send(fd, b.data, b.len);
  static const uint8_t some[4096];
  raw_send(fd, some, sizeof some); /* a bit of the value, then gone */
  close(fd);
  ddp__buf_free(&b);
  stats = stats_eventually(server, 1, 0);
  assert_int_equal(stats.clients, 1);
  assert_int_equal(ddp_store_set(st, "after", "ok", 2), DDP_OK);
  const char *k1[] = {"half"};
  int all;
  assert_int_equal(ddp_store_check(st, k1, 1, &all), DDP_OK);
  assert_int_equal(all, 0); /* the half-sent set never happened */
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

/* ---- Many clients ---------------------------------------------------------- */

enum { RDZV_CLIENTS = 256 };

typedef struct rdzv_client {
  uint16_t port;
  ddp_status st;
  char err[256];
  pthread_t thread;
} rdzv_client;

static void *rdzv_main(void *arg) {
  rdzv_client *c = arg;
  ddp_store_options o = {.timeout_ms = 20000, .token = ""};
  ddp_store *st = NULL;
  int64_t rank = 0;
  c->st = ddp_store_tcp_connect("127.0.0.1", c->port, &o, &st);
  if (c->st == DDP_OK) c->st = ddp_store_add(st, "arrived", 1, &rank);
  char key[32], val[32];
  snprintf(key, sizeof key, "addr/%" PRId64, rank - 1);
  snprintf(val, sizeof val, "10.0.0.%" PRId64 ":%d", rank, 1000);
  if (c->st == DDP_OK) c->st = ddp_store_set(st, key, val, strlen(val));
  if (c->st == DDP_OK && rank == RDZV_CLIENTS) c->st = ddp_store_set(st, "all_here", "1", 1);
  const char *done[] = {"all_here"};
  if (c->st == DDP_OK) c->st = ddp_store_wait(st, done, 1, 20000);
  if (c->st != DDP_OK) snprintf(c->err, sizeof c->err, "%s", ddp_last_error());
  ddp_store_destroy(st);
  return NULL;
}

static void test_many_clients_rendezvous(void **state) {
  (void)state;
  ddp_store_server *server = start_server(NULL);
  static rdzv_client c[RDZV_CLIENTS];
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  for (int i = 0; i < RDZV_CLIENTS; i++) {
    c[i].port = ddp_store_server_port(server);
    assert_int_equal(pthread_create(&c[i].thread, &attr, rdzv_main, &c[i]), 0);
  }
  for (int i = 0; i < RDZV_CLIENTS; i++) {
    pthread_join(c[i].thread, NULL);
    if (c[i].st != DDP_OK) fail_msg("client %d: %s", i, c[i].err);
  }
  pthread_attr_destroy(&attr);
  ddp_store *st = connect_to(ddp_store_server_port(server), NULL, 5000);
  int64_t count;
  assert_int_equal(ddp_store_num_keys(st, &count), DDP_OK);
  assert_int_equal(count, RDZV_CLIENTS + 2); /* addr/0..255, arrived, all_here */
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(st, "arrived", 0, &v, &n), DDP_OK);
  assert_string_equal(v, "256");
  ddp_free(v);
  ddp_store_destroy(st);
  ddp_store_server_stop(server);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_token),
      cmocka_unit_test(test_connect_retries_until_server_starts),
      cmocka_unit_test(test_connect_timeout_names_address),
      cmocka_unit_test(test_address_in_use),
      cmocka_unit_test(test_ipv6_loopback),
      cmocka_unit_test(test_hostile_input_while_others_work),
      cmocka_unit_test(test_pipelined_requests),
      cmocka_unit_test(test_slow_reader_backpressure),
      cmocka_unit_test(test_limits_are_clear_errors),
      cmocka_unit_test(test_huge_timeouts),
      cmocka_unit_test(test_server_killed_fails_waits_fast),
      cmocka_unit_test(test_client_killed_server_carries_on),
      cmocka_unit_test(test_many_clients_rendezvous),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
