/* NCCL loaded at run time (src/comm/nccl/loader.c), on the CPU: a library
 * that is absent fails naming every path tried and the loader's reason,
 * and how to fix it; DDP_NCCL_LIBRARY is the only candidate when set; the
 * toolkit's libnccl.so.2 (when this machine has one) loads and reports the
 * version its nccl.h was built with as its own, through ddp_nccl_version. No
 * GPU is needed: loading NCCL and asking its version touch none. */
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
  assert_int_equal(api.version, NCCL_VERSION_CODE); /* the header the build used */
  /* The process's NCCL through the public call, named by DDP_NCCL_LIBRARY. */
  setenv("DDP_NCCL_LIBRARY", path, 1);
  char text[600];
  if (ddp_nccl_version(text, sizeof text) != DDP_OK) fail_msg("%s", ddp_last_error());
  char want[32];
  ddp__nccl_version_str(NCCL_VERSION_CODE, want, sizeof want);
  if (strncmp(text, want, strlen(want)) != 0) fail_msg("version \"%s\", want \"%s ...\"", text, want);
  assert_non_null(strstr(text, path));
  unsetenv("DDP_NCCL_LIBRARY");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_absent),
      cmocka_unit_test(test_candidates),
      cmocka_unit_test(test_loads_toolkit_nccl),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
