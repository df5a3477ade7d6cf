/* store (file): what the file store promises beyond the shared operation
 * suite -- two processes rendezvous through one file (a blocking get in one
 * woken by the other's set), a file that is not a store is refused naming
 * it, a record cut short by a writer that died is cut off while the rest
 * survives, a corrupt record is reported with its offset; and the default
 * timeout follows DDP_TIMEOUT. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "store/store_test_util.h"

static char path[256];

static int setup(void **state) {
  (void)state;
  snprintf(path, sizeof path, "/tmp/ddp_file_store_%d_XXXXXX", (int)getpid());
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  close(fd);
  unlink(path);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  unlink(path);
  return 0;
}

static ddp_store *open_store(void) {
  ddp_store_options o = {.timeout_ms = 10000};
  ddp_store *s = NULL;
  if (ddp_store_file_open(path, &o, &s) != DDP_OK) fail_msg("%s", ddp_last_error());
  return s;
}

static void append_bytes(const void *data, size_t len) {
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, data, len), (ssize_t)len);
  close(fd);
}

static void test_two_processes(void **state) {
  (void)state;
  ddp_store *s = open_store();
  pid_t pid = fork();
  if (pid == 0) {
    /* The child: wait for "ping" (set by the parent later), answer "pong". */
    ddp_store *c = open_store();
    void *v = NULL;
    size_t n;
    int ok = ddp_store_get(c, "ping", 5000, &v, &n) == DDP_OK && n == 4 && !memcmp(v, "ping", 4) &&
             ddp_store_set(c, "pong", "pong", 4) == DDP_OK &&
             ddp_store_add(c, "count", 1, NULL) == DDP_OK;
    ddp_free(v);
    ddp_store_destroy(c);
    _exit(ok ? 0 : 1);
  }
  test_sleep_ms(150);
  assert_int_equal(ddp_store_add(s, "count", 1, NULL), DDP_OK);
  assert_int_equal(ddp_store_set(s, "ping", "ping", 4), DDP_OK);
  void *v;
  size_t n;
  int64_t t0 = test_now_ms();
  assert_int_equal(ddp_store_get(s, "pong", 5000, &v, &n), DDP_OK);
  assert_true(test_now_ms() - t0 < 2000);
  assert_memory_equal(v, "pong", 4);
  ddp_free(v);
  int status;
  waitpid(pid, &status, 0);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  int64_t count;
  assert_int_equal(ddp_store_add(s, "count", 0, &count), DDP_OK);
  assert_int_equal(count, 2); /* both adds, none lost */
  ddp_store_destroy(s);
}

static void test_not_a_store_is_refused(void **state) {
  (void)state;
  append_bytes("hello, I am a text file\n", 24);
  ddp_store_options o = {.timeout_ms = 1000};
  ddp_store *s = NULL;
  assert_int_equal(ddp_store_file_open(path, &o, &s), DDP_ERR_FORMAT);
  assert_null(s);
  assert_non_null(strstr(ddp_last_error(), path));
  assert_non_null(strstr(ddp_last_error(), "is not a ddp file store"));
}

static void test_partial_record_is_cut_off(void **state) {
  (void)state;
  ddp_store *s = open_store();
  assert_int_equal(ddp_store_set(s, "kept", "yes", 3), DDP_OK);
  /* A writer died after 6 bytes of a set record. */
  const uint8_t partial[6] = {1, 4, 0, 0, 0, 'l'};
  append_bytes(partial, sizeof partial);
  ddp_store *t = open_store();
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(t, "kept", 0, &v, &n), DDP_OK);
  assert_memory_equal(v, "yes", 3);
  ddp_free(v);
  assert_int_equal(ddp_store_set(t, "after", "1", 1), DDP_OK);
  assert_int_equal(ddp_store_get(s, "after", 1000, &v, &n), DDP_OK); /* the other handle sees it */
  ddp_free(v);
  int64_t count;
  assert_int_equal(ddp_store_num_keys(s, &count), DDP_OK);
  assert_int_equal(count, 2);
  ddp_store_destroy(t);
  ddp_store_destroy(s);
}

static void test_corrupt_record_names_offset(void **state) {
  (void)state;
  ddp_store *s = open_store();
  assert_int_equal(ddp_store_set(s, "a", "1", 1), DDP_OK); /* 8 + 1+4+1+4+1 = offset 19 */
  const uint8_t junk[10] = {77, 1, 0, 0, 0, 'x', 1, 0, 0, 0};
  append_bytes(junk, sizeof junk);
  void *v;
  size_t n;
  assert_int_equal(ddp_store_get(s, "a", 0, &v, &n), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "corrupt record (type 77) at offset 19"));
  assert_non_null(strstr(ddp_last_error(), path));
  ddp_store_destroy(s);
}

static void test_default_timeout_from_env(void **state) {
  (void)state;
  setenv("DDP_TIMEOUT", "0.3", 1);
  assert_int_equal(ddp_store_default_timeout_ms(), 300);
  ddp_store *m;
  assert_int_equal(ddp_store_mem_create(NULL, &m), DDP_OK);
  assert_int_equal(ddp_store_timeout_ms(m), 300);
  void *v;
  size_t n;
  int64_t t0 = test_now_ms();
  assert_int_equal(ddp_store_get(m, "absent", -1, &v, &n), DDP_ERR_TIMEOUT);
  int64_t took = test_now_ms() - t0;
  assert_true(took >= 280 && took < 1500);
  assert_non_null(strstr(ddp_last_error(), "timed out after 300 ms"));
  ddp_store_destroy(m);
  setenv("DDP_TIMEOUT", "soon", 1); /* malformed: warns, uses PyTorch's 1800 s */
  assert_int_equal(ddp_store_default_timeout_ms(), 1800000);
  unsetenv("DDP_TIMEOUT");
  assert_int_equal(ddp_store_default_timeout_ms(), 1800000);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_two_processes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_not_a_store_is_refused, setup, teardown),
      cmocka_unit_test_setup_teardown(test_partial_record_is_cut_off, setup, teardown),
      cmocka_unit_test_setup_teardown(test_corrupt_record_names_offset, setup, teardown),
      cmocka_unit_test(test_default_timeout_from_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
