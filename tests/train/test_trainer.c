/* The trainer (include/ddp/train.h) from C, ranks as threads of this
 * process:
 *  - a step callback that asks to stop after N steps stops the run there,
 *    with the parameters of a run limited to N steps, and says so in the
 *    result; in a group of 2 where only rank 0 asks, both ranks stop at N
 *    with identical parameters; an evaluation callback stops likewise;
 *  - two trainers on two subgroups (2 + 2) of a 4-rank world train two
 *    different models at the same time, each data-parallel on its own
 *    subgroup, each ending bit for bit where it ends trained alone on a
 *    world of 2;
 *  - bad options are refused naming the option.
 * Every multi-rank case has a timeout on its collectives (dpt_run). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cblas.h>

#include "parallel/dp_test_util.h"

/* One of the two small models with its synthetic data: seed 001's toy
 * regression and seed 000's head/tail classifier. */
typedef struct job {
  const char *model;
  uint64_t seed;
  double lr; /* 0: 0.05 */
  int64_t epochs, max_steps, eval_every;
  int stop_at_step;  /* > 0: on_step asks to stop there (on stop_rank only) */
  int stop_rank;     /* -1: every rank asks */
  bool stop_on_eval; /* on_eval asks at the first evaluation */
} job;

typedef struct ranked_job {
  const job *j;
  int rank;
} ranked_job;

static bool stop_step(const ddp_train_step_info *info, void *user) {
  const ranked_job *rj = user;
  return rj->j->stop_at_step > 0 && info->step == rj->j->stop_at_step &&
         (rj->j->stop_rank < 0 || rj->j->stop_rank == rj->rank);
}

static bool stop_eval(const ddp_train_eval_info *info, void *user) {
  const ranked_job *rj = user;
  (void)info;
  return rj->j->stop_on_eval;
}

static ddp_status open_data(const job *j, ddp_dataset **train, ddp_dataset **test) {
  if (!strcmp(j->model, "toy")) {
    DDP_TRY(ddp_dataset_create_regression(train, 512, j->seed));
    return ddp_dataset_create_regression(test, 128, j->seed + 1000003);
  }
  DDP_TRY(ddp_dataset_create_toydata(train, 2048));
  return ddp_dataset_create_toydata(test, 512);
}

/* Trains `j` on `pg` (NULL: alone) as `rank`; copies the final parameters
 * into params (n floats) and the result into *res. */
static ddp_status train_job(const job *j, ddp_process_group *pg, int rank, float *params,
                            int64_t n, ddp_train_result *res) {
  ddp_model *model = NULL;
  ddp_dataset *train = NULL, *test = NULL;
  ddp_trainer *t = NULL;
  ddp_status s = ddp_model_build(j->model, NULL, j->seed, &model);
  if (s == DDP_OK) s = open_data(j, &train, &test);
  ranked_job rj = {j, rank};
  if (s == DDP_OK) {
    ddp_train_options o = ddp_train_defaults();
    o.epochs = j->epochs;
    o.max_steps = j->max_steps;
    o.batch_size = 16;
    o.optim.lr = j->lr > 0 ? j->lr : 0.05;
    o.optim.sgd.momentum = 0.9;
    o.seed = j->seed;
    o.workers = 0;
    o.eval_every = j->eval_every;
    o.callbacks = (ddp_train_callbacks){NULL, stop_step, stop_eval, &rj};
    s = ddp_trainer_create(&t, model, train, test, pg, &o);
  }
  if (s == DDP_OK) s = ddp_trainer_run(t, res);
  if (s == DDP_OK && n != ddp_model_num_param_elements(model))
    s = ddp_error(DDP_ERR_SHAPE, "%s has %lld parameters, expected %lld", j->model,
                  (long long)ddp_model_num_param_elements(model), (long long)n);
  if (s == DDP_OK) memcpy(params, ddp_model_params_flat(model), (size_t)n * sizeof(float));
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(model);
  return s;
}

static int64_t param_count(const char *name) {
  ddp_model *m;
  assert_int_equal(ddp_model_build(name, NULL, 1, &m), DDP_OK);
  int64_t n = ddp_model_num_param_elements(m);
  ddp_model_destroy(m);
  return n;
}

/* ---- stopping ------------------------------------------------------------ */

static void test_step_callback_stops_alone(void **state) {
  (void)state;
  int64_t n = param_count("toy");
  float *stopped = malloc((size_t)n * sizeof(float)), *limited = malloc((size_t)n * sizeof(float));
  job a = {.model = "toy", .seed = 3, .epochs = 5, .stop_at_step = 7, .stop_rank = -1};
  job b = {.model = "toy", .seed = 3, .epochs = 5, .max_steps = 7};
  ddp_train_result ra, rb;
  if (train_job(&a, NULL, 0, stopped, n, &ra) != DDP_OK) fail_msg("%s", ddp_last_error());
  if (train_job(&b, NULL, 0, limited, n, &rb) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(ra.steps, 7);
  assert_int_equal(ra.stopped, DDP_TRAIN_STOP_CALLBACK);
  assert_string_equal(ddp_train_stop_name(ra.stopped), "callback");
  assert_int_equal(rb.steps, 7);
  assert_int_equal(rb.stopped, DDP_TRAIN_STOP_MAX_STEPS);
  assert_memory_equal(stopped, limited, (size_t)n * sizeof(float));
  /* Both evaluated where they stopped: the same model, the same figures. */
  assert_true(ra.test_loss == rb.test_loss);
  ddp_train_result_free(&ra);
  ddp_train_result_free(&rb);
  free(stopped);
  free(limited);
}

typedef struct group_case {
  job j;
  int64_t n;
  float *params[DPT_MAX_RANKS];
  ddp_train_result res[DPT_MAX_RANKS];
} group_case;

static void group_body(dpt_rank *self) {
  group_case *c = self->world->user;
  DPT_OK(self, train_job(&c->j, self->pg, self->rank, c->params[self->rank], c->n,
                         &c->res[self->rank]));
}

/* Only rank 0's callback asks: both ranks stop after that step. */
static void run_group_stop(const job *j, int64_t want_steps) {
  group_case c = {.j = *j, .n = param_count(j->model)};
  for (int r = 0; r < 2; r++) c.params[r] = calloc((size_t)c.n, sizeof(float));
  assert_int_equal(dpt_run(2, 30, group_body, &c), 0);
  for (int r = 0; r < 2; r++) {
    assert_int_equal(c.res[r].steps, want_steps);
    assert_int_equal(c.res[r].stopped, DDP_TRAIN_STOP_CALLBACK);
    assert_int_equal(c.res[r].world_size, 2);
  }
  assert_memory_equal(c.params[0], c.params[1], (size_t)c.n * sizeof(float));
  for (int r = 0; r < 2; r++) {
    ddp_train_result_free(&c.res[r]);
    free(c.params[r]);
  }
}

static void test_step_callback_on_one_rank_stops_the_group(void **state) {
  (void)state;
  job j = {.model = "toy", .seed = 4, .epochs = 5, .stop_at_step = 5, .stop_rank = 0};
  run_group_stop(&j, 5);
}

static void test_eval_callback_stops_the_group(void **state) {
  (void)state;
  job j = {.model = "toy", .seed = 4, .epochs = 5, .eval_every = 4, .stop_on_eval = true};
  run_group_stop(&j, 4);
}

/* ---- two trainers on two subgroups --------------------------------------- */

typedef struct split_case {
  job jobs[2]; /* subgroup g trains jobs[g] */
  int64_t n[2];
  float *params[4];
  ddp_train_result res[4];
} split_case;

static void split_body(dpt_rank *self) {
  split_case *c = self->world->user;
  const int g = self->rank / 2;
  ddp_process_group *sub = NULL;
  DPT_OK(self, ddp_process_group_split(self->pg, g, self->rank, &sub));
  ddp_status s = train_job(&c->jobs[g], sub, ddp_process_group_rank(sub), c->params[self->rank],
                           c->n[g], &c->res[self->rank]);
  ddp_process_group_destroy(sub);
  DPT_OK(self, s);
}

static void alone_body(dpt_rank *self) {
  group_case *c = self->world->user;
  DPT_OK(self, train_job(&c->j, self->pg, self->rank, c->params[self->rank], c->n,
                         &c->res[self->rank]));
}

static void test_two_trainers_on_two_subgroups(void **state) {
  (void)state;
  split_case c = {.jobs = {{.model = "toy", .seed = 3, .epochs = 2},
                           {.model = "headtail", .seed = 5, .epochs = 1, .lr = 1e-5}}};
  for (int g = 0; g < 2; g++) c.n[g] = param_count(c.jobs[g].model);
  for (int r = 0; r < 4; r++) c.params[r] = calloc((size_t)c.n[r / 2], sizeof(float));
  assert_int_equal(dpt_run(4, 60, split_body, &c), 0);
  for (int g = 0; g < 2; g++) {
    /* The same job alone on a world of 2. */
    group_case alone = {.j = c.jobs[g], .n = c.n[g]};
    for (int r = 0; r < 2; r++) alone.params[r] = calloc((size_t)alone.n, sizeof(float));
    assert_int_equal(dpt_run(2, 60, alone_body, &alone), 0);
    for (int r = 0; r < 2; r++) {
      const ddp_train_result *in_split = &c.res[2 * g + r], *by_itself = &alone.res[r];
      assert_int_equal(in_split->world_size, 2);
      assert_int_equal(in_split->steps, by_itself->steps);
      assert_true(in_split->steps > 0);
      if (memcmp(c.params[2 * g + r], alone.params[r], (size_t)c.n[g] * sizeof(float)) != 0)
        fail_msg("%s: rank %d of subgroup %d ends elsewhere than trained alone", c.jobs[g].model,
                 r, g);
      assert_true(in_split->test_loss == by_itself->test_loss);
      ddp_train_result_free(&alone.res[r]);
      free(alone.params[r]);
    }
  }
  /* The two subgroups trained different models: nothing shared by accident. */
  assert_true(c.n[0] != c.n[1]);
  for (int r = 0; r < 4; r++) {
    ddp_train_result_free(&c.res[r]);
    free(c.params[r]);
  }
}

/* ---- bad options ----------------------------------------------------------- */

static void test_bad_options_are_named(void **state) {
  (void)state;
  ddp_model *model;
  ddp_dataset *train, *test;
  assert_int_equal(ddp_model_build("toy", NULL, 1, &model), DDP_OK);
  job j = {.model = "toy", .seed = 1};
  assert_int_equal(open_data(&j, &train, &test), DDP_OK);
  ddp_trainer *t = (ddp_trainer *)&t;
  ddp_train_options o = ddp_train_defaults();
  o.save_every = 10;
  assert_int_equal(ddp_trainer_create(&t, model, train, test, NULL, &o), DDP_ERR_INVALID);
  assert_null(t);
  assert_non_null(strstr(ddp_last_error(), "save_every 10 needs save_path"));
  o = ddp_train_defaults();
  o.strategy = DDP_TRAIN_DATA_PARALLEL;
  assert_int_equal(ddp_trainer_create(&t, model, train, test, NULL, &o), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "needs a process group"));
  /* The strategy named, and the options that choose one under AUTO: a
   * contradiction names both; no pointer is followed before. */
  ddp_train_pipeline pipeline = {.stages = 2};
  ddp_ps_client *not_a_client = (ddp_ps_client *)&pipeline;
  const struct {
    ddp_train_strategy strategy;
    const ddp_train_pipeline *pipeline;
    ddp_ps_client *param_server;
    const char *message;
  } contradictions[] = {
      {DDP_TRAIN_PIPELINE, NULL, NULL, "strategy pipeline needs options.pipeline"},
      {DDP_TRAIN_PARAM_SERVER, NULL, NULL, "strategy param_server needs options.param_server"},
      {DDP_TRAIN_SINGLE, &pipeline, NULL, "strategy single contradicts options.pipeline"},
      {DDP_TRAIN_DATA_PARALLEL, &pipeline, NULL,
       "strategy data_parallel contradicts options.pipeline"},
      {DDP_TRAIN_PARAM_SERVER, &pipeline, NULL,
       "strategy param_server contradicts options.pipeline"},
      {DDP_TRAIN_SINGLE, NULL, not_a_client, "strategy single contradicts options.param_server"},
      {DDP_TRAIN_PIPELINE, NULL, not_a_client,
       "strategy pipeline contradicts options.param_server"},
      {DDP_TRAIN_AUTO, &pipeline, not_a_client, "options.pipeline and options.param_server"},
      {(ddp_train_strategy)99, NULL, NULL, "unknown strategy 99"},
  };
  for (size_t i = 0; i < sizeof contradictions / sizeof contradictions[0]; i++) {
    o = ddp_train_defaults();
    o.strategy = contradictions[i].strategy;
    o.pipeline = contradictions[i].pipeline;
    o.param_server = contradictions[i].param_server;
    t = (ddp_trainer *)&t;
    assert_int_equal(ddp_trainer_create(&t, model, train, test, NULL, &o), DDP_ERR_INVALID);
    assert_null(t);
    if (!strstr(ddp_last_error(), contradictions[i].message))
      fail_msg("case %zu: \"%s\" lacks \"%s\"", i, ddp_last_error(), contradictions[i].message);
  }
  o = ddp_train_defaults();
  o.batch_size = 0;
  assert_int_equal(ddp_trainer_create(&t, model, train, test, NULL, &o), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "batch_size is 0"));
  /* A classifier on regression data: the shapes are checked up front. */
  ddp_model *convnet;
  assert_int_equal(ddp_model_build("headtail", NULL, 1, &convnet), DDP_OK);
  o = ddp_train_defaults();
  assert_int_equal(ddp_trainer_create(&t, convnet, train, test, NULL, &o), DDP_ERR_SHAPE);
  ddp_model_destroy(convnet);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(model);
}

int main(void) {
  openblas_set_num_threads(1); /* the ranks' threads share this process's BLAS */
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_step_callback_stops_alone),
      cmocka_unit_test(test_step_callback_on_one_rank_stops_the_group),
      cmocka_unit_test(test_eval_callback_stops_the_group),
      cmocka_unit_test(test_two_trainers_on_two_subgroups),
      cmocka_unit_test(test_bad_options_are_named),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
