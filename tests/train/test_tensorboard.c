/* TensorBoard event files read back by the tensorboard package's own reader
 * (issue 27). This program writes runs into a temporary directory, with
 * what each must hold in expected.jsonl beside them, and runs
 * tests/train/tensorboard_check.py with the reference environment's Python
 * ($DDP_TORCH_PY, default /opt/torch-venv/bin/python), which reads them
 * with EventAccumulator and compares every scalar, step and text:
 *  - synthetic: scalars at chosen steps and wall times (0, -0, a denormal,
 *    3.4e38, 1/3, steps -3 and 2^40, two tags in one event) and a UTF-8
 *    Markdown text;
 *  - truncated: that file cut inside its last record, as a killed run
 *    leaves it: everything before the cut still reads;
 *  - train: the toy model trained for 2 epochs through ddp_trainer with
 *    ddp_train_tensorboard_attach and the JSON-lines log: every step's and
 *    evaluation's values as the chained callback saw them (float32 of them,
 *    exactly) and as the log has them (to its 6 digits), the options text;
 *  - dp: the same on a group of 2 ranks (threads): one file, rank 0's.
 * In C it checks that the chained callbacks see every step, that their
 * stop requests still stop the run, and that a failed write (a full disk)
 * lets training finish and is returned by close. Exits 77 (skipped), saying so, when that
 * Python or its tensorboard package is missing; the C checks ran by then. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "io/io_internal.h"
#include "parallel/dp_test_util.h"

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    if (!(cond)) {                                                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                \
      fprintf(stderr, __VA_ARGS__);                                       \
      fprintf(stderr, "\n");                                              \
      exit(1);                                                            \
    }                                                                     \
  } while (0)
#define CHECK_OK(expr) \
  do {                                                                    \
    ddp_status s_ = (expr);                                               \
    CHECK(s_ == DDP_OK, "%s: %s: %s", #expr, ddp_status_name(s_), ddp_last_error()); \
  } while (0)

static char root[64];
static FILE *expected; /* expected.jsonl */
static pthread_mutex_t expected_mu = PTHREAD_MUTEX_INITIALIZER;

static void expect_scalar(const char *run, const char *tag, int64_t step, double value,
                          double wall) {
  if (!isfinite(value)) return; /* left out, as the log's nulls */
  pthread_mutex_lock(&expected_mu);
  fprintf(expected, "{\"run\": \"%s\", \"tag\": \"%s\", \"step\": %lld, \"value\": %.17g", run,
          tag, (long long)step, value);
  if (isnan(wall)) fprintf(expected, "}\n");
  else fprintf(expected, ", \"wall\": %.17g}\n", wall);
  pthread_mutex_unlock(&expected_mu);
}

static void put_json_string(const char *s) {
  size_t cap = 4 * strlen(s) + 64, pos = 0;
  char *buf = malloc(cap);
  CHECK(ddp__json_put_string(buf, cap, &pos, s), "escaping a string");
  fwrite(buf, 1, pos, expected);
  free(buf);
}

/* ---- synthetic ------------------------------------------------------------- */

static char synthetic_path[512];

static void write_synthetic(void) {
  char dir[128];
  snprintf(dir, sizeof dir, "%s/synthetic", root);
  ddp_summary_writer *w;
  CHECK_OK(ddp_summary_writer_create(&w, dir, NULL));
  snprintf(synthetic_path, sizeof synthetic_path, "%s", ddp_summary_writer_path(w));
  const float plain[] = {0.1f, -0.0f, 1e-40f, 3.4e38f, 1.0f / 3.0f};
  for (int i = 0; i < 5; i++) {
    double wall = 1.7e9 + i + 0.125;
    CHECK_OK(ddp_summary_writer_add_scalar(w, "s/plain", plain[i], i, wall));
    expect_scalar("synthetic", "s/plain", i, plain[i], wall);
    expect_scalar("truncated", "s/plain", i, plain[i], wall);
  }
  const int64_t steps[] = {10, (int64_t)1 << 40, -3};
  for (int i = 0; i < 3; i++) {
    const char *tags[2] = {"s/multi_a", "s/multi_b"};
    float values[2] = {(float)i - 0.5f, 1e6f * (float)(i + 1)};
    CHECK_OK(ddp_summary_writer_add_scalars(w, 2, tags, values, steps[i], 1.8e9 + i));
    for (int k = 0; k < 2; k++) {
      expect_scalar("synthetic", tags[k], steps[i], values[k], 1.8e9 + i);
      expect_scalar("truncated", tags[k], steps[i], values[k], 1.8e9 + i);
    }
  }
  const char *text = "# Notes\n\nh\xc3\xa9llo | `x` \xe2\x9c\x93\n\n| a | b |\n|---|---|\n| 1 | 2 |";
  CHECK_OK(ddp_summary_writer_add_text(w, "notes", text, 5, 1.9e9));
  fprintf(expected, "{\"run\": \"synthetic\", \"text_tag\": \"notes/text_summary\", \"step\": 5, \"text\": ");
  put_json_string(text);
  fprintf(expected, "}\n");
  fprintf(expected, "{\"run\": \"synthetic\", \"records\": 10}\n");
  ddp_summary_writer_destroy(w);

  /* The same file cut 3 bytes before its end (inside the last record's
   * footer), under the same name in another run's directory. */
  char tdir[128], tpath[640];
  snprintf(tdir, sizeof tdir, "%s/truncated", root);
  CHECK(mkdir(tdir, 0777) == 0, "mkdir %s: %s", tdir, strerror(errno));
  snprintf(tpath, sizeof tpath, "%s/%s", tdir, strrchr(synthetic_path, '/') + 1);
  FILE *in = fopen(synthetic_path, "rb"), *out = fopen(tpath, "wb");
  CHECK(in && out, "copying %s", synthetic_path);
  fseek(in, 0, SEEK_END);
  long n = ftell(in) - 3;
  fseek(in, 0, SEEK_SET);
  char *buf = malloc((size_t)n);
  CHECK(fread(buf, 1, (size_t)n, in) == (size_t)n && fwrite(buf, 1, (size_t)n, out) == (size_t)n,
        "copying %s", synthetic_path);
  free(buf);
  fclose(in);
  fclose(out);
  fprintf(expected, "{\"run\": \"truncated\", \"records\": 9, \"partial\": true}\n");
}

/* ---- training runs --------------------------------------------------------- */

typedef struct seen {
  const char *run; /* NULL: record nothing (ranks other than 0) */
  int64_t steps, evals, starts;
  int64_t stop_at; /* > 0: on_step asks to stop there */
} seen;

static void on_start(const ddp_train_start_info *info, void *user) {
  seen *v = user;
  (void)info;
  v->starts++;
}

static bool on_step(const ddp_train_step_info *info, void *user) {
  seen *v = user;
  v->steps++;
  if (v->run) {
    const ddp_train_phases *p = &info->phases;
    expect_scalar(v->run, "train/loss", info->step, info->loss, NAN);
    expect_scalar(v->run, "train/lr", info->step, info->lr, NAN);
    expect_scalar(v->run, "train/samples_per_s", info->step, info->samples_per_s, NAN);
    expect_scalar(v->run, "phases/load_ms", info->step, p->load_ms, NAN);
    expect_scalar(v->run, "phases/forward_ms", info->step, p->forward_ms, NAN);
    expect_scalar(v->run, "phases/backward_compute_ms", info->step, p->backward_compute_ms, NAN);
    expect_scalar(v->run, "phases/backward_comm_ms", info->step, p->backward_comm_ms, NAN);
    expect_scalar(v->run, "phases/optimizer_ms", info->step, p->optimizer_ms, NAN);
    expect_scalar(v->run, "phases/step_ms", info->step, p->step_ms, NAN);
    expect_scalar(v->run, "phases/preempted_ms", info->step, p->preempted_ms, NAN);
  }
  return v->stop_at > 0 && info->step == v->stop_at;
}

static bool on_eval(const ddp_train_eval_info *info, void *user) {
  seen *v = user;
  v->evals++;
  if (v->run) {
    expect_scalar(v->run, "test/loss", info->step, info->test_loss, NAN);
    expect_scalar(v->run, "test/accuracy", info->step, info->test_accuracy, NAN);
  }
  return false;
}

/* Trains seed 001's toy model on its regression data (512 samples, batch
 * 16 per rank), 2 epochs, evaluating every 10 steps, with the log and the
 * event files in root/<run>. */
static ddp_status train_toy(const char *run, ddp_process_group *pg, seen *v,
                            ddp_train_result *res, const char **event_path,
                            ddp_status *tb_status) {
  int rank = pg ? ddp_process_group_rank(pg) : 0;
  ddp_model *model = NULL;
  ddp_dataset *train = NULL, *test = NULL;
  ddp_trainer *t = NULL;
  ddp_train_tensorboard *tb = NULL;
  char dir[128], log[160];
  snprintf(dir, sizeof dir, "%s/%s", root, run);
  snprintf(log, sizeof log, "%s/%s.jsonl", root, run);
  static const ddp_kv meta[] = {{"ddp-train.model", "toy"}, {"ddp-train.data", "regression|x"}};
  ddp_status s = ddp_model_build("toy", NULL, 7, &model);
  if (s == DDP_OK) s = ddp_dataset_create_regression(&train, 512, 7);
  if (s == DDP_OK) s = ddp_dataset_create_regression(&test, 128, 1000010);
  ddp_train_options o = ddp_train_defaults();
  o.epochs = 2;
  o.batch_size = 16;
  o.optim.lr = 0.05;
  o.optim.sgd.momentum = 0.9;
  o.workers = 0;
  o.eval_every = 10;
  o.log_path = tb_status ? NULL : log;
  o.checkpoint_meta = meta;
  o.checkpoint_meta_count = 2;
  o.callbacks = (ddp_train_callbacks){on_start, on_step, on_eval, v};
  if (s == DDP_OK) s = ddp_train_tensorboard_attach(&tb, &o, dir, pg);
  if (s == DDP_OK && event_path) *event_path = ddp_train_tensorboard_path(tb);
  if (s == DDP_OK && (rank == 0) != (ddp_train_tensorboard_path(tb) != NULL))
    s = ddp_error(DDP_ERR_INTERNAL, "rank %d: event file %s", rank,
                  ddp_train_tensorboard_path(tb) ? "made" : "missing");
  if (s == DDP_OK) s = ddp_trainer_create(&t, model, train, test, pg, &o);
  if (s == DDP_OK) s = ddp_trainer_run(t, res);
  ddp_trainer_destroy(t);
  ddp_status closed = ddp_train_tensorboard_close(tb);
  if (tb_status) *tb_status = closed;
  else if (s == DDP_OK) s = closed;
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(model);
  if (s == DDP_OK && v->run) {
    fprintf(expected, "{\"run\": \"%s\", \"log\": \"%s\", \"world_size\": %d}\n", run, log,
            pg ? ddp_process_group_size(pg) : 1);
  }
  return s;
}

static void train_single(void) {
  seen v = {.run = "train"};
  ddp_train_result r;
  const char *path = NULL;
  CHECK_OK(train_toy("train", NULL, &v, &r, &path, NULL));
  /* 512 / 16 = 32 steps an epoch; evaluations every 10 steps and at the
   * end (64). */
  CHECK(r.steps == 64 && v.steps == 64, "steps %lld, callback saw %lld", (long long)r.steps,
        (long long)v.steps);
  CHECK(v.starts == 1 && v.evals == 7, "on_start %lld, on_eval %lld", (long long)v.starts,
        (long long)v.evals);
  ddp_train_result_free(&r);
  /* 1 file-version record + 1 options text + a record per step and per
   * evaluation. */
  fprintf(expected, "{\"run\": \"train\", \"records\": %lld}\n", (long long)(2 + v.steps + v.evals));

  /* The chained callback's stop still stops the run. */
  seen stop = {.run = NULL, .stop_at = 5};
  CHECK_OK(train_toy("stopped", NULL, &stop, &r, NULL, NULL));
  CHECK(r.steps == 5 && r.stopped == DDP_TRAIN_STOP_CALLBACK, "stopped after %lld steps (%s)",
        (long long)r.steps, ddp_train_stop_name(r.stopped));
  ddp_train_result_free(&r);
}

/* A full disk, played by RLIMIT_FSIZE (no log: only the event file is
 * written): training goes on to the end, close reports the error with the
 * file's name. */
static void train_disk_full(void) {
  CHECK(fflush(expected) == 0, "flushing expected.jsonl");
  struct rlimit old, small;
  CHECK(getrlimit(RLIMIT_FSIZE, &old) == 0, "getrlimit");
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  small = old;
  small.rlim_cur = 3000; /* the options and a few steps */
  CHECK(setrlimit(RLIMIT_FSIZE, &small) == 0, "setrlimit");
  seen v = {.run = NULL};
  ddp_train_result r;
  ddp_status closed = DDP_OK;
  ddp_status s = train_toy("full", NULL, &v, &r, NULL, &closed);
  CHECK(setrlimit(RLIMIT_FSIZE, &old) == 0, "setrlimit");
  signal(SIGXFSZ, old_handler);
  CHECK_OK(s);
  CHECK(r.steps == 64 && v.steps == 64, "a failed event write stopped training at %lld",
        (long long)r.steps);
  ddp_train_result_free(&r);
  CHECK(closed == DDP_ERR_IO && strstr(ddp_last_error(), "/full/events.out.tfevents."),
        "close after a failed write: %s: %s", ddp_status_name(closed), ddp_last_error());
}

static seen dp_seen[2];

static void dp_body(dpt_rank *self) {
  dp_seen[self->rank] = (seen){.run = self->rank == 0 ? "dp" : NULL};
  ddp_train_result r;
  DPT_OK(self, train_toy("dp", self->pg, &dp_seen[self->rank], &r, NULL, NULL));
  DPT_CHECK(self, r.steps == 32 && r.world_size == 2, "steps %lld world %d", (long long)r.steps,
            r.world_size);
  ddp_train_result_free(&r);
}

static void train_dp(void) {
  CHECK(dpt_run(2, 30, dp_body, NULL) == 0, "2-rank training with TensorBoard");
  CHECK(dp_seen[0].steps == 32 && dp_seen[1].steps == 32, "steps seen %lld, %lld",
        (long long)dp_seen[0].steps, (long long)dp_seen[1].steps);
  /* 16 steps an epoch (256 samples a rank); evaluations at 10, 20, 30 and
   * the end (32). Only rank 0 wrote. */
  CHECK(dp_seen[0].evals == 4 && dp_seen[1].evals == 4, "evaluations %lld, %lld",
        (long long)dp_seen[0].evals, (long long)dp_seen[1].evals);
  fprintf(expected, "{\"run\": \"dp\", \"records\": %lld}\n",
          (long long)(2 + dp_seen[0].steps + dp_seen[0].evals));
}

/* ---- the reader ----------------------------------------------------------- */

static int run_checker(void) {
  const char *py = getenv("DDP_TORCH_PY");
  if (!py || !*py) py = "/opt/torch-venv/bin/python";
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' -c 'import tensorboard, torch' 2>/dev/null", py);
  if (access(py, X_OK) != 0 || system(cmd) != 0) {
    printf("SKIP: no Python with the tensorboard package and torch at %s (scripts/install-deps.sh "
           "refs builds it; DDP_TORCH_PY to use another); the C checks passed\n", py);
    return 77;
  }
  const char *src = getenv("DDP_SOURCE_DIR");
  snprintf(cmd, sizeof cmd, "'%s' '%s/tests/train/tensorboard_check.py' '%s' %ld", py,
           src ? src : ".", root, (long)getpid());
  int rc = system(cmd);
  if (rc == -1 || !WIFEXITED(rc) || WEXITSTATUS(rc) != 0) {
    fprintf(stderr, "FAIL: tensorboard_check.py (exit %d); files kept in %s\n",
            WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, root);
    return 1;
  }
  return 0;
}

int main(void) {
  snprintf(root, sizeof root, "/tmp/ddp_tensorboard_XXXXXX");
  CHECK(mkdtemp(root), "mkdtemp: %s", strerror(errno));
  char path[128];
  snprintf(path, sizeof path, "%s/expected.jsonl", root);
  expected = fopen(path, "w");
  CHECK(expected, "%s: %s", path, strerror(errno));
  write_synthetic();
  train_single();
  train_disk_full();
  train_dp();
  CHECK(fclose(expected) == 0, "writing %s", path);
  int rc = run_checker();
  if (rc != 1) {
    snprintf(path, sizeof path, "rm -rf '%s'", root);
    if (system(path) != 0) fprintf(stderr, "could not remove %s\n", root);
  }
  if (rc == 0) printf("ok\n");
  return rc;
}
