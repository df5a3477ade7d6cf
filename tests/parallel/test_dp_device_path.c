/* The DDP wrapper's GPU path, on the CPU (issue 39):
 *  - the hooks' device kernels (dp->kernels: division, float16 / bfloat16
 *    compression and back) give the host loops' gradients bit for bit, at a
 *    world of 3 (a divisor whose quotient rounds), for the float32, fp16
 *    and bf16 hooks; the CPU's kernel table plays the GPU's;
 *  - over a group that refuses host buffers (nccl's caps, played by
 *    clearing the CPU from a threads backend's caps, and the model's flat
 *    buffers "on cuda:0" by comm's pointer hook), creation (shape check,
 *    broadcast of parameters, buffers and counters), reduce_grads with each
 *    hook, join and SyncBatchNorm's host statistics all work: every host
 *    buffer goes over the group's host group, every gradient over the
 *    group itself. Before the host group, the shape check's byte
 *    allgather was refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "comm/comm_internal.h"
#include "comm/staged.h"
#include "parallel/dp_internal.h"
#include "parallel/dp_test_util.h"

static const ddp_dp_hook_kind kinds[3] = {DDP_DP_HOOK_ALLREDUCE, DDP_DP_HOOK_FP16,
                                          DDP_DP_HOOK_BF16};

/* Rank r's gradient i: values across magnitudes (some below float16's
 * normal range, some large), different on every rank. */
static float grad_value(int rank, int64_t i) {
  uint32_t h = (uint32_t)(i * 2654435761u) ^ (uint32_t)(rank * 40503u + 17u);
  float m = (float)(h % 100003u) / 100003.0f - 0.5f;
  static const float scale[5] = {1e-7f, 1e-3f, 1.0f, 37.0f, 3000.0f};
  return m * scale[h % 5];
}

static void fill_grads(ddp_model *m, int rank) {
  float *g = ddp_model_grads_flat(m);
  for (int64_t i = 0; i < ddp_model_num_param_elements(m); i++) g[i] = grad_value(rank, i);
}

/* ---- The kernels' path against the host loops ----------------------------- */

static void kernels_body(dpt_rank *self) {
  for (int k = 0; k < 3; k++) {
    ddp_model *m = NULL;
    DPT_OK(self, ddp_model_build("convnet", NULL, 1, &m));
    ddp_dp *dp = NULL;
    DPT_OK(self, ddp_dp_create(&dp, m, self->pg, NULL));
    DPT_OK(self, ddp_dp_set_comm_hook(dp, kinds[k]));
    int64_t n = ddp_model_num_param_elements(m);
    float *host = malloc((size_t)n * sizeof(float));
    fill_grads(m, self->rank);
    DPT_OK(self, ddp_dp_reduce_grads(dp));
    memcpy(host, ddp_model_grads_flat(m), (size_t)n * sizeof(float));
    /* The same reduction through the kernel table a GPU model uses. */
    dp->kernels = &ddp__cpu_basic_kernels;
    fill_grads(m, self->rank);
    DPT_OK(self, ddp_dp_reduce_grads(dp));
    const float *dev = ddp_model_grads_flat(m);
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
      if (memcmp(&host[i], &dev[i], sizeof(float)) != 0) bad = i;
    float hb = bad >= 0 ? host[bad] : 0, db = bad >= 0 ? dev[bad] : 0;
    free(host);
    dp->kernels = NULL;
    ddp_dp_destroy(dp);
    ddp_model_destroy(m);
    DPT_CHECK(self, bad < 0, "hook %d: gradient %lld is %.9g by the kernels, %.9g by the host loops",
              k, (long long)bad, (double)db, (double)hb);
  }
}

static void test_kernels_equal_host_loops(void **state) {
  (void)state;
  assert_int_equal(dpt_run(3, 30, kernels_body, NULL), 0);
}

/* ---- A group that refuses host buffers -------------------------------------- */

/* Each rank's model's flat buffers and the wrapper's compressed copies,
 * "on cuda:0". */
static pthread_mutex_t ranges_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { const char *lo, *hi; } ranges[4 * DPT_MAX_RANKS];
static int n_ranges;

static void add_range(const void *p, size_t bytes) {
  pthread_mutex_lock(&ranges_mu);
  ranges[n_ranges].lo = p;
  ranges[n_ranges].hi = (const char *)p + bytes;
  n_ranges++;
  pthread_mutex_unlock(&ranges_mu);
}

static ddp_device fake_where(const void *p) {
  ddp_device d = DDP_CPU;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < n_ranges; i++)
    if ((const char *)p >= ranges[i].lo && (const char *)p < ranges[i].hi) d = DDP_CUDA(0);
  pthread_mutex_unlock(&ranges_mu);
  return d;
}

static ddp__backend_ops gpu_only_ops[DPT_MAX_RANKS];

static void gpu_group_body(dpt_rank *self) {
  ddp_process_group *pg = self->pg;
  /* nccl's caps: CUDA buffers only. */
  gpu_only_ops[self->rank] = *pg->backend->ops;
  gpu_only_ops[self->rank].caps.devices = 1u << DDP_DEVICE_CUDA;
  pg->backend->ops = &gpu_only_ops[self->rank];
  int64_t probe = 1;
  ddp_status st = ddp_allreduce(pg, &probe, 1, DDP_INT64, DDP_REDUCE_SUM);
  DPT_CHECK(self, st == DDP_ERR_UNSUPPORTED, "a host buffer on the played nccl group: %s",
            ddp_status_name(st));
  DPT_CHECK(self, !ddp_process_group_takes_host(pg), "the played group takes host buffers");

  ddp_model *m = NULL;
  DPT_OK(self, ddp_model_build("convnet", NULL, 1 + (uint64_t)self->rank, &m));
  int64_t n = ddp_model_num_param_elements(m);
  add_range(ddp_model_params_flat(m), (size_t)n * sizeof(float));
  add_range(ddp_model_grads_flat(m), (size_t)n * sizeof(float));
  add_range(ddp_model_buffers_flat(m), (size_t)ddp_model_num_buffer_elements(m) * sizeof(float));
  /* Rank 1's counters differ: the broadcast must bring rank 0's. */
  ddp_model_counters(m)[0] = 5 + self->rank;
  DPT_OK(self, ddp_model_convert_sync_batchnorm(m, pg));
  ddp_dp *dp = NULL;
  DPT_OK(self, ddp_dp_create(&dp, m, pg, NULL));
  /* On a GPU model the compressed copies are device memory too. */
  add_range(dp->scratch, (size_t)n * sizeof(uint16_t));
  ddp_process_group *host = NULL;
  DPT_OK(self, ddp_process_group_host_group(pg, &host));
  DPT_CHECK(self, host && host != pg && ddp_process_group_takes_host(host) && dp->host_pg == host,
            "the wrapper's host group");
  DPT_CHECK(self, ddp_model_counters(m)[0] == 5, "counter %lld after the broadcast",
            (long long)ddp_model_counters(m)[0]);
  for (int k = 0; k < 3; k++) {
    DPT_OK(self, ddp_dp_set_comm_hook(dp, kinds[k]));
    fill_grads(m, self->rank);
    DPT_OK(self, ddp_dp_reduce_grads(dp));
    float want = (grad_value(0, 7) + grad_value(1, 7)) / 2; /* float32: exact enough at W=2 */
    float got = ddp_model_grads_flat(m)[7];
    DPT_CHECK(self, k > 0 || got == want, "hook %d: gradient 7 = %.9g, want %.9g", k, (double)got,
              (double)want);
  }
  /* A SyncBatchNorm forward in training: its statistics are host doubles. */
  ddp_tape *tape = NULL;
  DPT_OK(self, ddp_tape_create(&tape, 0));
  float xbuf[4 * 784];
  int64_t ybuf[4];
  ddp_tensor x, y, *out = NULL;
  dpt_batch("convnet", 0, self->rank, 2, 4, xbuf, ybuf, &x, &y);
  DPT_OK(self, ddp_dp_forward(dp, tape, &x, &out));
  ddp_tape_destroy(tape);
  /* Join with nothing left to train: the census and the final vote are host
   * ints (join refuses SyncBatchNorm: converted back first). */
  DPT_OK(self, ddp_model_convert_sync_batchnorm(m, NULL));
  DPT_OK(self, ddp_dp_join_enable(dp, false));
  DPT_OK(self, ddp_dp_join(dp));
  ddp_dp_destroy(dp);
  ddp_model_destroy(m);
}

static void test_group_without_host_buffers(void **state) {
  (void)state;
  ddp__staged_mode = -1;
  ddp__pointer_device_hook = fake_where;
  int rc = dpt_run(2, 30, gpu_group_body, NULL);
  ddp__pointer_device_hook = NULL;
  ddp__staged_mode = 0;
  assert_int_equal(rc, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_kernels_equal_host_loops),
      cmocka_unit_test(test_group_without_host_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
