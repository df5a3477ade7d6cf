/* Data parallelism with real processes: W forked ranks meet in a file store,
 * their group moves data through shared memory, and after 10 SGD steps each
 * rank's parameters equal the single process's (toy and the ConvNet in eval
 * mode, W = 2 and 3). Every child is killed if the run exceeds its deadline,
 * and the store file is removed, so nothing hangs or is left behind. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "parallel/dp_test_util.h"

/* A child's exit codes: 0 ok, 10 setup, 11 training, 12 wrong transport,
 * 13 not equal to the reference. */
static int child(const char *store_path, int rank, const dpt_cfg *cfg) {
  ddp_store *store;
  ddp_store_options so = {.timeout_ms = 30000};
  if (ddp_store_file_open(store_path, &so, &store) != DDP_OK) return 10;
  ddp_process_group_options po = {.timeout_s = 30};
  ddp_process_group *pg;
  if (ddp_process_group_create(store, rank, cfg->world, &po, &pg) != DDP_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error());
    return 10;
  }
  ddp_store_destroy(store);
  const char *transport = ddp_process_group_transport(pg, (rank + 1) % cfg->world);
  if (strcmp(transport, "shm") != 0) {
    fprintf(stderr, "rank %d: transport %s, expected shm\n", rank, transport);
    return 12;
  }
  ddp_model *model, *reference, *initial;
  if (ddp_model_build(cfg->model, NULL, 100 + (uint64_t)rank, &model) != DDP_OK ||
      ddp_model_build(cfg->model, NULL, 100, &reference) != DDP_OK ||
      ddp_model_build(cfg->model, NULL, 100, &initial) != DDP_OK)
    return 10;
  ddp_dp *dp;
  if (ddp_dp_create(&dp, model, pg, NULL) != DDP_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error());
    return 10;
  }
  if (dpt_train(cfg, model, dp, rank) != DDP_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, ddp_last_error());
    return 11;
  }
  /* The single run, computed in every child (cheap), as the reference. */
  if (dpt_train(cfg, reference, NULL, 0) != DDP_OK) return 11;
  char msg[512];
  int rc = 0;
  if (!dpt_params_close_to_update(model, reference, initial, 1e-2, msg, sizeof msg)) {
    fprintf(stderr, "rank %d: vs the single run: %s\n", rank, msg);
    rc = 13;
  }
  ddp_dp_destroy(dp);
  ddp_model_destroy(model);
  ddp_model_destroy(reference);
  ddp_model_destroy(initial);
  ddp_process_group_destroy(pg);
  return rc;
}

static void run_procs(dpt_cfg cfg) {
  char path[] = "/tmp/ddp-dp-procs-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  unlink(path); /* the file store creates it */
  pid_t pids[DPT_MAX_RANKS];
  for (int r = 0; r < cfg.world; r++) {
    pids[r] = fork();
    assert_true(pids[r] >= 0);
    if (pids[r] == 0) _exit(child(path, r, &cfg));
  }
  double deadline = ddp_time_s() + 60;
  int status[DPT_MAX_RANKS], left = cfg.world;
  bool done[DPT_MAX_RANKS] = {false};
  while (left > 0 && ddp_time_s() < deadline) {
    for (int r = 0; r < cfg.world; r++)
      if (!done[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        done[r] = true;
        left--;
      }
    if (left) usleep(10000);
  }
  for (int r = 0; r < cfg.world; r++)
    if (!done[r]) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], &status[r], 0);
      fprintf(stderr, "rank %d did not finish within 60 s: killed\n", r);
    }
  unlink(path);
  for (int r = 0; r < cfg.world; r++) {
    if (!done[r]) fail_msg("%s world %d: rank %d hung", cfg.model, cfg.world, r);
    if (!WIFEXITED(status[r]) || WEXITSTATUS(status[r]) != 0)
      fail_msg("%s world %d: rank %d exited with %d", cfg.model, cfg.world, r,
               WIFEXITED(status[r]) ? WEXITSTATUS(status[r]) : -WTERMSIG(status[r]));
  }
}

static void test_toy_processes(void **state) {
  (void)state;
  run_procs(dpt_defaults("toy", 2));
  run_procs(dpt_defaults("toy", 3));
}

static void test_convnet_eval_processes(void **state) {
  (void)state;
  dpt_cfg c = dpt_defaults("convnet", 2);
  c.eval = true;
  run_procs(c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_toy_processes),
      cmocka_unit_test(test_convnet_eval_processes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
