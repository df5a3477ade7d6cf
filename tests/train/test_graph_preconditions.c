/* The CUDA-graph step's preconditions, on the CPU (every build; issue 26:
 * "the graph-capture preconditions" tested without a GPU):
 * ddp__train_graph_check refuses, with DDP_ERR_UNSUPPORTED saying why,
 * every case where a replayed step could not be correct (the CPU,
 * SyncBatchNorm asked for or already converted, data parallelism, dropout
 * with p > 0, Dropout2d too, however deep), and accepts the seeds' models
 * without dropout and a dropout of p = 0 (draws nothing). The trainer
 * refuses cuda_graph on the CPU before making anything; the graph API
 * refuses the CPU, and pinned memory and asynchronous copies without a
 * GPU say why. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "train/train_internal.h"

/* Not run on a device: the check is pure, so any ordinal will do. */
#define SOME_GPU DDP_CUDA(0)

static ddp_train_options gpu_options(void) {
  ddp_train_options o = ddp_train_defaults();
  o.device = SOME_GPU;
  o.cuda_graph = true;
  return o;
}

static ddp_model *build(const char *name) {
  ddp_model *m = NULL;
  if (ddp_model_build(name, NULL, 1, &m) != DDP_OK) fail_msg("building %s: %s", name, ddp_last_error());
  return m;
}

/* Expects a refusal whose message holds `needle`; prints it. */
static void refused(ddp_status s, const char *needle) {
  printf("  refused: %s\n", ddp_last_error());
  assert_int_equal(s, DDP_ERR_UNSUPPORTED);
  if (!strstr(ddp_last_error(), needle))
    fail_msg("the refusal does not say \"%s\": %s", needle, ddp_last_error());
}

static void test_accepts_the_seeds_models(void **state) {
  (void)state;
  const char *names[] = {"convnet", "headtail", "toy", "convnet-3"};
  ddp_train_options o = gpu_options();
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    ddp_model *m = build(names[i]);
    if (ddp__train_graph_check(&o, m, NULL) != DDP_OK)
      fail_msg("%s refused: %s", names[i], ddp_last_error());
    printf("  %s: can be captured\n", names[i]);
    ddp_model_destroy(m);
  }
}

static void test_refuses_the_cpu(void **state) {
  (void)state;
  ddp_model *m = build("convnet");
  ddp_train_options o = gpu_options();
  o.device = DDP_CPU;
  refused(ddp__train_graph_check(&o, m, NULL), "the device is cpu");
  ddp_model_destroy(m);
}

static ddp_status never_called(void *user, double *buf, size_t count) {
  (void)user, (void)buf, (void)count;
  return DDP_ERR_INTERNAL;
}

static void test_refuses_sync_bn(void **state) {
  (void)state;
  ddp_model *m = build("convnet");
  ddp_train_options o = gpu_options();
  o.sync_bn = true;
  refused(ddp__train_graph_check(&o, m, NULL), "SyncBatchNorm");
  /* A model already converted, whatever the option says. */
  o.sync_bn = false;
  ddp_batch_norm_sync sync = {never_called, NULL};
  ddp_model_set_batch_norm_sync(m, &sync);
  refused(ddp__train_graph_check(&o, m, NULL), "SyncBatchNorm");
  ddp_model_set_batch_norm_sync(m, NULL);
  assert_int_equal(ddp__train_graph_check(&o, m, NULL), DDP_OK);
  ddp_model_destroy(m);
}

static void test_refuses_data_parallel(void **state) {
  (void)state;
  ddp_model *m = build("convnet");
  ddp_train_options o = gpu_options();
  o.strategy = DDP_TRAIN_DATA_PARALLEL;
  refused(ddp__train_graph_check(&o, m, NULL), "data parallelism");
  /* AUTO with a group is data parallel: any non-NULL group says so. */
  o.strategy = DDP_TRAIN_AUTO;
  refused(ddp__train_graph_check(&o, m, (const ddp_process_group *)&o), "data parallelism");
  ddp_model_destroy(m);
}

static void test_refuses_dropout(void **state) {
  (void)state;
  ddp_train_options o = gpu_options();
  /* psnet: Dropout2d(0.25) and Dropout(0.5), as the tutorial's Net. */
  ddp_model *psnet = build("psnet");
  refused(ddp__train_graph_check(&o, psnet, NULL), "Dropout");
  ddp_model_destroy(psnet);

  /* Nested, after a Dropout of p = 0 (which draws nothing, and is fine). */
  ddp_model *m;
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  ddp_module *block;
  assert_int_equal(ddp_module_add_linear(m, NULL, "fc1", 8, 8, true, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_dropout(m, NULL, "idle", 0.0f, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_sequential(m, NULL, "block", &block), DDP_OK);
  assert_int_equal(ddp_module_add_relu(m, block, NULL, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_dropout2d(m, block, "drop", 0.125f, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_linear(m, NULL, "fc2", 8, 2, true, NULL), DDP_OK);
  ddp_model_set_loss(m, DDP_LOSS_CROSS_ENTROPY);
  assert_int_equal(ddp_model_finalize(m, 1), DDP_OK);
  refused(ddp__train_graph_check(&o, m, NULL), "(drop): Dropout2d(p=0.125)");
  ddp_model_destroy(m);

  /* The same with the inner dropout at p = 0 too: accepted. */
  assert_int_equal(ddp_model_create(&m), DDP_OK);
  assert_int_equal(ddp_module_add_linear(m, NULL, "fc1", 8, 8, true, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_dropout(m, NULL, "idle", 0.0f, NULL), DDP_OK);
  assert_int_equal(ddp_module_add_sequential(m, NULL, "block", &block), DDP_OK);
  assert_int_equal(ddp_module_add_dropout2d(m, block, "drop", 0.0f, NULL), DDP_OK);
  assert_int_equal(ddp_model_finalize(m, 1), DDP_OK);
  if (ddp__train_graph_check(&o, m, NULL) != DDP_OK)
    fail_msg("dropout of p = 0 refused: %s", ddp_last_error());
  ddp_model_destroy(m);
}

/* The trainer checks before it makes anything (ASan: nothing leaks). */
static void test_trainer_refuses_on_the_cpu(void **state) {
  (void)state;
  ddp_model *m = build("headtail");
  ddp_dataset *train, *test;
  assert_int_equal(ddp_dataset_create_toydata(&train, 256), DDP_OK);
  assert_int_equal(ddp_dataset_create_toydata(&test, 64), DDP_OK);
  ddp_train_options o = ddp_train_defaults();
  o.cuda_graph = true; /* device: the CPU */
  ddp_trainer *t = (ddp_trainer *)&o;
  refused(ddp_trainer_create(&t, m, train, test, NULL, &o), "CUDA graphs replay GPU work");
  assert_null(t);
  o.cuda_graph = false;
  assert_int_equal(ddp_trainer_create(&t, m, train, test, NULL, &o), DDP_OK);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(m);
}

/* The option took a word of the reserved space: the struct kept its size. */
static void test_options_layout(void **state) {
  (void)state;
  /* cuda_graph, then bucket_cap_mb and trace_path (issue 27), took the
   * first slots of what was reserved[6] right after it: the struct ends
   * where it did. */
  assert_int_equal(offsetof(ddp_train_options, bucket_cap_mb) -
                       offsetof(ddp_train_options, cuda_graph),
                   sizeof(uint64_t));
  assert_int_equal(offsetof(ddp_train_options, trace_path) -
                       offsetof(ddp_train_options, bucket_cap_mb),
                   sizeof(uint64_t));
  /* microbatches with microbatch_sum in one word, then pipeline (issue
   * 23), took two more. */
  assert_int_equal(offsetof(ddp_train_options, microbatches) -
                       offsetof(ddp_train_options, trace_path),
                   sizeof(uint64_t));
  assert_int_equal(offsetof(ddp_train_options, pipeline) -
                       offsetof(ddp_train_options, microbatches),
                   sizeof(uint64_t));
  /* param_server (issue 25) took one more. */
  assert_int_equal(offsetof(ddp_train_options, param_server) -
                       offsetof(ddp_train_options, pipeline),
                   sizeof(uint64_t));
  /* The last word: replicas (issue 43, DataParallel), zero_stage and
   * sharded_checkpoint (issue 41, ZeRO), one spare byte. */
  assert_int_equal(offsetof(ddp_train_options, replicas) - offsetof(ddp_train_options, cuda_graph),
                   6 * sizeof(uint64_t));
  assert_int_equal(offsetof(ddp_train_options, zero_stage) - offsetof(ddp_train_options, replicas),
                   sizeof(int32_t));
  assert_int_equal(offsetof(ddp_train_options, sharded_checkpoint) - offsetof(ddp_train_options, zero_stage),
                   sizeof(int16_t));
  /* Then the struct grew by 72 bytes at once (issues 41 and 42, so that
   * their options did not fight over the last byte): precision and the
   * comm hook's three words, clip_grad_norm, the scaler's two, and five
   * spare words. */
  assert_int_equal(offsetof(ddp_train_options, precision),
                   offsetof(ddp_train_options, cuda_graph) + 7 * sizeof(uint64_t));
  assert_int_equal(offsetof(ddp_train_options, clip_grad_norm) -
                       offsetof(ddp_train_options, precision),
                   4 * sizeof(int32_t));
  assert_int_equal(sizeof(ddp_train_options),
                   offsetof(ddp_train_options, precision) + 72);
  assert_false(ddp_train_defaults().cuda_graph);
}

/* The device API without a GPU (or on the CPU) refuses and says why. */
static void test_device_api_refusals(void **state) {
  (void)state;
  refused(ddp_cuda_graph_begin(DDP_CPU), "is not a GPU");
  ddp_cuda_graph *g = (ddp_cuda_graph *)&g;
  refused(ddp_cuda_graph_end(DDP_CPU, &g), "is not a GPU");
  assert_null(g);
  ddp_cuda_graph_destroy(NULL);
  void *p = &p;
  refused(ddp_pinned_alloc(DDP_CPU, 16, &p), "is not a GPU");
  assert_null(p);
  ddp_pinned_free(NULL);
  float a = 1, b = 2;
  refused(ddp_device_copy_async(DDP_CPU, &a, DDP_CPU, &b, sizeof a), "no GPU in it");
  if (ddp_cuda_device_count() == 0) {
    /* No GPU (this machine): the reason, as for any device operation. */
    assert_int_equal(ddp_cuda_graph_begin(SOME_GPU), DDP_ERR_UNSUPPORTED);
    printf("  without a GPU: %s\n", ddp_last_error());
    assert_int_equal(ddp_pinned_alloc(SOME_GPU, 16, &p), DDP_ERR_UNSUPPORTED);
  }
  /* A stage on the CPU is a copy. */
  ddp_device_stage *stage;
  assert_int_equal(ddp_device_stage_create(DDP_CPU, &stage), DDP_OK);
  int64_t src[3] = {1, -2, 3}, dst[3] = {0};
  void *dsts[1] = {dst};
  const void *srcs[1] = {src};
  size_t bytes[1] = {sizeof src};
  assert_int_equal(ddp_device_stage_upload(stage, 1, dsts, srcs, bytes), DDP_OK);
  assert_memory_equal(dst, src, sizeof src);
  ddp_device_stage_destroy(stage);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_accepts_the_seeds_models),
      cmocka_unit_test(test_refuses_the_cpu),
      cmocka_unit_test(test_refuses_sync_bn),
      cmocka_unit_test(test_refuses_data_parallel),
      cmocka_unit_test(test_refuses_dropout),
      cmocka_unit_test(test_trainer_refuses_on_the_cpu),
      cmocka_unit_test(test_options_layout),
      cmocka_unit_test(test_device_api_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
