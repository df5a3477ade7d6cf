/* A stage killed mid-step, with real processes (one per stage, shared
 * memory between them, a file store): every other stage's step fails within
 * 5 s of the kill, and its error names the killed stage and its rank, also
 * on the stages that are not its neighbours (they learn it from the failure
 * notice their neighbours leave before aborting their channels). Each child
 * has an alarm, and the parent reaps them all. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "pp_test_util.h"

#define MAX_RANKS 4

typedef struct {
  int64_t kill_ns;            /* when the victim killed itself */
  int64_t fail_ns[MAX_RANKS]; /* when each survivor's step failed */
  int steps[MAX_RANKS];       /* steps each rank completed */
  char msg[MAX_RANKS][1024];  /* each survivor's error */
} shared_state;

static shared_state *shared;

static void *killer(void *arg) {
  (void)arg;
  usleep(30 * 1000);
  shared->kill_ns = ddp_time_ns();
  raise(SIGKILL);
  return NULL;
}

static void child(const char *path, int rank, int world, int victim) {
  alarm(60);
  ddp_store_options so = {.timeout_ms = 30000};
  ddp_store *store;
  ddp_process_group_options po = {.timeout_s = 30};
  ddp_process_group *pg;
  if (ddp_store_file_open(path, &so, &store) != DDP_OK ||
      ddp_process_group_create(store, rank, world, &po, &pg) != DDP_OK) {
    snprintf(shared->msg[rank], sizeof shared->msg[rank], "setup: %s", ddp_last_error());
    _exit(3);
  }
  ddp_model *full;
  ddp_pipeline_options o = ddp_pipeline_defaults();
  o.schedule = DDP_PIPELINE_1F1B;
  o.n_microbatches = 8;
  o.max_batch = 4096;
  o.split = world == 4 ? "4,8,12" : "8";
  ddp_pipeline *pp;
  if (ppt_build("mlp", &full) != DDP_OK || ddp_pipeline_create(&pp, full, pg, &o) != DDP_OK) {
    snprintf(shared->msg[rank], sizeof shared->msg[rank], "create: %s", ddp_last_error());
    _exit(4);
  }
  ddp_model_destroy(full);
  int64_t n = 4096;
  float *xb = malloc(sizeof(float) * (size_t)n * 784);
  float *yb = malloc(sizeof(float) * (size_t)n * PPT_MLP_OUT);
  ddp_tensor x, y;
  ppt_batch("mlp", 0, n, xb, yb, &x, &y);
  for (int step = 0;; step++) {
    if (rank == victim && step == 3) {
      pthread_t t;
      pthread_create(&t, NULL, killer, NULL);
    }
    ddp_status s = ddp_pipeline_step(pp, rank == 0 ? &x : NULL, ddp_pipeline_is_last(pp) ? &y : NULL,
                                     NULL);
    if (s != DDP_OK) {
      shared->fail_ns[rank] = ddp_time_ns();
      snprintf(shared->msg[rank], sizeof shared->msg[rank], "%s", ddp_last_error());
      break;
    }
    shared->steps[rank] = step + 1;
    if (step > 10000) _exit(5); /* the victim never died */
  }
  ddp_pipeline_destroy(pp);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);
  _exit(0);
}

static void run(int world, int victim) {
  shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(shared != MAP_FAILED);
  memset(shared, 0, sizeof *shared);
  char path[] = "/tmp/test_pipeline_fault_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  unlink(path);
  pid_t pids[MAX_RANKS];
  for (int r = 0; r < world; r++) {
    pids[r] = fork();
    assert_true(pids[r] >= 0);
    if (pids[r] == 0) child(path, r, world, victim);
  }
  int codes[MAX_RANKS];
  for (int r = 0; r < world; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  }
  unlink(path);
  char want[64];
  snprintf(want, sizeof want, "stage %d (rank %d)", victim, victim);
  assert_true(shared->kill_ns > 0);
  assert_int_equal(codes[victim], 128 + SIGKILL);
  for (int r = 0; r < world; r++) {
    if (r == victim) continue;
    double after = (double)(shared->fail_ns[r] - shared->kill_ns) * 1e-9;
    printf("rank %d: exit %d after %d steps, failed %.3f s after the kill: %s\n", r, codes[r],
           shared->steps[r], after, shared->msg[r]);
    assert_int_equal(codes[r], 0);
    assert_true(shared->fail_ns[r] > 0);
    assert_true(after < 5.0);
    assert_non_null(strstr(shared->msg[r], want));
  }
  munmap(shared, sizeof *shared);
}

/* Two stages: the survivor waits on the victim directly. */
static void test_kill_second_of_two(void **state) { (void)state; run(2, 1); }
/* Four stages, stage 1 killed: stage 3 never talks to it. */
static void test_kill_second_of_four(void **state) { (void)state; run(4, 1); }
/* The first stage killed: the rest wait for activations. */
static void test_kill_first_of_four(void **state) { (void)state; run(4, 0); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kill_second_of_two),
      cmocka_unit_test(test_kill_second_of_four),
      cmocka_unit_test(test_kill_first_of_four),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
