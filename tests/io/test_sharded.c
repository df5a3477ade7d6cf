/* Sharded checkpoints through the io API (ddp_sharded_*), one process
 * playing every rank: written by 3 "ranks" (from whole optimizers and from
 * optimizers narrowed to each range, as ZeRO's), loaded into a fresh model
 * and optimizer: parameters, buffers, optimizer state, lr, step and
 * position equal to what was saved, bit for bit; consolidated into the
 * same state dict ddp_model_save writes. Refused, with the model and
 * optimizer left as they were: a missing shard (naming its file), a model of
 * another architecture, shards whose pieces disagree with the metadata's
 * layout (naming the file and tensor). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include <cmocka.h>

#include "io_test_util.h"

enum { WORLD = 3 };

/* A ConvNet (parameters and BatchNorm buffers) with an Adam optimizer over
 * it that has state (one step on made-up gradients). */
typedef struct run {
  ddp_model *m;
  ddp_optimizer *opt;
} run;

static run make_run(uint64_t seed, bool with_state) {
  run r;
  assert_int_equal(ddp_model_build("convnet", NULL, seed, &r.m), DDP_OK);
  int64_t n = ddp_model_num_param_elements(r.m);
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.lr = 0.003 * (double)seed;
  assert_int_equal(ddp_optimizer_create(&r.opt, &o, ddp_model_params_flat(r.m),
                                        ddp_model_grads_flat(r.m), (size_t)n), DDP_OK);
  if (with_state) {
    float *g = ddp_model_grads_flat(r.m);
    for (int64_t i = 0; i < n; i++) g[i] = 0.01f * (float)((i * 37 + (int64_t)seed) % 11) - 0.05f;
    assert_int_equal(ddp_optimizer_step(r.opt), DDP_OK);
    assert_int_equal(ddp_optimizer_step(r.opt), DDP_OK);
    float *rm = ddp_model_buffers_flat(r.m); /* running statistics a run would have */
    for (int64_t i = 0; i < ddp_model_num_buffer_elements(r.m); i++) rm[i] += 0.5f * (float)(i % 3);
  }
  return r;
}

static void free_run(run *r) {
  ddp_optimizer_destroy(r->opt);
  ddp_model_destroy(r->m);
}

static void starts_of(const ddp_model *m, int64_t starts[WORLD + 1]) {
  int64_t n = ddp_model_num_param_elements(m);
  for (int r = 0; r <= WORLD; r++) starts[r] = n * r / WORLD;
}

static const ddp_train_state saved_ts = {.step = 17, .epoch = 2, .sampler_seed = 5, .world_size = WORLD,
                                         .best_test_loss = 0.25, .evals_without_better = 1};

/* Every rank's shard from `opts` (one per rank, whole or narrowed), then
 * the metadata. */
static void save(const char *d, const char *id, run *src, ddp_optimizer **opts, const int64_t *starts) {
  for (int r = 0; r < WORLD; r++)
    assert_int_equal(ddp_sharded_save_shard(d, id, r, WORLD, starts, src->m, opts[r]), DDP_OK);
  assert_int_equal(ddp_sharded_save_metadata(d, id, WORLD, starts, src->m, src->opt, NULL, &saved_ts,
                                             NULL, 0), DDP_OK);
}

static void assert_state_equal(ddp_optimizer *a, ddp_optimizer *b) {
  assert_int_equal(ddp_optimizer_state_count(a), ddp_optimizer_state_count(b));
  for (size_t k = 0; k < ddp_optimizer_state_count(a); k++) {
    ddp_optim_state x, y;
    assert_int_equal(ddp_optimizer_state_get(a, k, &x), DDP_OK);
    assert_int_equal(ddp_optimizer_state_get(b, k, &y), DDP_OK);
    assert_int_equal(x.numel, y.numel);
    assert_memory_equal(x.data, y.data, x.numel * sizeof(float));
  }
  assert_true(ddp_optimizer_get_lr(a) == ddp_optimizer_get_lr(b));
}

static void check_round_trip(bool narrowed) {
  run src = make_run(1, true), dst = make_run(2, false);
  int64_t starts[WORLD + 1];
  starts_of(src.m, starts);
  ddp_optimizer *opts[WORLD];
  run parts[WORLD];
  for (int r = 0; r < WORLD; r++) {
    opts[r] = src.opt;
    if (!narrowed) continue;
    /* A copy of src's optimizer narrowed to rank r's range (ZeRO's). */
    parts[r] = make_run(1, true);
    assert_int_equal(ddp_optimizer_narrow(parts[r].opt, (size_t)starts[r], (size_t)(starts[r + 1] - starts[r])), DDP_OK);
    opts[r] = parts[r].opt;
  }
  save(dir, "a1", &src, opts, starts);
  assert_int_equal(dir_entries(dir), WORLD + 1);
  assert_true(ddp_sharded_is_checkpoint(dir));
  ddp_train_state ts = {0}; /* .grad_scaler is read: NULL, no scaler */
  assert_int_equal(ddp_sharded_load(dir, dst.m, dst.opt, NULL, &ts, NULL, 0), DDP_OK);
  size_t a_n, b_n;
  unsigned char *a = model_bytes(src.m, &a_n), *b = model_bytes(dst.m, &b_n);
  assert_int_equal(a_n, b_n);
  assert_memory_equal(a, b, a_n);
  free(a);
  free(b);
  assert_state_equal(src.opt, dst.opt);
  assert_int_equal(ts.step, 17);
  assert_int_equal(ts.epoch, 2);
  assert_int_equal(ts.world_size, WORLD);
  assert_true(ts.best_test_loss == 0.25);

  /* Consolidated: the tensors ddp_model_save writes. */
  char out[512], ref[512];
  snprintf(out, sizeof out, "%s/whole.safetensors", dir);
  snprintf(ref, sizeof ref, "%s/ref.safetensors", dir);
  assert_int_equal(ddp_sharded_consolidate(dir, out), DDP_OK);
  assert_int_equal(ddp_model_save(src.m, ref, NULL, 0), DDP_OK);
  ddp_safetensors *x, *y;
  assert_int_equal(ddp_safetensors_read(out, &x), DDP_OK);
  assert_int_equal(ddp_safetensors_read(ref, &y), DDP_OK);
  assert_int_equal(ddp_safetensors_count(x), ddp_safetensors_count(y));
  for (size_t i = 0; i < ddp_safetensors_count(y); i++) {
    ddp_safetensors_tensor tx, ty;
    ddp_safetensors_get(x, i, &tx);
    ddp_safetensors_get(y, i, &ty);
    assert_string_equal(tx.name, ty.name); /* state_dict order */
    assert_int_equal(tx.ndim, ty.ndim);
    assert_int_equal(tx.bytes, ty.bytes);
    assert_memory_equal(tx.data, ty.data, ty.bytes);
  }
  assert_string_equal(ddp_safetensors_metadata(x, "format"), "pt");
  ddp_safetensors_free(x);
  ddp_safetensors_free(y);
  for (int r = 0; narrowed && r < WORLD; r++) free_run(&parts[r]);
  free_run(&src);
  free_run(&dst);
}

static void test_round_trip_whole_optimizers(void **state) {
  (void)state;
  check_round_trip(false);
}

static void test_round_trip_narrowed_optimizers(void **state) {
  (void)state;
  check_round_trip(true);
}

/* A refused load leaves dst as it was, and says err_part. */
static void expect_refused(run *dst, ddp_status want, const char *err_part) {
  size_t before_n, after_n;
  unsigned char *before = model_bytes(dst->m, &before_n);
  ddp_train_state ts = {0};
  ddp_status s = ddp_sharded_load(dir, dst->m, dst->opt, NULL, &ts, NULL, 0);
  if (s != want || !strstr(ddp_last_error(), err_part))
    fail_msg("load gave %s: %s (wanted %s naming '%s')", ddp_status_name(s), ddp_last_error(),
             ddp_status_name(want), err_part);
  unsigned char *after = model_bytes(dst->m, &after_n);
  assert_int_equal(before_n, after_n);
  assert_memory_equal(before, after, before_n);
  assert_false(ddp_optimizer_has_state(dst->opt));
  free(before);
  free(after);
}

static void test_refusals(void **state) {
  (void)state;
  run src = make_run(1, true), dst = make_run(2, false);
  int64_t starts[WORLD + 1];
  starts_of(src.m, starts);
  ddp_optimizer *opts[WORLD] = {src.opt, src.opt, src.opt};
  save(dir, "b1", &src, opts, starts);

  /* A model of another architecture. */
  ddp_model *other;
  assert_int_equal(ddp_model_build("toy", NULL, 1, &other), DDP_OK);
  ddp_train_state ts = {0}; /* .grad_scaler is read: NULL, no scaler */
  assert_int_equal(ddp_sharded_load(dir, other, NULL, NULL, &ts, NULL, 0), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "saved from model convnet"));
  ddp_model_destroy(other);

  /* Shards cut at other places than the metadata says: rank 1's pieces
   * are longer than the layout's. */
  int64_t moved[WORLD + 1];
  memcpy(moved, starts, sizeof moved);
  moved[2] += 100;
  assert_int_equal(ddp_sharded_save_shard(dir, "b1", 1, WORLD, moved, src.m, src.opt), DDP_OK);
  expect_refused(&dst, DDP_ERR_FORMAT, "shard-00001-of-00003.b1.safetensors");

  /* A shard missing. */
  char path[600];
  snprintf(path, sizeof path, "%s/shard-00002-of-00003.b1.safetensors", dir);
  assert_int_equal(unlink(path), 0);
  expect_refused(&dst, DDP_ERR_NOTFOUND, "shard-00002-of-00003.b1.safetensors");

  /* A save with another id removes the old shards and loads. */
  save(dir, "c2", &src, opts, starts);
  assert_int_equal(dir_entries(dir), WORLD + 1);
  assert_int_equal(ddp_sharded_load(dir, dst.m, dst.opt, NULL, &ts, NULL, 0), DDP_OK);
  assert_state_equal(src.opt, dst.opt);
  free_run(&src);
  free_run(&dst);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_round_trip_whole_optimizers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_round_trip_narrowed_optimizers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
