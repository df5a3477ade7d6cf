/* Seed 000's "Distributed Data Parallel with Model Parallel in an HPC
 * environment" in C: the head/tail ToyModel (head Linear 32->32, tail Linear
 * 32->10) cut in two, one replica per --groups_size devices, --group_per_node
 * replicas per node, data parallel across the replicas, ToyData, Adam lr
 * 1e-4, cross-entropy, --batch_size per replica. Here the devices are
 * ranks: the trainer's pipeline (ddp_train_options.pipeline) puts stage s of
 * replica k on rank k * groups_size + s, so a node of ddprun's
 * --nproc-per-node groups_size * group_per_node workers holds
 * group_per_node whole replicas, as the seed's node held 4 replicas on its 8
 * GPUs.
 *
 * Note the counting: the seed's WORLD_SIZE counted replicas (one process
 * drove its replica's two GPUs, start_dev_id = gs * (rank % gpn)), where
 * ddp's counts ranks, stages x replicas: the seed's 2 nodes x 4 replicas of
 * 2 GPUs were WORLD_SIZE 8; here they are 16 ranks, ddprun --nnodes 2
 * --nproc-per-node 8. examples/model_parallel_hpc.sh is the seed's
 * launch.sh and examples/model_parallel_hpc.sbatch its job.sbatch.
 *
 *   build/bin/ddprun --nproc-per-node 4 build/bin/model_parallel_hpc \
 *       --groups_size 2 --group_per_node 2 [--batch_size 1024] [--samples N]
 *       [--max_steps S] [--microbatches M] [--device cpu|cuda|cuda:N]
 *
 * --device cuda is the seed's GPUs: each rank's stage on cuda:(LOCAL_RANK %
 * GPUs) (after CUDA_VISIBLE_DEVICES), so a node's 8 ranks are its 8 GPUs as
 * the seed's 4 processes drove 2 GPUs each; activations and their
 * gradients go between the stages by NCCL's send/recv (the world on
 * backend nccl where NCCL loads, else ddp's own, staged through pinned host
 * memory; DDP_BACKEND decides when set), and the replicas' gradients by
 * NCCL's allreduce. The trained model is gathered into host memory either
 * way, so the checks below are the CPU run's.
 *
 * It checks and prints what it demonstrates: the layout (every rank's
 * replica and stage; a replica's stages on one node), the loss falling, and
 * the replicas' heads and tails identical after training. Exit status 1 if
 * a check fails. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/train.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "model_parallel_hpc: %s: %s\n", #expr, ddp_last_error()); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

typedef struct args {
  int groups_size;    /* stages per replica (the seed's GPUs per model) */
  int group_per_node; /* replicas per node; 0: LOCAL_WORLD_SIZE / groups_size */
  int64_t batch_size, samples, max_steps;
  int microbatches;   /* 0: groups_size */
  const char *device; /* "cpu", "cuda", "cuda:N" */
} args;

static void usage(void) {
  fprintf(stderr, "usage: model_parallel_hpc [--groups_size P] [--group_per_node R] "
                  "[--batch_size B] [--samples N] [--max_steps S] [--microbatches M] "
                  "[--device cpu|cuda|cuda:N]\n");
  exit(2);
}

static args parse(int argc, char **argv) {
  args a = {.groups_size = 2, .batch_size = 1024, .samples = (int64_t)1 << 20, .max_steps = 0,
            .device = "cpu"};
  for (int i = 1; i < argc; i++) {
    if (i + 1 >= argc) usage();
    const char *f = argv[i], *v = argv[++i];
    /* The seed's underscores, and ddp's dashes. */
    if (!strcmp(f, "--groups_size") || !strcmp(f, "--groups-size")) a.groups_size = atoi(v);
    else if (!strcmp(f, "--group_per_node") || !strcmp(f, "--group-per-node")) a.group_per_node = atoi(v);
    else if (!strcmp(f, "--batch_size") || !strcmp(f, "--batch-size")) a.batch_size = atoll(v);
    else if (!strcmp(f, "--samples")) a.samples = atoll(v);
    else if (!strcmp(f, "--max_steps") || !strcmp(f, "--max-steps")) a.max_steps = atoll(v);
    else if (!strcmp(f, "--microbatches")) a.microbatches = atoi(v);
    else if (!strcmp(f, "--device")) a.device = v;
    else if (!strcmp(f, "--local_rank")) continue; /* torch.distributed.launch's; ddp reads LOCAL_RANK */
    else usage();
  }
  if (a.groups_size < 2 || a.group_per_node < 0 || a.batch_size < 1 || a.samples < 1 ||
      a.max_steps < 0 || a.microbatches < 0)
    usage();
  return a;
}

/* --device: the CPU, or this rank's GPU: cuda is cuda:(LOCAL_RANK % GPUs)
 * (the seed's start_dev_id + stage), cuda:N that one. Refused, saying why
 * and what to do, before anything starts when there is no such GPU. */
static ddp_device pick_device(const char *text) {
  ddp_device d = DDP_CPU;
  if (ddp_device_parse(text, &d) != DDP_OK) {
    fprintf(stderr, "model_parallel_hpc: --device %s: %s\n", text, ddp_last_error());
    exit(2);
  }
  if (d.type == DDP_DEVICE_CPU) return d;
  if (ddp_cuda_device_count() == 0) {
    fprintf(stderr, "model_parallel_hpc: --device %s: no CUDA device here (%s); run with --device "
            "cpu\n", text, ddp_cuda_unavailable_reason());
    exit(2);
  }
  if (!strcmp(text, "cuda")) {
    int64_t local_rank = 0, local_world = 1;
    CHECK(ddp_env_int("LOCAL_RANK", 0, &local_rank));
    CHECK(ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_world));
    CHECK(ddp_default_cuda_device((int)local_rank, (int)local_world, &d));
  } else if (ddp_device_check(d) != DDP_OK) {
    fprintf(stderr, "model_parallel_hpc: --device %s: %s\n", text, ddp_last_error());
    exit(2);
  }
  return d;
}

/* The loss of the first and the last `window` steps (the global batch's,
 * the same on every rank). */
typedef struct losses {
  double first, last;
  int64_t steps, window, total;
} losses;

static void on_start(const ddp_train_start_info *info, void *user) {
  losses *l = user;
  l->total = info->total_steps;
  l->window = info->total_steps / 4 > 0 ? info->total_steps / 4 : 1;
}

static bool on_step(const ddp_train_step_info *info, void *user) {
  losses *l = user;
  if (info->step <= l->window) l->first += info->loss / (double)l->window;
  if (info->step > l->total - l->window) l->last += info->loss / (double)l->window;
  l->steps = info->step;
  return false;
}

int main(int argc, char **argv) {
  args a = parse(argc, argv);
  const ddp_device dev = pick_device(a.device);
  ddp_process_group_options pgo = ddp_process_group_defaults();
  char nccl[128];
  const char *asked = getenv("DDP_BACKEND");
  if (dev.type == DDP_DEVICE_CUDA && !(asked && *asked))
    pgo.backend = ddp_nccl_version(nccl, sizeof nccl) == DDP_OK ? "nccl" : "ddp";
  ddp_process_group *world; /* init_process_group(backend, init_method='env://') */
  CHECK(ddp_init_process_group("env://", NULL, &pgo, &world));
  /* The checks' host numbers: over the world itself, or beside it on ddp's
   * own backend where the world is nccl. */
  ddp_process_group *host = world;
  if (!ddp_process_group_takes_host(world)) CHECK(ddp_process_group_host_group(world, &host));
  const int rank = ddp_process_group_rank(world), size = ddp_process_group_size(world);
  const int P = a.groups_size;
  if (size % P) {
    fprintf(stderr, "model_parallel_hpc: %d ranks are not whole replicas of --groups_size %d\n",
            size, P);
    return 1;
  }
  int64_t local_world = size;
  CHECK(ddp_env_int("LOCAL_WORLD_SIZE", size, &local_world));
  const int gpn = a.group_per_node ? a.group_per_node : (int)(local_world / P);
  const int replica = rank / P, stage = rank % P, replicas = size / P;
  /* The seed: process `replica` of its node drove GPUs gs * (replica % gpn)
   * and the next; here they are ranks replica * P .. + P - 1, on node
   * replica / gpn when each node runs gpn * P workers. */
  const int node = replica / gpn, node_of_rank = (int)(rank / local_world);
  const bool layout_ok = (int64_t)gpn * P == local_world && node == node_of_rank;
  printf("rank %d: replica %d of %d, stage %d of %d (%s), node %d (the seed's process %d, "
         "GPU %d of its node): %s\n",
         rank, replica, replicas, stage, P, stage == 0 ? "head" : stage == P - 1 ? "tail" : "middle",
         node, replica, P * (replica % gpn) + stage,
         layout_ok ? "ok" : "FAIL (run ddprun --nproc-per-node groups_size * group_per_node)");

  ddp_model *model;
  CHECK(ddp_model_build("headtail", NULL, 1, &model));
  ddp_dataset *train, *test;
  CHECK(ddp_dataset_create_toydata(&train, a.samples));
  CHECK(ddp_dataset_create_toydata(&test, 10000));
  ddp_train_options o = ddp_train_defaults();
  o.optim = ddp_optim_defaults(DDP_OPTIM_ADAM);
  o.optim.lr = 1e-4; /* the seed's torch.optim.Adam(lr=0.0001) */
  o.batch_size = a.batch_size;
  o.max_steps = a.max_steps;
  o.workers = 0;
  o.microbatches = a.microbatches ? a.microbatches : P;
  o.device = dev;
  ddp_train_pipeline pipeline = {.stages = P, .schedule = DDP_PIPELINE_1F1B, .virtual_stages = 1,
                                 .split = P == 2 ? "tail" : "auto"};
  o.pipeline = &pipeline;
  losses l = {0};
  o.callbacks = (ddp_train_callbacks){on_start, on_step, NULL, &l};
  ddp_trainer *t;
  CHECK(ddp_trainer_create(&t, model, train, test, world, &o));
  ddp_train_result r;
  CHECK(ddp_trainer_run(t, &r));

  /* After the run every rank's model holds the trained head and tail (the
   * trainer gathers the stages): the replicas agree when the smallest and
   * the largest value of every parameter over the world are the same. */
  const int64_t n = ddp_model_num_param_elements(model);
  float *lo = malloc((size_t)n * sizeof(float)), *hi = malloc((size_t)n * sizeof(float));
  if (!lo || !hi) return 1;
  memcpy(lo, ddp_model_params_flat(model), (size_t)n * sizeof(float));
  memcpy(hi, lo, (size_t)n * sizeof(float));
  CHECK(ddp_allreduce(host, lo, (size_t)n, DDP_FLOAT32, DDP_REDUCE_MIN));
  CHECK(ddp_allreduce(host, hi, (size_t)n, DDP_FLOAT32, DDP_REDUCE_MAX));
  bool same = memcmp(lo, hi, (size_t)n * sizeof(float)) == 0;
  const bool falls = isfinite(l.last) && l.last < l.first;
  if (rank == 0) {
    char where[DDP_DEVICE_STR_BYTES];
    printf("stages on %s, world on backend %s\n",
           dev.type == DDP_DEVICE_CPU ? "cpu" : ddp_device_str(dev, where, sizeof where),
           ddp_process_group_backend(world));
    printf("loss over all replicas: first %lld steps %.4f, last %lld steps %.4f: %s\n",
           (long long)l.window, l.first, (long long)l.window, l.last, falls ? "ok" : "FAILED");
    printf("replicas after %lld steps: head and tail identical on all %d ranks: %s\n",
           (long long)r.steps, size, same ? "ok" : "FAILED");
    for (int64_t k = 0; k < r.n_stages; k++)
      printf("stage %d: idle %.1f%% of its steps, activations at most %lld bytes "
             "(%d micro-batches at once)\n",
             (int)r.stages[k].rank, 100 * r.stages[k].idle_fraction,
             (long long)r.stages[k].activation_bytes_high_water, (int)r.stages[k].live_high_water);
  }
  ddp_train_result_free(&r);
  free(lo);
  free(hi);
  ddp_trainer_destroy(t);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_model_destroy(model);
  ddp_process_group_destroy(world);
  return layout_ok && falls && same ? 0 : 1;
}
