/* DDP_CPU_KERNELS picks the CPU kernel family (src/tensor/cpu/family.c,
 * docs/tensor.md): each value is tried in a child process of its own,
 * since the choice is made once per process. And this process runs the
 * family its environment asks for, so scripts/test.sh's run of the numeric
 * tests with DDP_CPU_KERNELS=generic cannot run the AVX-512 kernels
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

static void test_each_value(void **state) {
  (void)state;
  const char *native = __builtin_cpu_supports("avx512f") ? "avx512" : "generic";
  static const struct {
    const char *value;
    int follows_cpu; /* 1: the CPU decides; 0: always generic */
  } cases[] = {{NULL, 1}, {"auto", 1}, {"avx512", 1}, {"generic", 0}, {"bogus", 1}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char got[32];
    family_in_child(cases[i].value, got, sizeof got);
    const char *want = cases[i].follows_cpu ? native : "generic";
    if (strcmp(got, want) != 0)
      fail_msg("DDP_CPU_KERNELS=%s: family %s, expected %s",
               cases[i].value ? cases[i].value : "(unset)", got, want);
  }
}

static void test_this_process_follows_its_environment(void **state) {
  (void)state;
  const char *v = getenv("DDP_CPU_KERNELS");
  const bool generic = (v && !strcmp(v, "generic")) || !__builtin_cpu_supports("avx512f");
  assert_string_equal(ddp_cpu_kernels(), generic ? "generic" : "avx512");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_each_value),
      cmocka_unit_test(test_this_process_follows_its_environment),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
