/* libFuzzer target for the whole store server: each input is the byte stream
 * of one client (optionally after a valid hello, so the fuzzer reaches the
 * request handlers at once), sent over loopback TCP to a live server; the
 * client then hangs up. The server must close the connection within 2 s
 * (it may not keep a misbehaving or departed client), must still answer a
 * well-behaved client afterwards, and must not be left holding the client or
 * a waiter. ASan and UBSan watch the server thread throughout.
 *
 * Build and run: scripts/fuzz.sh [seconds] store_server_fuzz */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "net/net.h"
#include "store/protocol.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static ddp_store_server *server;
static ddp_store *probe;
static uint16_t port;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  ddp_log_set_level(DDP_LOG_ERROR);
  ddp_store_server_options so = {.token = "", .handshake_timeout_ms = 500};
  so.limits.max_key_bytes = 64;
  so.limits.max_value_bytes = 4096;
  so.limits.max_message_bytes = 16384;
  so.limits.max_keys_per_call = 16;
  so.limits.max_total_bytes = 1 << 20;
  if (ddp_store_server_start("127.0.0.1", 0, &so, &server) != DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    abort();
  }
  port = ddp_store_server_port(server);
  ddp_store_options o = {.timeout_ms = 5000, .token = ""};
  if (ddp_store_tcp_connect("127.0.0.1", port, &o, &probe) != DDP_OK) {
    fprintf(stderr, "%s\n", ddp_last_error());
    abort();
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int fd;
  if (ddp__net_connect("127.0.0.1", port, ddp_time_ns() + 2000000000LL, &fd) != DDP_OK) abort();
  int64_t deadline = ddp_time_ns() + 2000000000LL;
  if (size > 0 && (data[0] & 1)) {
    ddp__buf hello = {0};
    ddp__store_encode_hello(&hello, NULL);
    ddp__net_write_full(fd, hello.data, hello.len, deadline);
    ddp__buf_free(&hello);
  }
  if (size > 1) ddp__net_write_full(fd, data + 1, size - 1, deadline); /* may fail: dropped */
  shutdown(fd, SHUT_WR);
  uint8_t buf[65536];
  size_t got;
  ddp_status st;
  while ((st = ddp__net_read_some(fd, buf, sizeof buf, &got, deadline)) == DDP_OK) {
  }
  if (st == DDP_ERR_TIMEOUT) {
    fprintf(stderr, "the server kept a client that hung up for 2 s\n");
    abort();
  }
  close(fd);
  /* The server still serves, and let go of that client and its waiter. */
  const char *keys[] = {"probe"};
  int all;
  if (ddp_store_check(probe, keys, 1, &all) != DDP_OK) {
    fprintf(stderr, "probe: %s\n", ddp_last_error());
    abort();
  }
  ddp_store_server_stats stats;
  for (int i = 0; i < 200; i++) {
    ddp_store_server_get_stats(server, &stats);
    if (stats.clients == 1 && stats.waiters == 0) break;
    usleep(1000);
  }
  if (stats.clients != 1 || stats.waiters != 0) {
    fprintf(stderr, "server holds %llu clients, %llu waiters after the client left\n",
            (unsigned long long)stats.clients, (unsigned long long)stats.waiters);
    abort();
  }
  return 0;
}
