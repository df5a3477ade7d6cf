/* Seed 001's launch_ddp.py in C: the MNIST ConvNet (two conv + BatchNorm +
 * ReLU + max-pool blocks, fc 1568->10), torch.manual_seed(0), batch 100 per
 * rank, cross-entropy, SGD lr 1e-4, DistributedDataParallel and a
 * DistributedSampler, printing every 100 steps on rank 0 as the seed does:
 *
 *   build/bin/ddprun --nproc-per-node 2 build/bin/mnist_ddp [--epochs 2]
 *       [--lr 1e-4] [--max-steps N] [--data DIR] [--eval-samples N]
 *       [--device cpu|cuda|cuda:N]
 *
 * --device cuda is the seed's GPU run: each rank on cuda:LOCAL_RANK (modulo
 * the GPUs it sees after CUDA_VISIBLE_DEVICES, as device_ids=[rank]), its
 * threads on the CPUs near that GPU, the group on NCCL
 * (init_process_group("nccl"); ddp's own backend, staged through host
 * memory, where NCCL does not load), and a second group on ddp's own
 * backend for the few host numbers it reduces (the loss it prints, the test
 * sums), as a PyTorch program would keep a gloo group beside its NCCL one.
 *
 * DIR holds MNIST-format IDX files (default Fashion-MNIST; real MNIST works
 * the same). After training it evaluates on the test set (its first N samples
 * with --eval-samples) split over the ranks without padding, reduces loss, correct and count, and checks that
 * every test sample was counted once and that the training loss fell. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"

#define CHECK(expr)                                                            \
  do {                                                                         \
    ddp_status s_ = (expr);                                                    \
    if (s_ != DDP_OK) {                                                        \
      fprintf(stderr, "mnist_ddp: %s: %s\n", #expr, ddp_last_error());         \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

typedef struct options {
  int64_t epochs, max_steps, eval_samples; /* eval_samples 0: the whole test set */
  double lr;
  const char *data;
  const char *device; /* "cpu", "cuda", "cuda:N" */
} options;

static options parse(int argc, char **argv) {
  options o = {.epochs = 2, .lr = 1e-4, .data = "/usr/share/datasets/fashion-mnist", .device = "cpu"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--epochs")) o.epochs = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--max-steps")) o.max_steps = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--lr")) o.lr = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--data")) o.data = argv[i + 1];
    else if (!strcmp(argv[i], "--eval-samples")) o.eval_samples = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--device")) o.device = argv[i + 1];
    else break;
  }
  if (argc % 2 == 0 || o.epochs < 1 || o.max_steps < 0 || o.eval_samples < 0 || !(o.lr > 0)) {
    fprintf(stderr, "usage: mnist_ddp [--epochs E] [--lr X] [--max-steps N] [--data DIR] "
                    "[--eval-samples N] [--device cpu|cuda|cuda:N]\n");
    exit(2);
  }
  return o;
}

/* --device: the CPU, or this rank's GPU: cuda is cuda:(LOCAL_RANK % GPUs),
 * cuda:N that one. Refused, saying why and what to do, before anything
 * starts when this machine has no such GPU. */
static ddp_device pick_device(const char *text) {
  ddp_device d = DDP_CPU;
  if (ddp_device_parse(text, &d) != DDP_OK) {
    fprintf(stderr, "mnist_ddp: --device %s: %s\n", text, ddp_last_error());
    exit(2);
  }
  if (d.type == DDP_DEVICE_CPU) return d;
  if (ddp_cuda_device_count() == 0) {
    fprintf(stderr, "mnist_ddp: --device %s: no CUDA device here (%s); run with --device cpu\n", text,
            ddp_cuda_unavailable_reason());
    exit(2);
  }
  if (!strcmp(text, "cuda")) {
    int64_t local_rank = 0, local_world = 1;
    if (ddp_env_int("LOCAL_RANK", 0, &local_rank) != DDP_OK ||
        ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_world) != DDP_OK) {
      fprintf(stderr, "mnist_ddp: --device cuda: %s\n", ddp_last_error());
      exit(2);
    }
    CHECK(ddp_default_cuda_device((int)local_rank, (int)local_world, &d));
  } else if (ddp_device_check(d) != DDP_OK) {
    fprintf(stderr, "mnist_ddp: --device %s: %s\n", text, ddp_last_error());
    exit(2);
  }
  return d;
}

/* Test loss and accuracy over the whole test set: each rank its share.
 * pg reduces the host sums (on a GPU run the host group). */
static void evaluate(ddp_model *model, ddp_tape *tape, ddp_loader *loader, ddp_device dev,
                     ddp_process_group *pg, double sums[3]) {
  sums[0] = sums[1] = sums[2] = 0; /* loss sum, correct, samples */
  ddp_model_train(model, false);   /* model.eval() */
  ddp_tape_set_grad_enabled(tape, false);
  CHECK(ddp_loader_start_epoch(loader, 0));
  for (;;) {
    ddp_batch b;
    CHECK(ddp_loader_next(loader, &b));
    if (b.size == 0) break;
    ddp_tensor *out, *loss, *x, *y_dev;
    ddp_tape_reset(tape);
    CHECK(ddp_to(tape, &b.x, dev, &x)); /* the batch to the model's device (a no-op on the CPU) */
    CHECK(ddp_to(tape, &b.y, dev, &y_dev));
    CHECK(ddp_model_forward(model, tape, x, &out));
    CHECK(ddp_model_loss(model, tape, out, y_dev, &loss));
    CHECK(ddp_to(tape, out, DDP_CPU, &out)); /* the host reads them */
    CHECK(ddp_to(tape, loss, DDP_CPU, &loss));
    CHECK(ddp_device_synchronize(dev));
    const float *o = ddp_tensor_f32(out); /* (size, 10) */
    const int64_t *y = ddp_tensor_i64(&b.y);
    for (int64_t i = 0; i < b.size; i++) {
      int64_t best = 0;
      for (int64_t c = 1; c < 10; c++)
        if (o[i * 10 + c] > o[i * 10 + best]) best = c;
      sums[1] += best == y[i];
    }
    sums[0] += (double)ddp_tensor_f32(loss)[0] * (double)b.size;
    sums[2] += (double)b.size;
  }
  ddp_tape_set_grad_enabled(tape, true);
  ddp_model_train(model, true);
  CHECK(ddp_allreduce(pg, sums, 3, DDP_FLOAT64, DDP_REDUCE_SUM)); /* once, at the end */
}

int main(int argc, char **argv) {
  options o = parse(argc, argv);
  ddp_device dev = pick_device(o.device); /* torch.cuda.set_device(gpu) */
  ddp_process_group_options pgo = ddp_process_group_defaults();
  char nccl[128];
  if (dev.type == DDP_DEVICE_CUDA) {
    char near[400];
    if (ddp_bind_near_gpu(dev.index, near, sizeof near) != DDP_OK)
      fprintf(stderr, "mnist_ddp: warning: %s\n", ddp_last_error());
    pgo.backend = ddp_nccl_version(nccl, sizeof nccl) == DDP_OK ? "nccl" : "ddp";
  }
  ddp_process_group *pg; /* init_process_group(backend, init_method='env://') */
  CHECK(ddp_init_process_group("env://", NULL, &pgo, &pg));
  /* The host numbers' group: the world again on ddp's own backend. */
  ddp_process_group *host_pg = pg;
  if (dev.type == DDP_DEVICE_CUDA) CHECK(ddp_init_process_group("env://", NULL, NULL, &host_pg));
  int rank = ddp_process_group_rank(pg), world = ddp_process_group_size(pg);
  double start = ddp_time_s();

  ddp_model *model; /* torch.manual_seed(0); model = ConvNet() */
  CHECK(ddp_model_build("convnet", NULL, 0, &model));
  CHECK(ddp_model_to(model, dev)); /* model.cuda(gpu) */
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  sgd.lr = o.lr; /* torch.optim.SGD(model.parameters(), 1e-4) */
  sgd.device = dev;
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &sgd, ddp_model_params_flat(model),
                             ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)));
  ddp_dp *dp; /* nn.parallel.DistributedDataParallel(model) */
  ddp_dp_options dpo = ddp_dp_defaults();
  CHECK(ddp_dp_create(&dp, model, pg, &dpo));
  ddp_dp_set_optimizer(dp, opt);

  ddp_dataset *train, *test; /* ToTensor(): pixels / 255 */
  CHECK(ddp_dataset_open_idx_dir(&train, o.data, DDP_SPLIT_TRAIN));
  CHECK(ddp_dataset_open_idx_dir(&test, o.data, DDP_SPLIT_TEST));
  ddp_sampler *train_sampler, *test_sampler;
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(world, rank);
  CHECK(ddp_sampler_create_distributed(&train_sampler, ddp_dataset_size(train), &so));
  int64_t test_n = ddp_dataset_size(test);
  if (o.eval_samples && o.eval_samples < test_n) test_n = o.eval_samples;
  CHECK(ddp_sampler_create_distributed_eval(&test_sampler, test_n, world, rank));
  ddp_loader_config lc = ddp_loader_defaults(); /* batch_size=100, num_workers=0 */
  lc.batch_size = 100;
  lc.sampler = train_sampler;
  ddp_loader *train_loader, *test_loader;
  CHECK(ddp_loader_create(&train_loader, train, &lc));
  lc.sampler = test_sampler;
  lc.batch_size = 1000;
  CHECK(ddp_loader_create(&test_loader, test, &lc));
  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 16 << 20));

  int64_t total_step = ddp_loader_num_batches(train_loader), step = 0;
  double first_loss = NAN, loss_sum = 0; /* reduced over ranks */
  int64_t loss_count = 0;
  bool done = false;
  for (int64_t epoch = 0; epoch < o.epochs && !done; epoch++) {
    CHECK(ddp_loader_start_epoch(train_loader, epoch)); /* set_epoch, then iterate */
    loss_sum = 0;
    loss_count = 0;
    for (int64_t i = 0;; i++) {
      if (o.max_steps && step >= o.max_steps) {
        done = true;
        break;
      }
      ddp_batch b;
      CHECK(ddp_loader_next(train_loader, &b));
      if (b.size == 0) break;
      ddp_tensor *out, *loss, *x, *y, *loss_host;
      ddp_tape_reset(tape);
      CHECK(ddp_to(tape, &b.x, dev, &x));                  /* images.cuda(non_blocking=True) */
      CHECK(ddp_to(tape, &b.y, dev, &y));
      ddp_model_zero_grad(model);                          /* optimizer.zero_grad() */
      CHECK(ddp_dp_forward(dp, tape, x, &out));            /* outputs = model(images) */
      CHECK(ddp_model_loss(model, tape, out, y, &loss));   /* criterion(outputs, labels) */
      CHECK(ddp_dp_backward(dp, tape, loss));              /* loss.backward() */
      CHECK(ddp_optimizer_step(opt));                      /* optimizer.step() */
      CHECK(ddp_to(tape, loss, DDP_CPU, &loss_host));      /* loss.item() */
      CHECK(ddp_device_synchronize(dev));
      double l = ddp_tensor_f32(loss_host)[0];
      CHECK(ddp_allreduce(host_pg, &l, 1, DDP_FLOAT64, DDP_REDUCE_AVG));
      if (step == 0) first_loss = l;
      loss_sum += l;
      loss_count++;
      step++;
      if ((i + 1) % 100 == 0 && rank == 0)
        printf("Epoch [%lld/%lld], Step [%lld/%lld], Loss: %.4f\n", (long long)epoch + 1,
               (long long)o.epochs, (long long)i + 1, (long long)total_step, l);
    }
  }
  double seconds = ddp_time_s() - start;
  double sums[3];
  evaluate(model, tape, test_loader, dev, host_pg, sums);
  double last_mean = loss_count ? loss_sum / (double)loss_count : NAN;
  bool counted_once = sums[2] == (double)test_n;
  bool ok = counted_once && isfinite(last_mean) && last_mean < first_loss;
  if (rank == 0) {
    printf("Training complete in: %.1f s (%lld steps of %d x 100 samples) on %s, backend %s\n", seconds,
           (long long)step, world, o.device, ddp_process_group_backend(pg));
    printf("loss: first step %.4f, mean of the last epoch's steps %.4f; test: loss %.4f, "
           "accuracy %.2f%% over %.0f samples (each counted once: %s): %s\n",
           first_loss, last_mean, sums[0] / sums[2], 100 * sums[1] / sums[2], sums[2],
           counted_once ? "yes" : "NO", ok ? "ok" : "FAILED");
  }
  ddp_tape_destroy(tape);
  ddp_loader_destroy(test_loader);
  ddp_loader_destroy(train_loader);
  ddp_sampler_destroy(test_sampler);
  ddp_sampler_destroy(train_sampler);
  ddp_dataset_destroy(test);
  ddp_dataset_destroy(train);
  ddp_dp_destroy(dp);
  ddp_optimizer_destroy(opt);
  ddp_model_destroy(model);
  CHECK(ddp_barrier(host_pg));
  if (host_pg != pg) ddp_process_group_destroy(host_pg);
  ddp_process_group_destroy(pg);
  return ok ? 0 : 1;
}
