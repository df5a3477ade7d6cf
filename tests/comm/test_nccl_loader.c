/* NCCL loaded at run time (src/comm/nccl/loader.c), on the CPU: a library
 * that is absent fails naming every path tried and the loader's reason,
 * and how to fix it; DDP_NCCL_LIBRARY is the only candidate when set; the
 * toolkit's libnccl.so.2 (DDP_TEST_NCCL, when this machine has one) loads
 * and reports its version (under ctest, the build's nccl.h's), also
 * through ddp_nccl_version; a group asking for backend "nccl" with the
 * library absent fails naming it. No GPU is needed: loading NCCL and asking
 * its version touch none. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "comm/nccl/nccl_api.h"
#include "ddp/ddp.h"

static void expect_msg(const char *substring) {
  if (!strstr(ddp_last_error(), substring))
    fail_msg("message \"%s\" does not contain \"%s\"", ddp_last_error(), substring);
}

static void test_absent(void **state) {
  (void)state;
  const char *c[] = {"/nonexistent/libnccl.so.2", "libnccl-not-here.so.9"};
  ddp__nccl_api api;
  assert_int_equal(ddp__nccl_api_open(c, 2, &api), DDP_ERR_UNSUPPORTED);
  expect_msg("tried /nonexistent/libnccl.so.2: ");
  expect_msg("; libnccl-not-here.so.9: ");
  expect_msg("DDP_NCCL_LIBRARY");
  assert_null(api.handle);
  /* A library that loads but is not NCCL (libm): refused naming what it lacks. */
  const char *m[] = {"libm.so.6"};
  assert_int_equal(ddp__nccl_api_open(m, 1, &api), DDP_ERR_UNSUPPORTED);
  expect_msg("libm.so.6: lacks ncclGetVersion");
}

static void test_candidates(void **state) {
  (void)state;
  const char *c[3];
  setenv("DDP_NCCL_LIBRARY", "/opt/x/libnccl.so.2", 1);
  assert_int_equal(ddp__nccl_api_candidates(c), 1);
  assert_string_equal(c[0], "/opt/x/libnccl.so.2");
  unsetenv("DDP_NCCL_LIBRARY");
  int n = ddp__nccl_api_candidates(c);
  assert_true(n >= 1);
  assert_string_equal(c[0], "libnccl.so.2");
  char v[32];
  ddp__nccl_version_str(22809, v, sizeof v);
  assert_string_equal(v, "2.28.9");
  ddp__nccl_version_str(2708, v, sizeof v); /* NCCL 2.7.8's old encoding */
  assert_string_equal(v, "2.7.8");
}

/* The toolkit's own library, where this machine has it (CUDA's folder). */
static void test_loads_toolkit_nccl(void **state) {
  (void)state;
  const char *path = getenv("DDP_TEST_NCCL");
  if (!path || access(path, R_OK) != 0) {
    printf("SKIP: no libnccl.so.2 at DDP_TEST_NCCL (%s)\n", path ? path : "unset");
    skip();
  }
  ddp__nccl_api api;
  const char *c[] = {"/nonexistent/libnccl.so.2", path};
  if (ddp__nccl_api_open(c, 2, &api) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_string_equal(api.path, path);
  /* The toolkit's library is the header's version (ctest says so); another
   * machine's (a PyTorch wheel's) is at least what the backend needs. */
  if (getenv("DDP_TEST_NCCL_IS_BUILDS")) assert_int_equal(api.version, NCCL_VERSION_CODE);
  if (api.version < 21300) fail_msg("NCCL version code %d: older than 2.13", api.version);
  /* The process's NCCL through the public call, named by DDP_NCCL_LIBRARY. */
  setenv("DDP_NCCL_LIBRARY", path, 1);
  char text[600];
  if (ddp_nccl_version(text, sizeof text) != DDP_OK) fail_msg("%s", ddp_last_error());
  char want[32];
  ddp__nccl_version_str(api.version, want, sizeof want);
  if (strncmp(text, want, strlen(want)) != 0) fail_msg("version \"%s\", want \"%s ...\"", text, want);
  assert_non_null(strstr(text, path));
  unsetenv("DDP_NCCL_LIBRARY");
}

/* Through the public API: the group's creation fails naming the path. */
static void test_group_without_library(void **state) {
  (void)state;
  setenv("DDP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(NULL, &store), DDP_OK);
  ddp_process_group_options o = {.timeout_s = 10, .backend = "nccl"};
  ddp_process_group *pg = NULL;
  assert_int_equal(ddp_process_group_create(store, 0, 1, &o, &pg), DDP_ERR_UNSUPPORTED);
  expect_msg("tried /nonexistent/libnccl.so.2: ");
  assert_null(pg);
  char v[64];
  assert_int_equal(ddp_nccl_version(v, sizeof v), DDP_ERR_UNSUPPORTED);
  expect_msg("/nonexistent/libnccl.so.2");
  unsetenv("DDP_NCCL_LIBRARY");
  ddp_store_destroy(store);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_absent),
      cmocka_unit_test(test_group_without_library),
      cmocka_unit_test(test_candidates),
      cmocka_unit_test(test_loads_toolkit_nccl),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
