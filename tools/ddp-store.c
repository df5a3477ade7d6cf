/* ddp-store: runs a ddp key-value store server, and talks to one from scripts
 * and while debugging a rendezvous (set, get, add, wait, delete, keys). */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "ddp/store.h"

static const char usage[] =
    "usage: ddp-store serve [--port N] [--bind ADDR] [--token T]\n"
    "       ddp-store set    [--addr HOST:PORT] KEY VALUE\n"
    "       ddp-store get    [--addr HOST:PORT] [--timeout S] KEY\n"
    "       ddp-store add    [--addr HOST:PORT] KEY DELTA\n"
    "       ddp-store wait   [--addr HOST:PORT] [--timeout S] KEY...\n"
    "       ddp-store delete [--addr HOST:PORT] KEY\n"
    "       ddp-store keys   [--addr HOST:PORT]\n"
    "       ddp-store --version  (prints \"ddp-store (ddp) VERSION\")\n"
    "\n"
    "The ddp rendezvous key-value store (docs/store.md).\n"
    "\n"
    "serve   Runs a store server in the foreground until SIGINT or SIGTERM. Its\n"
    "        first line of stdout is \"listening on HOST:PORT\" (the port actually\n"
    "        bound, so --port 0 picks a free one and reports it).\n"
    "        --port N      port to listen on (default 29500; 0 = any free port)\n"
    "        --bind ADDR   address to bind (default 0.0.0.0; \"::\" for IPv6,\n"
    "                      127.0.0.1 to accept local clients only)\n"
    "        --token T     require this shared token from clients (default:\n"
    "                      $DDP_STORE_TOKEN; none if unset)\n"
    "\n"
    "set     Sets KEY to VALUE (the bytes of the argument).\n"
    "get     Waits until KEY exists (up to --timeout), then writes its value to\n"
    "        stdout exactly (plus a newline when stdout is a terminal).\n"
    "add     Adds the integer DELTA to KEY (missing = 0); prints the new value.\n"
    "wait    Waits until every KEY exists (up to --timeout).\n"
    "delete  Deletes KEY; prints 1 if it existed, else 0.\n"
    "keys    Prints every key, one per line, sorted.\n"
    "\n"
    "Client options:\n"
    "  --addr HOST:PORT  the server (default: $DDP_STORE_ADDR, else\n"
    "                    127.0.0.1:29500; IPv6 as [::1]:29500)\n"
    "  --timeout S       seconds to wait for keys (default: $DDP_TIMEOUT, else\n"
    "                    1800; fractions allowed; 0 = do not wait) and to\n"
    "                    connect (at least 1 s)\n"
    "  --token T         the server's token (default: $DDP_STORE_TOKEN)\n"
    "\n"
    "Exit status: 0 on success, 1 when the operation fails (timed out, server\n"
    "unreachable, token refused: the reason goes to stderr), 2 on bad usage.\n";

static void die_store(void) {
  fprintf(stderr, "ddp-store: %s\n", ddp_last_error());
  exit(1);
}

static ddp_store_server *serving;

static void on_signal(int sig) {
  (void)sig;
  ddp_store_server_shutdown(serving); /* async-signal-safe */
}

static int serve(const char *bind_addr, long port, const char *token) {
  ddp_store_server_options opts = {.token = token};
  ddp_store_server *server;
  if (ddp_store_server_create(bind_addr, (uint16_t)port, &opts, &server) != DDP_OK) die_store();
  serving = server;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  printf("listening on %s\n", ddp_store_server_address(server));
  fflush(stdout);
  ddp_status st = ddp_store_server_run(server);
  if (st != DDP_OK) fprintf(stderr, "ddp-store: %s\n", ddp_last_error());
  ddp_store_server_stop(server);
  return st == DDP_OK ? 0 : 1;
}

/* "host:port", "[v6]:port". */
static void parse_addr(const char *addr, char *host, size_t host_bytes, uint16_t *port) {
  const char *colon;
  size_t hlen;
  if (addr[0] == '[') {
    const char *close = strchr(addr, ']');
    if (!close || close[1] != ':') cli_die_usage("bad --addr \"%s\" (expected [IPv6]:PORT)", addr);
    hlen = (size_t)(close - addr - 1);
    addr++;
    colon = close + 1;
  } else {
    colon = strrchr(addr, ':');
    if (!colon) cli_die_usage("bad --addr \"%s\" (expected HOST:PORT)", addr);
    hlen = (size_t)(colon - addr);
  }
  if (hlen == 0 || hlen >= host_bytes) cli_die_usage("bad host in --addr \"%s\"", addr);
  memcpy(host, addr, hlen);
  host[hlen] = '\0';
  char *end;
  errno = 0;
  long p = strtol(colon + 1, &end, 10);
  if (errno || *end || p <= 0 || p > 65535) cli_die_usage("bad port in --addr \"%s\"", addr);
  *port = (uint16_t)p;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
  cli_init("ddp-store");
  if (argc < 2) {
    fputs(usage, stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
    fputs(usage, stdout);
    return 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("ddp-store (ddp) %s\n", ddp_version());
    return 0;
  }
  const char *cmd = argv[1];
  const char *addr = getenv("DDP_STORE_ADDR");
  if (!addr || !*addr) addr = "127.0.0.1:29500";
  const char *bind_addr = NULL, *token = NULL;
  long port = DDP_STORE_DEFAULT_PORT;
  double timeout_s = -1;
  const char *args[64];
  int nargs = 0;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    const char *next = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      fputs(usage, stdout);
      return 0;
    } else if (!strcmp(a, "--addr") || !strcmp(a, "--bind") || !strcmp(a, "--port") ||
               !strcmp(a, "--timeout") || !strcmp(a, "--token")) {
      if (!next) cli_die_usage("%s needs a value", a);
      i++;
      if (!strcmp(a, "--addr")) addr = next;
      else if (!strcmp(a, "--bind")) bind_addr = next;
      else if (!strcmp(a, "--token")) token = next;
      else if (!strcmp(a, "--port")) {
        char *end;
        errno = 0;
        port = strtol(next, &end, 10);
        if (errno || *end || port < 0 || port > 65535) cli_die_usage("bad --port \"%s\"", next);
      } else {
        char *end;
        errno = 0;
        timeout_s = strtod(next, &end);
        if (errno || *end || !(timeout_s >= 0)) cli_die_usage("bad --timeout \"%s\"", next);
        if (timeout_s > 1e9) timeout_s = 1e9; /* ~31 years: "forever" */
      }
    } else if (!strcmp(a, "--")) {
      for (i++; i < argc && nargs < 64; i++) args[nargs++] = argv[i];
    } else if (a[0] == '-' && a[1] == '-') {
      cli_die_usage("unknown option %s", a);
    } else {
      if (nargs == 64) cli_die_usage("too many arguments%s", "");
      args[nargs++] = a;
    }
  }

  if (!strcmp(cmd, "serve")) {
    if (nargs) cli_die_usage("serve takes no arguments (got \"%s\")", args[0]);
    return serve(bind_addr, port, token);
  }

  struct {
    const char *name;
    int min_args, max_args;
  } cmds[] = {{"set", 2, 2},   {"get", 1, 1},    {"add", 2, 2},
              {"wait", 1, 64}, {"delete", 1, 1}, {"keys", 0, 0}};
  int known = -1;
  for (int i = 0; i < (int)(sizeof cmds / sizeof cmds[0]); i++)
    if (!strcmp(cmd, cmds[i].name)) known = i;
  if (known < 0) cli_die_usage("unknown command \"%s\"", cmd);
  if (nargs < cmds[known].min_args || nargs > cmds[known].max_args)
    cli_die_usage("wrong number of arguments for \"%s\"", cmd);

  char host[256];
  uint16_t server_port;
  parse_addr(addr, host, sizeof host, &server_port);
  ddp_store_options opts = {.token = token};
  if (timeout_s >= 0) {
    /* --timeout bounds the wait of get / wait (passed to them below);
     * connecting and the other calls get at least a second, so --timeout 0
     * asks "is it there now?" rather than failing to connect. */
    int64_t ms = (int64_t)(timeout_s * 1000 + 0.5);
    opts.timeout_ms = opts.connect_timeout_ms = ms > 1000 ? ms : 1000;
  }
  ddp_store *store;
  if (ddp_store_tcp_connect(host, server_port, &opts, &store) != DDP_OK) die_store();
  int64_t wait_ms = timeout_s >= 0 ? (int64_t)(timeout_s * 1000 + 0.5) : -1;

  ddp_status st = DDP_OK;
  if (!strcmp(cmd, "set")) {
    st = ddp_store_set(store, args[0], args[1], strlen(args[1]));
  } else if (!strcmp(cmd, "get")) {
    void *value;
    size_t bytes;
    st = ddp_store_get(store, args[0], wait_ms, &value, &bytes);
    if (st == DDP_OK) {
      fwrite(value, 1, bytes, stdout);
      if (isatty(STDOUT_FILENO)) putchar('\n');
      ddp_free(value);
    }
  } else if (!strcmp(cmd, "add")) {
    char *end;
    errno = 0;
    long long delta = strtoll(args[1], &end, 10);
    if (errno || *end || end == args[1]) cli_die_usage("DELTA \"%s\" is not an integer", args[1]);
    int64_t result;
    st = ddp_store_add(store, args[0], delta, &result);
    if (st == DDP_OK) printf("%" PRId64 "\n", result);
  } else if (!strcmp(cmd, "wait")) {
    st = ddp_store_wait(store, args, (size_t)nargs, wait_ms);
  } else if (!strcmp(cmd, "delete")) {
    int deleted;
    st = ddp_store_delete(store, args[0], &deleted);
    if (st == DDP_OK) printf("%d\n", deleted);
  } else {
    char **keys;
    size_t count;
    st = ddp_store_list_keys(store, &keys, &count);
    if (st == DDP_OK) {
      qsort(keys, count, sizeof *keys, cmp_str);
      for (size_t i = 0; i < count; i++) printf("%s\n", keys[i]);
      ddp_store_keys_free(keys, count);
    }
  }
  if (st != DDP_OK) die_store();
  ddp_store_destroy(store);
  return fflush(stdout) == 0 ? 0 : 1;
}
