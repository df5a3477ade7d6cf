/* The loader's delivery rate over Fashion-MNIST: samples per second handed to
 * a consumer that only reads each batch (so the loader is the bottleneck),
 * batch 100, shuffled, for each worker count; the median of several epochs.
 * Also the time to read and validate the dataset. The figure to beat is the
 * ConvNet's training rate (~3,000 samples/s on one thread): the loader must
 * deliver at least 10x that so it never starves training. With --work-us U
 * the consumer also spins U microseconds per batch (a stand-in for a training
 * step) and the time it waits inside ddp_loader_next is reported: with
 * workers that wait should vanish, as the batches are prepared meanwhile.
 *
 *   bench_loader [--data DIR] [--runs N] [--batch B] [--workers 0,2]
 *                [--reference SAMPLES_PER_S] [--work-us U] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double work_us = 0; /* simulated training work per batch */
static double wait_s = 0;  /* time spent inside ddp_loader_next */

/* One epoch through the loader; returns seconds. The checksum keeps the
 * compiler from skipping the reads. */
static double time_epoch(ddp_loader *l, int64_t epoch, int64_t *samples, double *checksum) {
  double t0 = ddp_time_s();
  if (ddp_loader_start_epoch(l, epoch) != DDP_OK) {
    fprintf(stderr, "bench_loader: %s\n", ddp_last_error());
    exit(1);
  }
  for (;;) {
    ddp_batch b;
    const double w0 = ddp_time_s();
    const ddp_status status = ddp_loader_next(l, &b);
    wait_s += ddp_time_s() - w0;
    if (status != DDP_OK) {
      fprintf(stderr, "bench_loader: %s\n", ddp_last_error());
      exit(1);
    }
    if (b.size == 0) break;
    const float *x = ddp_tensor_f32(&b.x);
    *checksum += x[0] + x[b.x.numel - 1] + (double)ddp_tensor_i64(&b.y)[b.size - 1];
    *samples += b.size;
    const double until = ddp_time_s() + work_us * 1e-6;
    while (work_us > 0 && ddp_time_s() < until) {
    }
  }
  return ddp_time_s() - t0;
}

int main(int argc, char **argv) {
  const char *dir = "/usr/share/datasets/fashion-mnist";
  const char *workers_list = "0,2";
  int runs = 5;
  int64_t batch = 100;
  double reference = 3000.0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--data") && i + 1 < argc) dir = argv[++i];
    else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch") && i + 1 < argc) batch = atoll(argv[++i]);
    else if (!strcmp(argv[i], "--workers") && i + 1 < argc) workers_list = argv[++i];
    else if (!strcmp(argv[i], "--reference") && i + 1 < argc) reference = atof(argv[++i]);
    else if (!strcmp(argv[i], "--work-us") && i + 1 < argc) work_us = atof(argv[++i]);
    else {
      fprintf(stderr,
              "usage: bench_loader [--data DIR] [--runs N] [--batch B] [--workers 0,2] "
              "[--reference SAMPLES_PER_S] [--work-us U]\n");
      return 2;
    }
  }
  if (runs < 1 || runs > 100 || batch < 1) {
    fprintf(stderr, "bench_loader: --runs must be in [1, 100] and --batch >= 1\n");
    return 2;
  }

  double t0 = ddp_time_s();
  ddp_dataset *ds;
  if (ddp_dataset_open_idx_dir(&ds, dir, DDP_SPLIT_TRAIN) != DDP_OK) {
    fprintf(stderr, "bench_loader: %s\n", ddp_last_error());
    return 1;
  }
  const double load_s = ddp_time_s() - t0;
  printf("dataset %s: %lld samples read and validated in %.3f s\n",
         ddp_dataset_get_info(ds)->name, (long long)ddp_dataset_size(ds), load_s);

  char list[256];
  snprintf(list, sizeof list, "%s", workers_list);
  double checksum = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    ddp_loader_config cfg = ddp_loader_defaults();
    cfg.batch_size = batch;
    cfg.shuffle = true;
    cfg.seed = 0;
    cfg.num_workers = atoi(tok);
    ddp_loader *l;
    if (ddp_loader_create(&l, ds, &cfg) != DDP_OK) {
      fprintf(stderr, "bench_loader: %s\n", ddp_last_error());
      return 1;
    }
    int64_t samples = 0;
    time_epoch(l, 0, &samples, &checksum); /* warm-up */
    double rate[100];
    wait_s = 0;
    int64_t batches = 0;
    for (int r = 0; r < runs; r++) {
      samples = 0;
      batches += ddp_loader_num_batches(l);
      double s = time_epoch(l, 1 + r, &samples, &checksum);
      rate[r] = (double)samples / s;
    }
    qsort(rate, (size_t)runs, sizeof *rate, cmp_double);
    const double median = rate[runs / 2];
    printf("loader batch=%lld shuffle=1 workers=%d samples_per_s=%.0f (median of %d epochs, "
           "min %.0f, max %.0f) ratio_vs_training=%.1fx (reference %.0f samples/s)\n",
           (long long)batch, cfg.num_workers, median, runs, rate[0], rate[runs - 1],
           median / reference, reference);
    if (work_us > 0)
      printf("  with %.0f us of work per batch: the consumer waited %.1f us per batch in "
             "ddp_loader_next\n",
             work_us, wait_s / (double)batches * 1e6);
    ddp_loader_destroy(l);
  }
  fprintf(stderr, "checksum %g\n", checksum);
  ddp_dataset_destroy(ds);
  return 0;
}
