/* DDP_CPU_KERNELS picks the CPU kernel family (src/tensor/cpu/family.c,
 * docs/tensor.md): each value is tried in a child process of its own,
 * since the choice is made once per process. And this process runs the
 * family its environment asks for, so scripts/test.sh's runs of the numeric
 * tests with DDP_CPU_KERNELS=generic and =avx2 cannot run another family
 * unnoticed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/tensor.h"

/* ddp_cpu_kernels() in a child with DDP_CPU_KERNELS=value (NULL: unset). */
static void family_in_child(const char *value, char *out, size_t bytes) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    if (value) setenv("DDP_CPU_KERNELS", value, 1);
    else unsetenv("DDP_CPU_KERNELS");
    const char *f = ddp_cpu_kernels();
    ssize_t n = write(fds[1], f, strlen(f));
    _exit(n == (ssize_t)strlen(f) ? 0 : 1);
  }
  close(fds[1]);
  ssize_t n = read(fds[0], out, bytes - 1);
  close(fds[0]);
  int status;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  assert_true(n > 0);
  out[n] = '\0';
}

/* What each family needs of the CPU, asked here apart from family.c. */
static bool cpu_has_avx2(void) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static const char *best_family(void) {
  return __builtin_cpu_supports("avx512f") ? "avx512" : cpu_has_avx2() ? "avx2" : "generic";
}

/* The family a value of DDP_CPU_KERNELS gets on this CPU: auto, unset and
 * unknown values the best; a family the CPU can run that family; one it
 * cannot the best it has. */
static const char *expected_family(const char *value) {
  if (!value || !strcmp(value, "auto")) return best_family();
  if (!strcmp(value, "generic")) return "generic";
  if (!strcmp(value, "avx2")) return cpu_has_avx2() ? "avx2" : best_family();
  if (!strcmp(value, "avx512"))
    return __builtin_cpu_supports("avx512f") ? "avx512" : best_family();
  return best_family();
}

static void test_each_value(void **state) {
  (void)state;
  static const char *const values[] = {NULL, "auto", "avx512", "avx2", "generic", "bogus"};
  for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
    char got[32];
    family_in_child(values[i], got, sizeof got);
    const char *want = expected_family(values[i]);
    if (strcmp(got, want) != 0)
      fail_msg("DDP_CPU_KERNELS=%s: family %s, expected %s", values[i] ? values[i] : "(unset)",
               got, want);
  }
}

/* Pins the family of each value on the CPUs that can run it: on one with
 * AVX2 (any x86-64 here), avx2 must run the AVX2 family, not fall back. */
static void test_avx2_is_met_where_the_cpu_has_it(void **state) {
  (void)state;
  if (!cpu_has_avx2()) {
    fprintf(stderr, "SKIP: this CPU has no AVX2 and FMA\n");
    skip();
  }
  char got[32];
  family_in_child("avx2", got, sizeof got);
  assert_string_equal(got, "avx2");
}

static void test_this_process_follows_its_environment(void **state) {
  (void)state;
  assert_string_equal(ddp_cpu_kernels(), expected_family(getenv("DDP_CPU_KERNELS")));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_each_value),
      cmocka_unit_test(test_avx2_is_met_where_the_cpu_has_it),
      cmocka_unit_test(test_this_process_follows_its_environment),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
