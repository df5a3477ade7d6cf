/* io: model state dicts and checkpoints. The saved file holds exactly the
 * model's state_dict (names, dtypes, shapes; num_batches_tracked an int64
 * scalar) and loads back bit for bit, also with DDP's "module." prefix;
 * strict-load errors name what is missing, unexpected or mis-shaped; every
 * truncation and every header byte flip of a checkpoint is refused or
 * harmless, and a refused load leaves the model as it was; the training
 * state restores optimizer, scheduler, RNG and position; a mismatched
 * resume, a pair from two saves and a save that fails midway are handled. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "io/io_internal.h"
#include "io/io_test_util.h"

static ddp_model *build(const char *name, uint64_t seed) {
  ddp_model *m;
  if (ddp_model_build(name, NULL, seed, &m) != DDP_OK) fail_msg("%s", ddp_last_error());
  return m;
}

/* The convnet's state dict, as PyTorch's ConvNet().state_dict() lists it. */
static void test_convnet_state_dict(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/convnet.safetensors", dir);
  ddp_model *m = build("convnet", 1);
  ddp_model_counters(m)[0] = 7; /* layer1.1.num_batches_tracked */
  ddp_kv meta = {"ddp.note", "test"};
  assert_int_equal(ddp_model_save(m, path, &meta, 1), DDP_OK);
  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(path, &st), DDP_OK);
  static const struct {
    const char *name;
    ddp_dtype dtype;
    int ndim;
    int64_t shape[4];
  } want[] = {
      {"layer1.0.weight", DDP_FLOAT32, 4, {16, 1, 5, 5}},
      {"layer1.0.bias", DDP_FLOAT32, 1, {16}},
      {"layer1.1.weight", DDP_FLOAT32, 1, {16}},
      {"layer1.1.bias", DDP_FLOAT32, 1, {16}},
      {"layer1.1.running_mean", DDP_FLOAT32, 1, {16}},
      {"layer1.1.running_var", DDP_FLOAT32, 1, {16}},
      {"layer1.1.num_batches_tracked", DDP_INT64, 0, {0}},
      {"layer2.0.weight", DDP_FLOAT32, 4, {32, 16, 5, 5}},
      {"layer2.0.bias", DDP_FLOAT32, 1, {32}},
      {"layer2.1.weight", DDP_FLOAT32, 1, {32}},
      {"layer2.1.bias", DDP_FLOAT32, 1, {32}},
      {"layer2.1.running_mean", DDP_FLOAT32, 1, {32}},
      {"layer2.1.running_var", DDP_FLOAT32, 1, {32}},
      {"layer2.1.num_batches_tracked", DDP_INT64, 0, {0}},
      {"fc.weight", DDP_FLOAT32, 2, {10, 1568}},
      {"fc.bias", DDP_FLOAT32, 1, {10}},
  };
  assert_int_equal(ddp_safetensors_count(st), 16);
  for (size_t i = 0; i < 16; i++) {
    ddp_safetensors_tensor t;
    assert_int_equal(ddp_safetensors_get(st, i, &t), DDP_OK);
    assert_string_equal(t.name, want[i].name);
    assert_int_equal(t.dtype, want[i].dtype);
    assert_int_equal(t.ndim, want[i].ndim);
    for (int d = 0; d < t.ndim; d++) assert_int_equal(t.shape[d], want[i].shape[d]);
  }
  ddp_safetensors_tensor nbt;
  assert_int_equal(ddp_safetensors_find(st, "layer1.1.num_batches_tracked", &nbt), DDP_OK);
  int64_t v;
  memcpy(&v, nbt.data, 8);
  assert_int_equal(v, 7);
  assert_string_equal(ddp_safetensors_metadata(st, "format"), "pt");
  assert_string_equal(ddp_safetensors_metadata(st, "ddp.model"), "convnet");
  assert_string_equal(ddp_safetensors_metadata(st, "ddp.note"), "test");
  ddp_safetensors_free(st);

  /* Loads back bit for bit into a differently initialised model. */
  ddp_model *other = build("convnet", 2);
  size_t a_size, b_size;
  unsigned char *a = model_bytes(m, &a_size);
  assert_int_equal(ddp_model_load(other, path), DDP_OK);
  unsigned char *b = model_bytes(other, &b_size);
  assert_int_equal(a_size, b_size);
  assert_memory_equal(a, b, a_size);
  free(a);
  free(b);
  ddp_model_destroy(other);
  ddp_model_destroy(m);
}

/* Writes the model's state under other names / with one entry changed. */
static void save_renamed(const ddp_model *m, const char *path, const char *prefix,
                         const char *drop, const char *extra, int reshape_index) {
  int n = ddp_model_state_count(m);
  ddp_safetensors_entry *e = calloc((size_t)n + 1, sizeof *e);
  char (*names)[128] = calloc((size_t)n + 1, sizeof *names);
  int k = 0;
  for (int i = 0; i < n; i++) {
    ddp_state_entry s;
    ddp_model_state_entry(m, i, &s);
    if (drop && !strcmp(s.name, drop)) continue;
    snprintf(names[k], sizeof names[k], "%s%s", prefix, s.name);
    e[k] = (ddp_safetensors_entry){.name = names[k], .dtype = s.dtype, .ndim = s.ndim, .data = s.data};
    memcpy(e[k].shape, s.shape, sizeof e[k].shape);
    if (i == reshape_index) e[k].shape[0] -= 1;
    k++;
  }
  float one = 1;
  if (extra) e[k++] = (ddp_safetensors_entry){.name = extra, .dtype = DDP_FLOAT32, .ndim = 0, .data = &one};
  assert_int_equal(ddp_safetensors_write(path, e, (size_t)k, NULL, 0), DDP_OK);
  free(e);
  free(names);
}

static void expect_refused(ddp_model *m, const char *path, ddp_status status, const char *want) {
  size_t before_size, after_size;
  unsigned char *before = model_bytes(m, &before_size);
  ddp_status s = ddp_model_load(m, path);
  if (s != status) fail_msg("status %d, want %d: %s", s, status, ddp_last_error());
  if (!strstr(ddp_last_error(), want)) fail_msg("got  %s\nwant %s", ddp_last_error(), want);
  unsigned char *after = model_bytes(m, &after_size);
  assert_memory_equal(before, after, before_size); /* unchanged */
  free(before);
  free(after);
}

static void test_strict_load(void **state) {
  (void)state;
  char path[512];
  snprintf(path, sizeof path, "%s/x.safetensors", dir);
  ddp_model *src = build("toy", 1), *dst = build("toy", 2);
  /* DistributedDataParallel's names: module.net1.weight, ... */
  save_renamed(src, path, "module.", NULL, NULL, -1);
  assert_int_equal(ddp_model_load(dst, path), DDP_OK);
  size_t a_size, b_size;
  unsigned char *a = model_bytes(src, &a_size), *b = model_bytes(dst, &b_size);
  assert_memory_equal(a, b, a_size);
  free(a);
  free(b);
  ddp_model_destroy(dst);
  dst = build("toy", 2);
  save_renamed(src, path, "", "net2.bias", "net3.weight", -1);
  expect_refused(dst, path, DDP_ERR_FORMAT,
                 "does not fit model toy (strict load): missing key(s): \"net2.bias\"; "
                 "unexpected key(s): \"net3.weight\"");
  save_renamed(src, path, "", NULL, NULL, 2); /* net2.weight (5, 10) -> (4, 10) */
  expect_refused(dst, path, DDP_ERR_SHAPE,
                 "size mismatch for net2.weight (tensor net2.weight at offset");
  assert_non_null(strstr(ddp_last_error(), "the file has F32 [4, 10], the model F32 [5, 10]"));
  /* A convnet's checkpoint into the toy model. */
  ddp_model *conv = build("convnet", 1);
  assert_int_equal(ddp_model_save(conv, path, NULL, 0), DDP_OK);
  expect_refused(dst, path, DDP_ERR_FORMAT, "missing key(s): \"net1.weight\"");
  assert_non_null(strstr(ddp_last_error(), "and 8 more"));
  ddp_model_destroy(conv);
  ddp_model_destroy(src);
  ddp_model_destroy(dst);
}

/* Every truncation of a checkpoint is refused; every flipped header byte is
 * refused or changes nothing (a flip inside padding spaces that yields other
 * whitespace is still the same file); a refused load changes nothing. */
static void test_corruption(void **state) {
  (void)state;
  char path[512], copy[512];
  snprintf(path, sizeof path, "%s/good.safetensors", dir);
  snprintf(copy, sizeof copy, "%s/copy.safetensors", dir);
  ddp_model *src = build("toy", 1);
  assert_int_equal(ddp_model_save(src, path, NULL, 0), DDP_OK);
  size_t size;
  unsigned char *good = slurp(path, &size);
  uint64_t hl = 0;
  for (int i = 0; i < 8; i++) hl |= (uint64_t)good[i] << (8 * i);
  ddp_model *dst = build("toy", 2);
  size_t ref_size;
  unsigned char *ref = model_bytes(dst, &ref_size);
  for (size_t cut = 0; cut < size; cut++) {
    spit(copy, good, cut);
    ddp_status s = ddp_model_load(dst, copy);
    if (s == DDP_OK) fail_msg("a copy cut to %zu of %zu bytes loaded", cut, size);
    assert_non_null(strstr(ddp_last_error(), copy));
    size_t now_size;
    unsigned char *now = model_bytes(dst, &now_size);
    assert_memory_equal(now, ref, ref_size);
    free(now);
  }
  unsigned char *bad = malloc(size);
  int refused = 0, harmless = 0;
  for (size_t i = 0; i < 8 + hl; i++) {
    for (int bit = 0; bit < 8; bit += 3) {
      memcpy(bad, good, size);
      bad[i] ^= (unsigned char)(1u << bit);
      spit(copy, bad, size);
      ddp_model *fresh = build("toy", 2);
      ddp_status s = ddp_model_load(fresh, copy);
      size_t now_size;
      unsigned char *now = model_bytes(fresh, &now_size);
      if (s != DDP_OK) {
        refused++;
        assert_memory_equal(now, ref, ref_size); /* refused: unchanged */
      } else {
        /* Loaded: must be the original state exactly. */
        size_t src_size;
        unsigned char *orig = model_bytes(src, &src_size);
        if (memcmp(now, orig, src_size) != 0) fail_msg("flipping bit %d of byte %zu loaded other values", bit, i);
        free(orig);
        harmless++;
      }
      free(now);
      ddp_model_destroy(fresh);
    }
  }
  assert_true(refused > 3 * (int)hl / 2); /* nearly every flip is caught */
  free(bad);
  free(good);
  free(ref);
  ddp_model_destroy(src);
  ddp_model_destroy(dst);
}

/* ---- Checkpoints with training state --------------------------------------------- */

typedef struct run {
  ddp_model *model;
  ddp_optimizer *opt;
  ddp_scheduler *sched;
} run;

static run make_run(uint64_t seed) {
  run r;
  r.model = build("toy", seed);
  ddp_optim_options o = ddp_optim_defaults(DDP_OPTIM_SGD);
  o.lr = 0.1;
  o.sgd.momentum = 0.9;
  assert_int_equal(ddp_optimizer_create(&r.opt, &o, ddp_model_params_flat(r.model),
                                        ddp_model_grads_flat(r.model),
                                        (size_t)ddp_model_num_param_elements(r.model)),
                   DDP_OK);
  ddp_step_lr_options so = ddp_step_lr_defaults(2);
  so.gamma = 0.5;
  assert_int_equal(ddp_scheduler_create_step_lr(&r.sched, r.opt, &so), DDP_OK);
  return r;
}

static void free_run(run *r) {
  ddp_scheduler_destroy(r->sched);
  ddp_optimizer_destroy(r->opt);
  ddp_model_destroy(r->model);
}

/* Two optimizer steps with made-up gradients and three scheduler steps. */
static void advance(run *r) {
  float *g = ddp_model_grads_flat(r->model);
  for (int s = 0; s < 2; s++) {
    for (int64_t i = 0; i < ddp_model_num_param_elements(r->model); i++) g[i] = (float)(i % 7) - 3.0f + (float)s;
    assert_int_equal(ddp_optimizer_step(r->opt), DDP_OK);
  }
  for (int s = 0; s < 3; s++) assert_int_equal(ddp_scheduler_step(r->sched), DDP_OK);
  (void)ddp_rng_next(ddp_model_dropout_rng(r->model));
}

static void test_train_state_roundtrip(void **state) {
  (void)state;
  char path[512], train_path[512];
  snprintf(path, sizeof path, "%s/ck.safetensors", dir);
  assert_int_equal(ddp_checkpoint_train_path(path, train_path, sizeof train_path), DDP_OK);
  char want_train[512];
  snprintf(want_train, sizeof want_train, "%s/ck.train.safetensors", dir);
  assert_string_equal(train_path, want_train);
  char other[64];
  assert_int_equal(ddp_checkpoint_train_path("run/ckpt", other, sizeof other), DDP_OK);
  assert_string_equal(other, "run/ckpt.train.safetensors");

  run a = make_run(1);
  advance(&a);
  ddp_train_state ts = {.step = 17, .epoch = 3, .epoch_batches = 5, .sampler_seed = 99,
                        .world_size = 1};
  ddp_kv meta[2] = {{"ddp.batch_size", "16"}, {"ddp.optimizer_options", "lr=0.1"}};
  assert_int_equal(ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, meta, 2), DDP_OK);
  assert_int_equal(dir_entries(dir), 2);

  /* The training state's tensors by PyTorch's optimizer state_dict names. */
  ddp_safetensors *st;
  assert_int_equal(ddp_safetensors_read(train_path, &st), DDP_OK);
  ddp_safetensors_tensor t;
  assert_int_equal(ddp_safetensors_find(st, "optimizer.state.2.momentum_buffer", &t), DDP_OK);
  assert_int_equal(t.ndim, 2); /* net2.weight (5, 10) */
  assert_int_equal(t.shape[0], 5);
  ddp_optim_state os;
  assert_int_equal(ddp_optimizer_state_find(a.opt, "momentum_buffer", &os), DDP_OK);
  assert_memory_equal(t.data, os.data + ddp_model_param_offset(a.model, 2), 50 * sizeof(float));
  assert_string_equal(ddp_safetensors_metadata(st, "ddp.optimizer"), "sgd");
  ddp_safetensors_free(st);

  run b = make_run(2);
  ddp_train_state got = {0}; /* .grad_scaler is read: NULL, no scaler */
  memset(&got, 0, sizeof got);
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, meta, 2), DDP_OK);
  assert_int_equal(got.step, 17);
  assert_int_equal(got.epoch, 3);
  assert_int_equal(got.epoch_batches, 5);
  assert_int_equal(got.sampler_seed, 99);
  assert_int_equal(got.world_size, 1);
  size_t as, bs;
  unsigned char *ab = model_bytes(a.model, &as), *bb = model_bytes(b.model, &bs);
  assert_memory_equal(ab, bb, as);
  free(ab);
  free(bb);
  assert_memory_equal(ddp_model_dropout_rng(a.model), ddp_model_dropout_rng(b.model), sizeof(ddp_rng));
  assert_true(ddp_optimizer_get_lr(a.opt) == ddp_optimizer_get_lr(b.opt));
  ddp_scheduler_state sa, sb;
  ddp_scheduler_state_get(a.sched, &sa);
  ddp_scheduler_state_get(b.sched, &sb);
  assert_memory_equal(&sa, &sb, sizeof sa);
  /* The same next steps give the same parameters, bit for bit. */
  advance(&a);
  advance(&b);
  assert_memory_equal(ddp_model_params_flat(a.model), ddp_model_params_flat(b.model),
                      (size_t)ddp_model_num_param_elements(a.model) * sizeof(float));

  /* A resume with other options is refused by name, and changes nothing. */
  run c = make_run(3);
  ddp_kv other_meta[1] = {{"ddp.batch_size", "32"}};
  assert_int_equal(ddp_checkpoint_load(path, c.model, c.opt, c.sched, &got, other_meta, 1),
                   DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "saved with ddp.batch_size = 16; this run has ddp.batch_size = 32"));
  ddp_model *conv = build("convnet", 1);
  assert_int_equal(ddp_checkpoint_load(path, conv, NULL, NULL, &got, NULL, 0), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "was saved from model toy; this run builds convnet"));
  ddp_model_destroy(conv);
  free_run(&a);
  free_run(&b);
  free_run(&c);
}

/* A save that fails midway (injected full disk, at many points of either
 * file) leaves the previous pair byte for byte and no temporary files; the
 * model file of one save with the training state of another is refused. */
static void test_failed_save_keeps_previous(void **state) {
  (void)state;
  char path[512], train_path[512];
  snprintf(path, sizeof path, "%s/ck.safetensors", dir);
  ddp_checkpoint_train_path(path, train_path, sizeof train_path);
  run a = make_run(1);
  ddp_train_state ts = {.step = 1, .world_size = 1};
  assert_int_equal(ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, NULL, 0), DDP_OK);
  size_t m_size, t_size;
  unsigned char *m_old = slurp(path, &m_size), *t_old = slurp(train_path, &t_size);
  advance(&a);
  ts.step = 2;
  for (int64_t cut = 0; cut < (int64_t)(m_size + t_size); cut += 97) {
    ddp__io_fail_after_bytes = cut;
    ddp_status s = ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, NULL, 0);
    ddp__io_fail_after_bytes = -1;
    assert_int_equal(s, DDP_ERR_IO);
    assert_non_null(strstr(ddp_last_error(), "saving checkpoint"));
    size_t ms, tsz;
    unsigned char *m_now = slurp(path, &ms), *t_now = slurp(train_path, &tsz);
    assert_int_equal(ms, m_size);
    assert_int_equal(tsz, t_size);
    assert_memory_equal(m_now, m_old, m_size);
    assert_memory_equal(t_now, t_old, t_size);
    free(m_now);
    free(t_now);
    assert_int_equal(dir_entries(dir), 2);
  }
  /* The old pair still loads. */
  run b = make_run(2);
  ddp_train_state got = {0}; /* .grad_scaler is read: NULL, no scaler */
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, NULL, 0), DDP_OK);
  assert_int_equal(got.step, 1);
  /* A new save, then the old training state put back beside it: refused. */
  assert_int_equal(ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, NULL, 0), DDP_OK);
  spit(train_path, t_old, t_size);
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, NULL, 0), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), "come from different saves"));
  assert_int_equal(got.step, 1); /* untouched */
  /* A save killed between its two renames: the new training state beside the
   * old model, the new model still in its temporary file. The load rolls
   * forward from that file (the training state names it). */
  size_t m2_size;
  unsigned char *m2 = slurp(path, &m2_size);
  char pending[600];
  snprintf(pending, sizeof pending, "%s.tmp.%ld", path, (long)getpid());
  assert_int_equal(ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, NULL, 0), DDP_OK);
  unsigned char *m3 = slurp(path, &m2_size);
  spit(pending, m3, m2_size);
  spit(path, m2, m2_size); /* an older model file (same size: same model) */
  run c = make_run(5);
  assert_int_equal(ddp_checkpoint_load(path, c.model, c.opt, c.sched, &got, NULL, 0), DDP_OK);
  assert_memory_equal(ddp_model_params_flat(c.model), ddp_model_params_flat(a.model),
                      (size_t)ddp_model_num_param_elements(a.model) * sizeof(float));
  unlink(path); /* and with no model file at all (the very first save cut short) */
  free_run(&c);
  c = make_run(6);
  assert_int_equal(ddp_checkpoint_load(path, c.model, c.opt, c.sched, &got, NULL, 0), DDP_OK);
  assert_memory_equal(ddp_model_params_flat(c.model), ddp_model_params_flat(a.model),
                      (size_t)ddp_model_num_param_elements(a.model) * sizeof(float));
  free_run(&c);
  unlink(pending);
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, NULL, 0), DDP_ERR_NOTFOUND);
  spit(path, m3, m2_size);
  free(m2);
  free(m3);
  /* A truncated training state is refused naming it. */
  spit(train_path, t_old, t_size / 2);
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, NULL, 0), DDP_ERR_FORMAT);
  assert_non_null(strstr(ddp_last_error(), train_path));
  free(m_old);
  free(t_old);
  free_run(&a);
  free_run(&b);
}

/* A save whose second rename (the model's) fails after the first (the
 * training state's) succeeded: the new training state already replaced the
 * old one, so the only consistent checkpoint left is the new one, whose
 * model is still in its temporary file. That file must survive the failed
 * save, and a load rolls forward from it. (Here the rename fails because a
 * directory stands at the model's path.) */
static void test_failed_model_rename_rolls_forward(void **state) {
  (void)state;
  char path[512], train_path[512];
  snprintf(path, sizeof path, "%s/ck.safetensors", dir);
  ddp_checkpoint_train_path(path, train_path, sizeof train_path);
  run a = make_run(1);
  advance(&a);
  ddp_train_state ts = {.step = 7, .world_size = 1};
  assert_int_equal(mkdir(path, 0755), 0);
  char inside[600];
  snprintf(inside, sizeof inside, "%s/keep", path); /* non-empty: rename cannot replace it */
  spit(inside, "x", 1);
  assert_int_not_equal(ddp_checkpoint_save(path, a.model, a.opt, a.sched, &ts, NULL, 0), DDP_OK);
  assert_non_null(strstr(ddp_last_error(), "saving checkpoint"));
  assert_non_null(strstr(ddp_last_error(), "rolls forward"));
  unlink(inside);
  assert_int_equal(rmdir(path), 0);
  run b = make_run(2);
  ddp_train_state got = {0}; /* .grad_scaler is read: NULL, no scaler */
  assert_int_equal(ddp_checkpoint_load(path, b.model, b.opt, b.sched, &got, NULL, 0), DDP_OK);
  assert_int_equal(got.step, 7);
  assert_memory_equal(ddp_model_params_flat(b.model), ddp_model_params_flat(a.model),
                      (size_t)ddp_model_num_param_elements(a.model) * sizeof(float));
  free_run(&a);
  free_run(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_convnet_state_dict, setup, teardown),
      cmocka_unit_test_setup_teardown(test_strict_load, setup, teardown),
      cmocka_unit_test_setup_teardown(test_corruption, setup, teardown),
      cmocka_unit_test_setup_teardown(test_train_state_roundtrip, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_save_keeps_previous, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failed_model_rename_rolls_forward, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
