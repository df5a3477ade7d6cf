/* tools/ddp-train end to end, through the data layer: runs the built binary
 * ($DDP_BIN_DIR) and checks its JSON summary, its --log lines, early
 * stopping, that the ConvNet learns Fashion-MNIST through the loader, and
 * the exit status and message for bad data. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <cmocka.h>

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

typedef struct run_result {
  int status;        /* exit status */
  char out[1 << 16]; /* stdout */
  char err[1 << 16]; /* stderr */
} run_result;

static run_result result;

/* Runs ddp-train with `args`, capturing stdout and stderr. */
static void run(const char *args) {
  const char *bin = getenv("DDP_BIN_DIR");
  if (!bin) bin = "build/bin";
  char errpath[] = "/tmp/ddp-train-test-XXXXXX";
  int fd = mkstemp(errpath);
  assert_true(fd >= 0);
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "%s/ddp-train %s 2>%s", bin, args, errpath);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t n = fread(result.out, 1, sizeof result.out - 1, p);
  result.out[n] = '\0';
  int st = pclose(p);
  result.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  FILE *e = fdopen(fd, "r");
  n = fread(result.err, 1, sizeof result.err - 1, e);
  result.err[n] = '\0';
  fclose(e);
  unlink(errpath);
}

/* The value of "key" in the last line of stdout (the JSON summary); NaN for
 * null; fails when absent. */
static double summary(const char *key) {
  const char *last = result.out, *nl;
  while ((nl = strchr(last, '\n')) && nl[1]) last = nl + 1;
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\": ", key);
  const char *at = strstr(last, pat);
  if (!at) {
    fprintf(stderr, "no %s in: %s\nstderr: %s\n", key, last, result.err);
    fail();
  }
  at += strlen(pat);
  if (!strncmp(at, "null", 4)) return NAN;
  return strtod(at, NULL);
}

static void test_toy_regression_json_and_log(void **state) {
  (void)state;
  const char *log = "/tmp/ddp-train-test.jsonl";
  char args[256];
  snprintf(args, sizeof args,
           "--model toy --data regression --samples 1000 --batch-size 100 --epochs 2 "
           "--optimizer adam --lr 0.01 --workers 2 --log %s --json",
           log);
  run(args);
  assert_int_equal(result.status, 0);
  assert_int_equal((int)summary("steps"), 20);
  assert_int_equal((int)summary("epochs"), 2);
  assert_int_equal((int)summary("world_size"), 1);
  assert_true(isnan(summary("test_accuracy"))); /* regression: no accuracy */
  assert_true(summary("train_loss") > 0 && summary("train_loss") < 2);
  assert_true(summary("test_loss") > 0 && summary("test_loss") < 2);
  assert_true(summary("samples_per_s") > 0);
  /* 20 step lines then, per epoch, an evaluation line. */
  FILE *f = fopen(log, "r");
  assert_non_null(f);
  char line[512];
  int steps = 0, evals = 0;
  while (fgets(line, sizeof line, f)) {
    if (strstr(line, "\"test_loss\"")) {
      evals++;
      assert_non_null(strstr(line, "\"test_accuracy\": null"));
    } else {
      steps++;
      char want[64];
      snprintf(want, sizeof want, "{\"step\": %d, \"epoch\": %d, \"loss\": ", steps,
               (steps - 1) / 10);
      assert_true(strncmp(line, want, strlen(want)) == 0);
      assert_non_null(strstr(line, "\"lr\": 0.01"));
      assert_non_null(strstr(line, "\"samples_per_s\": "));
    }
  }
  fclose(f);
  unlink(log);
  assert_int_equal(steps, 20);
  assert_int_equal(evals, 2);
}

/* With lr 0 the test loss never improves after the first evaluation, so
 * --patience 2 with an evaluation every step stops after step 3. */
static void test_patience_stops_early(void **state) {
  (void)state;
  run("--model toy --samples 1000 --batch-size 10 --lr 0 --eval-every 1 --patience 2 --json");
  assert_int_equal(result.status, 0);
  assert_int_equal((int)summary("steps"), 3);
}

/* The seed's ConvNet learns Fashion-MNIST: 100 steps of SGD with momentum
 * reach well above chance (about 0.8 here; 0.1 is chance). */
static void test_convnet_learns(void **state) {
  (void)state;
  struct stat st;
  if (stat(FASHION_DIR, &st) != 0) {
    fprintf(stderr, "SKIP: %s is absent (Debian package dataset-fashion-mnist)\n", FASHION_DIR);
    skip();
  }
  run("--model convnet --max-steps 100 --lr 0.01 --momentum 0.9 --seed 1 --json");
  assert_int_equal(result.status, 0);
  assert_int_equal((int)summary("steps"), 100);
  assert_true(summary("test_accuracy") > 0.7);
  assert_true(summary("test_loss") < 0.8);
}

static void test_bad_input(void **state) {
  (void)state;
  run("--data /no/such/dir");
  assert_int_equal(result.status, 1);
  assert_non_null(strstr(result.err, "/no/such/dir"));
  assert_non_null(strstr(result.err, "train-images-idx3-ubyte"));
  run("--model toy --data toydata"); /* samples of 32, the model takes 10 */
  assert_true(result.status != 0);
  assert_non_null(strstr(result.err, "toydata"));
  run("--model convnet-11");
  assert_true(result.status != 0);
  assert_non_null(strstr(result.err, "convnet-N"));
  run("--optimizer rmsprop");
  assert_int_equal(result.status, 2);
  run("--epochs -1");
  assert_int_equal(result.status, 2);
  assert_non_null(strstr(result.err, "--epochs"));
  run("--help");
  assert_int_equal(result.status, 0);
  assert_non_null(strstr(result.out, "--max-steps"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_toy_regression_json_and_log),
      cmocka_unit_test(test_patience_stops_early),
      cmocka_unit_test(test_convnet_learns),
      cmocka_unit_test(test_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
