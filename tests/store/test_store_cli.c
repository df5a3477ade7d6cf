/* ddp-store end to end: `serve --port 0` prints "listening on HOST:PORT"
 * first; set / get / add / keys / delete / wait through the tool against it;
 * failures exit 1 with the reason on stderr; SIGTERM stops the server
 * cleanly (exit 0). */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/core.h"

static char tool[512];
static char addr[64];
static pid_t server_pid;

/* Runs the tool with args; captures stdout and stderr (truncated to cap) and
 * returns the exit status (or 128+signal). Gives up after 10 s. */
static int run_tool(char *out, size_t out_cap, char *err, size_t err_cap, const char *const *args) {
  int po[2], pe[2];
  assert_int_equal(pipe(po), 0);
  assert_int_equal(pipe(pe), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(po[1], STDOUT_FILENO);
    dup2(pe[1], STDERR_FILENO);
    close(po[0]);
    close(pe[0]);
    char *argv[16];
    int n = 0;
    argv[n++] = "ddp-store";
    for (int i = 0; args[i] && n < 15; i++) argv[n++] = (char *)args[i];
    argv[n] = NULL;
    alarm(10);
    execv(tool, argv);
    _exit(127);
  }
  close(po[1]);
  close(pe[1]);
  size_t no = 0, ne = 0;
  ssize_t r;
  while ((r = read(po[0], out + no, out_cap - 1 - no)) > 0) no += (size_t)r;
  while ((r = read(pe[0], err + ne, err_cap - 1 - ne)) > 0) ne += (size_t)r;
  out[no] = '\0';
  err[ne] = '\0';
  close(po[0]);
  close(pe[0]);
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

#define RUN(...) \
  run_tool(out, sizeof out, err, sizeof err, (const char *const[]){__VA_ARGS__, NULL})

static int setup(void **state) {
  (void)state;
  const char *dir = getenv("DDP_BIN_DIR");
  snprintf(tool, sizeof tool, "%s/ddp-store", dir ? dir : "build/bin");
  int pipefd[2];
  if (pipe(pipefd) != 0) return -1;
  server_pid = fork();
  if (server_pid == 0) {
    dup2(pipefd[1], STDOUT_FILENO);
    close(pipefd[0]);
    close(pipefd[1]);
    alarm(60); /* never outlive the test */
    execl(tool, "ddp-store", "serve", "--port", "0", "--bind", "127.0.0.1", (char *)NULL);
    _exit(127);
  }
  close(pipefd[1]);
  char line[128] = {0};
  size_t n = 0;
  while (n < sizeof line - 1 && read(pipefd[0], line + n, 1) == 1 && line[n] != '\n') n++;
  line[n] = '\0';
  close(pipefd[0]);
  unsigned port;
  if (sscanf(line, "listening on 127.0.0.1:%u", &port) != 1) {
    fprintf(stderr, "first line was \"%s\"\n", line);
    kill(server_pid, SIGKILL);
    waitpid(server_pid, NULL, 0);
    return -1;
  }
  snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  kill(server_pid, SIGTERM);
  int status;
  waitpid(server_pid, &status, 0);
  /* SIGTERM is a clean shutdown. */
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

static void test_cli_operations(void **state) {
  (void)state;
  char out[4096], err[4096];
  assert_int_equal(RUN("set", "--addr", addr, "greeting", "hello world"), 0);
  assert_int_equal(RUN("get", "--addr", addr, "greeting"), 0);
  assert_string_equal(out, "hello world"); /* exactly the value: stdout is a pipe */
  assert_int_equal(RUN("add", "--addr", addr, "counter", "5"), 0);
  assert_string_equal(out, "5\n");
  assert_int_equal(RUN("add", "--addr", addr, "counter", "-8"), 0);
  assert_string_equal(out, "-3\n");
  assert_int_equal(RUN("get", "--addr", addr, "counter"), 0);
  assert_string_equal(out, "-3");
  assert_int_equal(RUN("keys", "--addr", addr), 0);
  assert_string_equal(out, "counter\ngreeting\n");
  assert_int_equal(RUN("wait", "--addr", addr, "--timeout", "1", "counter", "greeting"), 0);
  assert_int_equal(RUN("delete", "--addr", addr, "greeting"), 0);
  assert_string_equal(out, "1\n");
  assert_int_equal(RUN("delete", "--addr", addr, "greeting"), 0);
  assert_string_equal(out, "0\n");
  /* Timeouts fail with exit 1 and say what and where. */
  int64_t t0 = ddp_time_ns();
  assert_int_equal(RUN("wait", "--addr", addr, "--timeout", "0.2", "greeting"), 1);
  assert_true(ddp_time_ns() - t0 < 2000000000LL);
  char want[128];
  snprintf(want, sizeof want, "store %s: wait([\"greeting\"]) timed out after 200 ms", addr);
  assert_non_null(strstr(err, want));
  assert_int_equal(RUN("get", "--addr", addr, "--timeout", "0.2", "greeting"), 1);
  assert_non_null(strstr(err, "get(\"greeting\") timed out"));
  assert_int_equal(RUN("add", "--addr", addr, "counter", "x"), 2); /* usage */
  assert_int_equal(RUN("frobnicate", "--addr", addr), 2);
  assert_non_null(strstr(err, "unknown command"));
  /* The environment supplies the address. */
  setenv("DDP_STORE_ADDR", addr, 1);
  assert_int_equal(RUN("get", "counter"), 0);
  unsetenv("DDP_STORE_ADDR");
  assert_string_equal(out, "-3");
}

/* A wait through the tool is woken by another tool's set. */
static void test_cli_wait_woken_by_set(void **state) {
  (void)state;
  char out[256], err[256];
  pid_t setter = fork();
  if (setter == 0) {
    usleep(200 * 1000);
    execl(tool, "ddp-store", "set", "--addr", addr, "ready", "yes", (char *)NULL);
    _exit(127);
  }
  int64_t t0 = ddp_time_ns();
  assert_int_equal(RUN("get", "--addr", addr, "--timeout", "10", "ready"), 0);
  int64_t took_ms = (ddp_time_ns() - t0) / 1000000;
  waitpid(setter, NULL, 0);
  assert_string_equal(out, "yes");
  assert_true(took_ms >= 150 && took_ms < 5000);
}

static void test_cli_help_and_errors(void **state) {
  (void)state;
  char out[8192], err[1024];
  assert_int_equal(RUN("--help"), 0);
  const char *documented[] = {"serve",
                              "--port",
                              "--bind",
                              "--token",
                              "set",
                              "get",
                              "add",
                              "wait",
                              "delete",
                              "keys",
                              "--addr",
                              "--timeout",
                              "listening on HOST:PORT",
                              "DDP_STORE_ADDR",
                              "DDP_STORE_TOKEN",
                              "Exit status"};
  for (size_t i = 0; i < sizeof documented / sizeof documented[0]; i++)
    if (!strstr(out, documented[i])) fail_msg("--help does not mention %s", documented[i]);
  /* A second server on the same port: a clear error, exit 1. */
  const char *port = strchr(addr, ':') + 1;
  assert_int_equal(RUN("serve", "--port", port, "--bind", "127.0.0.1"), 1);
  assert_non_null(strstr(err, "address already in use"));
  assert_non_null(strstr(err, "MASTER_PORT"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cli_operations),
      cmocka_unit_test(test_cli_wait_woken_by_set),
      cmocka_unit_test(test_cli_help_and_errors),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
