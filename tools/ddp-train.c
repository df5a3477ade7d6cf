/* ddp-train: trains one of the seeds' models from the command line — the
 * dataset, the loader, the model, the optimizer and an optional StepLR —
 * with progress on stderr, an optional JSON-lines log and a JSON summary.
 * Under a launcher (ddprun, torchrun's variables, srun, mpirun) it trains
 * data-parallel: tools/train/world.c joins the group, the DDP wrapper
 * averages gradients, and rank 0 reports. Tools are the only code that calls
 * exit(). */
#include <cblas.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"
#include "train/world.h"

#define DEFAULT_DATA "/usr/share/datasets/fashion-mnist"
/* Steps left out of steady_samples_per_s, as PyTorch's reference script
 * leaves out its 10 warm-up steps. */
#define WARMUP_STEPS 10

typedef struct train_args {
  const char *model;
  const char *activation; /* NULL unless given */
  const char *data;       /* DIR, "toydata" or "regression"; NULL = the model's default */
  int64_t samples;        /* synthetic datasets' size; 0 = default */
  int64_t epochs;
  int64_t max_steps;      /* 0 = no limit */
  int64_t batch_size;
  double lr;              /* NAN = the optimizer's default */
  const char *optimizer;
  double momentum;
  double weight_decay;
  const char *scheduler;  /* NULL or "step" */
  int64_t step_size;
  double gamma;
  uint64_t seed;
  int threads;             /* 0 = $OMP_NUM_THREADS, else 1 */
  int workers;            /* -1 = automatic (see default_workers) */
  bool sync_bn;
  const char *dump_state; /* NULL unless given */
  int64_t eval_every;     /* 0 = at the end of each epoch and of training */
  int64_t patience;       /* 0 = never stop early */
  const char *log_path;
  bool json;
  const char *save_path;   /* --save: checkpoint at the end (and every save_every steps) */
  int64_t save_every;      /* 0 = only at the end */
  const char *resume_path; /* --resume: continue from this checkpoint */
  const char *init_path;   /* --init: start from this state dict */
} train_args;

static void usage(FILE *f) {
  fprintf(f,
"usage: ddp-train [options]\n"
"\n"
"Trains one of the seeds' models on one process (PyTorch's training loop, in C).\n"
"\n"
"Model\n"
"  --model NAME         toy | headtail | convnet | psnet | convnet-N (N in 2..10)\n"
"                       (default convnet)\n"
"  --activation NAME    relu | sigmoid | tanh, for convnet-N (default relu)\n"
"Data\n"
"  --data WHERE         a directory of MNIST-format IDX files (train-images-idx3-ubyte[.gz],\n"
"                       ...), or toydata (seed 000) or regression (seed 001). Default: the\n"
"                       model's own: " DEFAULT_DATA " for the image\n"
"                       models, toydata for headtail, regression for toy\n"
"  --samples N          size of a synthetic training set (toydata 1048576, regression 1024)\n"
"  --batch-size N       samples per step (default 100)\n"
"  --workers N          loader threads preparing batches ahead (0 = inline; default 1, or\n"
"                       0 when the ranks on this host already fill its cores)\n"
"Training\n"
"  --epochs N           passes over the training set (default 1; 0 = only evaluate)\n"
"  --max-steps N        stop after N optimizer steps in total (default 0: no limit)\n"
"  --optimizer NAME     sgd | adam | adadelta (default sgd)\n"
"  --lr X               learning rate (default: sgd 0.01, adam 0.001, adadelta 1.0)\n"
"  --momentum X         SGD momentum (default 0)\n"
"  --weight-decay X     L2 penalty (default 0)\n"
"  --scheduler step     StepLR: multiply the lr by --gamma every --step-size epochs\n"
"  --step-size N        epochs between lr changes (default 1)\n"
"  --gamma X            lr factor (default 0.1)\n"
"  --seed N             seeds the weights, the shuffle and dropout (default 1)\n"
"  --threads N          BLAS threads per process (default: $OMP_NUM_THREADS if set, else 1;\n"
"                       ddprun sets OMP_NUM_THREADS=1 for several workers)\n"
"Data parallel (automatic under ddprun, torchrun's variables, srun or mpirun)\n"
"  --sync-bn            BatchNorm statistics over the whole global batch (SyncBatchNorm)\n"
"  --dump-state PATH    after training, write every state-dict tensor as text lines\n"
"                       'name numel v0 v1 ...' to PATH ({rank} in PATH: every rank writes\n"
"                       its own file; otherwise rank 0 only). For comparing runs\n"
"Evaluation and output\n"
"  --eval-every N       evaluate on the test set every N steps (default 0: at the end\n"
"                       of each epoch and of training)\n"
"  --patience K         stop after K evaluations in a row without a better test loss\n"
"  --log FILE           one JSON object per line: per step {step, epoch, loss, lr,\n"
"                       samples_per_s, and where the step's time went: load_ms,\n"
"                       forward_ms, backward_compute_ms, backward_comm_ms (the\n"
"                       communication backward did not hide, waiting for the slowest\n"
"                       rank included), optimizer_ms, step_ms, and preempted_ms (the\n"
"                       time the rank was ready to run while another task held its\n"
"                       CPU)}, per evaluation {step, epoch, test_loss, test_accuracy}\n"
"  --json               end stdout with one JSON summary line (samples_per_s,\n"
"                       steady_samples_per_s (without the first 10 steps), train_loss,\n"
"                       test_loss, test_accuracy, steps, steady_step_phases (rank 0's\n"
"                       mean of the per-step times above over those steps),\n"
"                       steady_preempted_ms_per_rank (every rank's mean preempted_ms),\n"
"                       epochs, world_size)\n"
"Checkpoints (safetensors; docs/io.md)\n"
"  --save PATH          at the end of training write the model's state dict to PATH (loads\n"
"                       into PyTorch with load_state_dict(strict=True)) and the training\n"
"                       state (optimizer, scheduler, step, epoch, RNG) beside it, in\n"
"                       PATH's .train.safetensors (PATH.safetensors -> PATH.train.safetensors);\n"
"                       rank 0 writes\n"
"  --save-every N       also save every N optimizer steps (default 0: only at the end)\n"
"  --resume PATH        continue the run saved in PATH exactly where it stopped: the step\n"
"                       count continues (--max-steps and --epochs count from the start of\n"
"                       training); model, optimizer and data options must be the same\n"
"  --init PATH          start from the model state dict in PATH instead of a fresh\n"
"                       initialisation (a safetensors file from --save or from PyTorch's\n"
"                       state_dict(); a 'module.' prefix is accepted); with --epochs 0 this\n"
"                       evaluates a saved model\n"
"  -h, --help           this text\n"
"\n"
"Progress (loss, samples/s, ETA) goes to stderr: a bar on a terminal, a line every few\n"
"seconds otherwise. Example:\n"
"  ddp-train --model convnet --epochs 3 --lr 0.01 --momentum 0.9 --json\n"
"\n"
"Under a launcher every rank trains on its shard of each epoch (DistributedSampler);\n"
"--batch-size is per rank, gradients are averaged over the ranks, the test set is split\n"
"without padding, and rank 0 prints losses, accuracy and samples/s of all ranks:\n"
"  ddprun --nproc-per-node 2 ddp-train --model convnet --epochs 3 --momentum 0.9\n");
}

static _Noreturn void die_usage(const char *fmt, const char *arg) {
  fprintf(stderr, "ddp-train: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\n(run ddp-train --help for the options)\n");
  exit(2);
}

/* "rank R: " in messages once data-parallel (set by main), "" otherwise. */
static char rank_tag[32];

static _Noreturn void die(const char *what, ddp_status s) {
  fprintf(stderr, "ddp-train: %serror: %s: %s\n", rank_tag, what,
          ddp_last_error()[0] ? ddp_last_error() : ddp_strerror(s));
  exit(1);
}

#define CHECK(expr, what)                \
  do {                                   \
    ddp_status s_ = (expr);              \
    if (s_ != DDP_OK) die(what, s_);     \
  } while (0)

static int64_t parse_int(const char *flag, const char *v, int64_t lo) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || *end || end == v || x < lo) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s expects an integer >= %lld, got '%%s'", flag, (long long)lo);
    die_usage(msg, v);
  }
  return x;
}

static double parse_double(const char *flag, const char *v) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || *end || end == v || !isfinite(x) || x < 0) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s expects a non-negative number, got '%%s'", flag);
    die_usage(msg, v);
  }
  return x;
}

static void parse_args(int argc, char **argv, train_args *a) {
  *a = (train_args){.model = "convnet", .epochs = 1, .batch_size = 100, .lr = NAN,
                    .optimizer = "sgd", .step_size = 1, .gamma = 0.1, .seed = 1,
                    .threads = 0, .workers = -1};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    if (!strcmp(f, "-h") || !strcmp(f, "--help")) {
      usage(stdout);
      exit(0);
    }
    if (!strcmp(f, "--json")) {
      a->json = true;
      continue;
    }
    if (!strcmp(f, "--sync-bn") || !strcmp(f, "--sync_bn")) {
      a->sync_bn = true;
      continue;
    }
    /* Every other option takes a value, as "--opt V" or "--opt=V". */
    static const char *const valued[] = {
        "--model", "--activation", "--data", "--samples", "--epochs", "--max-steps",
        "--batch-size", "--lr", "--optimizer", "--momentum", "--weight-decay", "--scheduler",
        "--step-size", "--gamma", "--seed", "--threads", "--workers", "--eval-every",
        "--patience", "--log", "--dump-state", "--save", "--save-every", "--resume", "--init"};
    char name[64];
    const char *eq = strchr(f, '=');
    size_t len = eq ? (size_t)(eq - f) : strlen(f);
    if (len >= sizeof name) die_usage("unknown option '%s'", f);
    memcpy(name, f, len);
    name[len] = '\0';
    /* Accept PyTorch-style underscores too: --batch_size. */
    for (char *p = name; *p; p++)
      if (*p == '_') *p = '-';
    bool known = false;
    for (size_t k = 0; k < sizeof valued / sizeof *valued; k++) known |= !strcmp(name, valued[k]);
    if (!known) die_usage("unknown option '%s'", f);
    const char *v;
    if (eq) {
      v = eq + 1;
    } else {
      if (i + 1 >= argc) die_usage("%s needs a value", f);
      v = argv[++i];
    }
    if (!strcmp(name, "--model")) a->model = v;
    else if (!strcmp(name, "--activation")) a->activation = v;
    else if (!strcmp(name, "--data")) a->data = v;
    else if (!strcmp(name, "--samples")) a->samples = parse_int(name, v, 1);
    else if (!strcmp(name, "--epochs")) a->epochs = parse_int(name, v, 0);
    else if (!strcmp(name, "--max-steps")) a->max_steps = parse_int(name, v, 0);
    else if (!strcmp(name, "--batch-size")) a->batch_size = parse_int(name, v, 1);
    else if (!strcmp(name, "--lr")) a->lr = parse_double(name, v);
    else if (!strcmp(name, "--optimizer")) a->optimizer = v;
    else if (!strcmp(name, "--momentum")) a->momentum = parse_double(name, v);
    else if (!strcmp(name, "--weight-decay")) a->weight_decay = parse_double(name, v);
    else if (!strcmp(name, "--scheduler")) a->scheduler = v;
    else if (!strcmp(name, "--step-size")) a->step_size = parse_int(name, v, 1);
    else if (!strcmp(name, "--gamma")) a->gamma = parse_double(name, v);
    else if (!strcmp(name, "--seed")) a->seed = (uint64_t)parse_int(name, v, 0);
    else if (!strcmp(name, "--threads")) a->threads = (int)parse_int(name, v, 1);
    else if (!strcmp(name, "--workers")) a->workers = (int)parse_int(name, v, 0);
    else if (!strcmp(name, "--eval-every")) a->eval_every = parse_int(name, v, 0);
    else if (!strcmp(name, "--patience")) a->patience = parse_int(name, v, 0);
    else if (!strcmp(name, "--log")) a->log_path = v;
    else if (!strcmp(name, "--dump-state")) a->dump_state = v;
    else if (!strcmp(name, "--save")) a->save_path = v;
    else if (!strcmp(name, "--save-every")) a->save_every = parse_int(name, v, 0);
    else if (!strcmp(name, "--resume")) a->resume_path = v;
    else if (!strcmp(name, "--init")) a->init_path = v;
    else die_usage("unknown option '%s'", f);
  }
  if (a->scheduler && strcmp(a->scheduler, "step") && strcmp(a->scheduler, "none"))
    die_usage("--scheduler expects 'step' (StepLR) or 'none', got '%s'", a->scheduler);
  if (a->scheduler && !strcmp(a->scheduler, "none")) a->scheduler = NULL;
  if (a->save_every && !a->save_path) die_usage("%s needs --save PATH", "--save-every");
  if (a->init_path && a->resume_path)
    die_usage("%s: --resume restores the model already; give one of --init and --resume",
              "--init");
}

/* ---- Data ------------------------------------------------------------------ */

static const char *default_data(const char *model) {
  if (!strcmp(model, "toy")) return "regression";
  if (!strcmp(model, "headtail")) return "toydata";
  return DEFAULT_DATA;
}

static void open_datasets(const train_args *a, ddp_dataset **train, ddp_dataset **test) {
  const char *data = a->data ? a->data : default_data(a->model);
  if (!strcmp(data, "toydata")) {
    CHECK(ddp_dataset_create_toydata(train, a->samples ? a->samples : (int64_t)1 << 20),
          "creating toydata");
    CHECK(ddp_dataset_create_toydata(test, 10000), "creating toydata's test set");
  } else if (!strcmp(data, "regression")) {
    CHECK(ddp_dataset_create_regression(train, a->samples ? a->samples : 1024, a->seed),
          "creating the regression data");
    CHECK(ddp_dataset_create_regression(test, 256, a->seed + 1000003),
          "creating the regression test data");
  } else {
    CHECK(ddp_dataset_open_idx_dir(train, data, DDP_SPLIT_TRAIN), "loading the training set");
    CHECK(ddp_dataset_open_idx_dir(test, data, DDP_SPLIT_TEST), "loading the test set");
  }
}

/* Checks that the data's samples fit the model, before the first forward. */
static void check_shapes(const ddp_model *model, const ddp_dataset *ds, const char *model_name) {
  const ddp_dataset_info *info = ddp_dataset_get_info(ds);
  int64_t shape[DDP_MAX_DIMS];
  int nd = ddp_model_sample_shape(model, shape);
  int64_t numel = 1;
  for (int i = 0; i < nd; i++) numel *= shape[i];
  bool classify = ddp_model_loss_kind(model) != DDP_LOSS_MSE;
  if (nd && numel != info->input_numel) {
    fprintf(stderr,
            "ddp-train: error: model %s takes samples of %lld values but %s has %lld; "
            "pick a matching --data (image models take 28x28 images)\n",
            model_name, (long long)numel, info->name, (long long)info->input_numel);
    exit(1);
  }
  if (classify != (info->target_dtype == DDP_INT64)) {
    fprintf(stderr, "ddp-train: error: model %s needs %s targets but %s has %s\n", model_name,
            classify ? "class-label" : "real-valued", info->name,
            info->target_dtype == DDP_INT64 ? "class labels" : "real-valued targets");
    exit(1);
  }
}

/* ---- Evaluation ------------------------------------------------------------ */

typedef struct eval_result {
  double loss;     /* mean over every test sample */
  double accuracy; /* fraction correct; NAN for regression */
} eval_result;

/* Every rank evaluates its part of the test set (the evaluation sampler: no
 * padding), then the sums are reduced once, so the result counts every test
 * sample exactly once and is the same on every rank. */
static eval_result evaluate(ddp_model *model, ddp_tape *tape, ddp_loader *loader,
                            const train_world *world) {
  eval_result r = {0, NAN};
  bool classify = ddp_model_loss_kind(model) != DDP_LOSS_MSE;
  double loss_sum = 0;
  int64_t correct = 0, seen = 0;
  ddp_model_train(model, false);
  ddp_tape_set_grad_enabled(tape, false);
  CHECK(ddp_loader_start_epoch(loader, 0), "starting evaluation");
  for (;;) {
    ddp_batch b;
    CHECK(ddp_loader_next(loader, &b), "loading a test batch");
    if (b.size == 0) break;
    ddp_tensor *out, *loss;
    ddp_tape_reset(tape);
    CHECK(ddp_model_forward(model, tape, &b.x, &out), "evaluating");
    CHECK(ddp_model_loss(model, tape, out, &b.y, &loss), "evaluating the loss");
    loss_sum += (double)ddp_tensor_f32(loss)[0] * (double)b.size;
    if (classify) {
      const float *o = ddp_tensor_f32(out);
      const int64_t *y = ddp_tensor_i64(&b.y);
      int64_t classes = out->shape[1];
      for (int64_t i = 0; i < b.size; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < classes; c++)
          if (o[i * classes + c] > o[i * classes + best]) best = c;
        correct += best == y[i];
      }
    }
    seen += b.size;
  }
  ddp_tape_reset(tape);
  ddp_tape_set_grad_enabled(tape, true);
  ddp_model_train(model, true);
  double sums[3] = {loss_sum, (double)correct, (double)seen}; /* exact in float64 */
  CHECK(train_world_sum(world, sums, 3), "reducing the test metrics over the ranks");
  r.loss = sums[2] > 0 ? sums[0] / sums[2] : NAN;
  if (classify && sums[2] > 0) r.accuracy = sums[1] / sums[2];
  return r;
}

/* ---- Output ---------------------------------------------------------------- */

/* JSON has no NaN: write null. */
static void json_number(FILE *f, const char *key, double v, bool comma) {
  if (isfinite(v))
    fprintf(f, "\"%s\": %.6g%s", key, v, comma ? ", " : "");
  else
    fprintf(f, "\"%s\": null%s", key, comma ? ", " : "");
}

/* Where one step's time went, in seconds (PyTorch's DDP logging reports the
 * same split: forward, backward compute, backward communication).
 * backward_comm is the time from the last bucket's launch (the last
 * gradient ready) to the end of finalize: the communication backward did not
 * hide, including the wait for the slowest rank. The rest of the step (the
 * loss's allreduce, bookkeeping) is step minus the parts. preempted is not a
 * part but a cause: the time in the step that this rank was ready to run and
 * another task held its CPU (ddp_preempt_clock; NAN without schedstat). It
 * lengthens whichever part it fell in, and at world > 1 every rank's step,
 * since the others wait for this one in the allreduce. */
typedef struct step_phases {
  double load, forward, backward_compute, backward_comm, optimizer, step, preempted;
} step_phases;

static void step_phases_add(step_phases *sum, const step_phases *p) {
  sum->load += p->load;
  sum->forward += p->forward;
  sum->backward_compute += p->backward_compute;
  sum->backward_comm += p->backward_comm;
  sum->optimizer += p->optimizer;
  sum->step += p->step;
  sum->preempted += p->preempted;
}

/* "load_ms": ..., one key per phase, in milliseconds (scaled by 1/n). */
static void step_phases_json(FILE *f, const step_phases *p, double n, bool comma) {
  json_number(f, "load_ms", 1e3 * p->load / n, true);
  json_number(f, "forward_ms", 1e3 * p->forward / n, true);
  json_number(f, "backward_compute_ms", 1e3 * p->backward_compute / n, true);
  json_number(f, "backward_comm_ms", 1e3 * p->backward_comm / n, true);
  json_number(f, "optimizer_ms", 1e3 * p->optimizer / n, true);
  json_number(f, "step_ms", 1e3 * p->step / n, true);
  json_number(f, "preempted_ms", 1e3 * p->preempted / n, comma);
}

typedef struct progress {
  bool quiet; /* ranks other than 0 */
  bool tty;
  double last_print;
  double started;
  int64_t total_steps;
} progress;

/* Training throughput so far (0 before any timed step). */
static double per_second(int64_t count, double seconds) {
  return seconds > 0 ? (double)count / seconds : 0;
}

static void format_eta(double seconds, char *buf, size_t n) {
  if (!isfinite(seconds) || seconds < 0) {
    snprintf(buf, n, "--:--");
    return;
  }
  long s = (long)(seconds + 0.5);
  if (s >= 3600)
    snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  else
    snprintf(buf, n, "%02ld:%02ld", s / 60, s % 60);
}

static void show_progress(progress *p, int64_t step, int64_t epoch, int64_t epochs, double loss,
                          double rate, double train_seconds, bool force) {
  if (p->quiet) return;
  double now = ddp_time_s();
  double interval = p->tty ? 0.2 : 5.0;
  if (!force && now - p->last_print < interval) return;
  p->last_print = now;
  double steps_per_s = per_second(step, train_seconds);
  char eta[32];
  format_eta(steps_per_s > 0 ? (double)(p->total_steps - step) / steps_per_s : NAN, eta,
             sizeof eta);
  double frac = p->total_steps ? (double)step / (double)p->total_steps : 0;
  if (p->tty) {
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = '\0';
    fprintf(stderr, "\r[%s] %3.0f%% epoch %lld/%lld step %lld loss %.4f %.0f samples/s ETA %s ",
            bar, frac * 100, (long long)epoch + 1, (long long)epochs, (long long)step, loss, rate,
            eta);
  } else {
    fprintf(stderr, "epoch %lld/%lld step %lld/%lld (%.0f%%) loss %.4f %.0f samples/s ETA %s\n",
            (long long)epoch + 1, (long long)epochs, (long long)step, (long long)p->total_steps,
            frac * 100, loss, rate, eta);
  }
  fflush(stderr);
}

static void end_progress_line(progress *p) {
  if (p->tty && !p->quiet) fputc('\n', stderr);
}

/* Early stopping: --patience K evaluations in a row without a better test loss. */
typedef struct patience {
  int64_t limit; /* 0 = never stop */
  int64_t without_better;
  double best_loss;
} patience;

/* Logs an evaluation and returns true when patience has run out. */
static bool record_eval(patience *p, FILE *log, eval_result r, int64_t step, int64_t epoch) {
  if (log) {
    fprintf(log, "{\"step\": %lld, \"epoch\": %lld, ", (long long)step, (long long)epoch);
    json_number(log, "test_loss", r.loss, true);
    json_number(log, "test_accuracy", r.accuracy, false);
    fputs("}\n", log);
  }
  if (r.loss < p->best_loss) {
    p->best_loss = r.loss;
    p->without_better = 0;
    return false;
  }
  return p->limit && ++p->without_better >= p->limit;
}

/* ---- Training -------------------------------------------------------------- */

static ddp_optim_kind optimizer_kind(const char *name) {
  if (!strcmp(name, "sgd")) return DDP_OPTIM_SGD;
  if (!strcmp(name, "adam")) return DDP_OPTIM_ADAM;
  if (!strcmp(name, "adadelta")) return DDP_OPTIM_ADADELTA;
  die_usage("--optimizer expects sgd, adam or adadelta, got '%s'", name);
}

/* Writes every state-dict tensor as a line "name numel v0 v1 ..." (%.9g:
 * float32 round-trips) to a temporary name, then renames it. With "{rank}" in
 * `pattern` every rank writes its own file, otherwise rank 0 only. */
static void dump_state(const ddp_model *model, const char *pattern, int rank) {
  const char *mark = strstr(pattern, "{rank}");
  if (!mark && rank != 0) return;
  char path[4096], tmp[4200];
  if (mark)
    snprintf(path, sizeof path, "%.*s%d%s", (int)(mark - pattern), pattern, rank, mark + 6);
  else
    snprintf(path, sizeof path, "%s", pattern);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) {
    fprintf(stderr, "ddp-train: %serror: cannot write %s: %s\n", rank_tag, tmp, strerror(errno));
    exit(1);
  }
  for (int i = 0; i < ddp_model_state_count(model); i++) {
    ddp_state_entry e;
    CHECK(ddp_model_state_entry(model, i, &e), "listing the state dict");
    fprintf(f, "%s %lld", e.name, (long long)e.numel);
    for (int64_t k = 0; k < e.numel; k++) {
      if (e.dtype == DDP_INT64) fprintf(f, " %lld", (long long)((const int64_t *)e.data)[k]);
      else fprintf(f, " %.9g", (double)((const float *)e.data)[k]);
    }
    fputc('\n', f);
  }
  if (fflush(f) != 0 || fsync(fileno(f)) != 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
    fprintf(stderr, "ddp-train: %serror: writing %s: %s\n", rank_tag, path, strerror(errno));
    exit(1);
  }
}

/* ---- Checkpoints ----------------------------------------------------------- */

/* The options a resumed run must share with the saved one (everything that
 * decides the model, the data order or the update), recorded as metadata in
 * both checkpoint files and compared by ddp_checkpoint_load. --epochs,
 * --max-steps, evaluation, logging and thread counts may change. */
typedef struct run_meta {
  char values[16][64];
  ddp_kv kv[16];
  size_t n;
} run_meta;

static void meta_add(run_meta *m, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void meta_add(run_meta *m, const char *key, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m->values[m->n], sizeof m->values[m->n], fmt, ap);
  va_end(ap);
  m->kv[m->n] = (ddp_kv){key, m->values[m->n]};
  m->n++;
}

static void run_meta_init(run_meta *m, const train_args *a, const ddp_optim_options *oo) {
  m->n = 0;
  meta_add(m, "ddp-train.model", "%s", a->model);
  meta_add(m, "ddp-train.activation", "%s", a->activation ? a->activation : "");
  meta_add(m, "ddp-train.data", "%s", a->data ? a->data : default_data(a->model));
  meta_add(m, "ddp-train.samples", "%lld", (long long)a->samples);
  meta_add(m, "ddp-train.batch_size", "%lld", (long long)a->batch_size);
  meta_add(m, "ddp-train.seed", "%llu", (unsigned long long)a->seed);
  meta_add(m, "ddp-train.optimizer", "%s", a->optimizer);
  meta_add(m, "ddp-train.lr", "%.17g", oo->lr);
  meta_add(m, "ddp-train.momentum", "%.17g", a->momentum);
  meta_add(m, "ddp-train.weight_decay", "%.17g", a->weight_decay);
  meta_add(m, "ddp-train.scheduler", "%s", a->scheduler ? a->scheduler : "none");
  meta_add(m, "ddp-train.step_size", "%lld", (long long)a->step_size);
  meta_add(m, "ddp-train.gamma", "%.17g", a->gamma);
  meta_add(m, "ddp-train.sync_bn", "%d", (int)a->sync_bn);
}

/* Rank 0 writes the checkpoint; every rank waits at a barrier until it is
 * on disk, so none can go on (exit, or load it) before. */
static void save_checkpoint(const train_args *a, const run_meta *meta, const train_world *world,
                            ddp_model *model, ddp_optimizer *opt, ddp_scheduler *sched,
                            int64_t step, int64_t epoch, int64_t epoch_batches,
                            const patience *pat) {
  ddp_train_state ts = {.step = step, .epoch = epoch, .epoch_batches = epoch_batches,
                        .sampler_seed = a->seed, .world_size = world->size,
                        .best_test_loss = pat->best_loss,
                        .evals_without_better = pat->without_better};
  if (world->rank == 0)
    CHECK(ddp_checkpoint_save(a->save_path, model, opt, sched, &ts, meta->kv, meta->n),
          "saving the checkpoint");
  if (world->pg) CHECK(ddp_barrier(world->pg), "waiting for rank 0 to save the checkpoint");
}

/* Loads --resume into model, opt and sched (every rank reads the files) and
 * returns where training continues. A checkpoint taken mid-epoch by another
 * number of ranks is refused: the epoch's order depends on the world size. */
static ddp_train_state resume(const train_args *a, const run_meta *meta, const train_world *world,
                              ddp_model *model, ddp_optimizer *opt, ddp_scheduler *sched,
                              int64_t per_epoch) {
  ddp_train_state start = {.world_size = world->size, .best_test_loss = INFINITY};
  if (!a->resume_path) return start;
  CHECK(ddp_checkpoint_load(a->resume_path, model, opt, sched, &start, meta->kv, meta->n),
        "resuming");
  if (start.world_size != world->size && start.epoch_batches > 0) {
    fprintf(stderr, "ddp-train: %serror: %s was saved by %lld ranks in the middle of epoch %lld; "
                    "this run has %d ranks, which split that epoch differently (resume with "
                    "%lld ranks, or from a checkpoint taken at the end of an epoch)\n",
            rank_tag, a->resume_path, (long long)start.world_size, (long long)start.epoch + 1,
            world->size, (long long)start.world_size);
    exit(1);
  }
  if (world->rank == 0)
    fprintf(stderr, "resuming %s at step %lld (epoch %lld, batch %lld of %lld)\n",
            a->resume_path, (long long)start.step, (long long)start.epoch + 1,
            (long long)start.epoch_batches, (long long)per_epoch);
  return start;
}

int main(int argc, char **argv) {
  train_args a;
  parse_args(argc, argv, &a);
  if (a.threads == 0) { /* PyTorch's intra-op threads follow OMP_NUM_THREADS too */
    int64_t omp = 1;
    if (ddp_env_int("OMP_NUM_THREADS", 1, &omp) != DDP_OK || omp < 1) {
      fprintf(stderr, "ddp-train: error: OMP_NUM_THREADS='%s' is not a positive integer; "
                      "unset it or pass --threads N\n", getenv("OMP_NUM_THREADS"));
      exit(2);
    }
    a.threads = (int)omp;
  }
  openblas_set_num_threads(a.threads);

  /* Data parallel when a launcher says so (tools/train/world.c). */
  train_world world;
  CHECK(train_world_init(&world), "starting data-parallel training");
  if (world.pg) snprintf(rank_tag, sizeof rank_tag, "rank %d: ", world.rank);
  bool lead = world.rank == 0; /* prints progress, the log and the summary */
  /* Loader threads only where cores are left over: with as many ranks on
   * this host as cores, a loader thread per rank would steal compute. */
  if (a.workers < 0) a.workers = 2 * world.local_size <= train_world_cpus() ? 1 : 0;

  ddp_model *model;
  CHECK(ddp_model_build(a.model, a.activation, a.seed, &model), "building the model");
  if (a.init_path) CHECK(ddp_model_load(model, a.init_path), "loading --init");
  ddp_dataset *train_ds, *test_ds;
  open_datasets(&a, &train_ds, &test_ds);
  check_shapes(model, train_ds, a.model);
  /* SyncBatchNorm needs a group; with one process it is BatchNorm itself. */
  if (a.sync_bn && world.pg)
    CHECK(ddp_model_convert_sync_batchnorm(model, world.pg), "converting to SyncBatchNorm");

  ddp_optim_kind kind = optimizer_kind(a.optimizer);
  ddp_optim_options oo = ddp_optim_defaults(kind);
  if (!isnan(a.lr)) oo.lr = a.lr;
  else if (kind == DDP_OPTIM_SGD) oo.lr = 0.01;
  oo.weight_decay = a.weight_decay;
  if (kind == DDP_OPTIM_SGD) oo.sgd.momentum = a.momentum;
  else if (a.momentum != 0)
    die_usage("--momentum applies to sgd only (got --optimizer %s)", a.optimizer);
  ddp_optimizer *opt;
  CHECK(ddp_optimizer_create(&opt, &oo, ddp_model_params_flat(model), ddp_model_grads_flat(model),
                             (size_t)ddp_model_num_param_elements(model)),
        "creating the optimizer");
  ddp_scheduler *sched = NULL;
  if (a.scheduler) {
    ddp_step_lr_options so = {0};
    so.step_size = a.step_size;
    so.gamma = a.gamma;
    so.last_epoch = -1;
    CHECK(ddp_scheduler_create_step_lr(&sched, opt, &so), "creating StepLR");
  }
  /* The DDP wrapper: rank 0's parameters everywhere, gradients averaged. */
  ddp_dp *dp = NULL;
  if (world.pg) {
    ddp_dp_options dpo = ddp_dp_defaults();
    CHECK(ddp_dp_create(&dp, model, world.pg, &dpo), "wrapping the model for data parallelism");
    ddp_dp_set_optimizer(dp, opt);
  }

  /* PyTorch's DistributedSampler: each epoch is torch.randperm(N) from a
   * generator seeded with --seed + epoch, padded to a multiple of the world
   * size (drop_last false) and dealt out to the ranks in turn; the test set
   * is dealt out without padding. */
  ddp_distributed_sampler_options so = ddp_distributed_sampler_defaults(world.size, world.rank);
  so.seed = a.seed;
  ddp_sampler *train_sampler;
  CHECK(ddp_sampler_create_distributed(&train_sampler, ddp_dataset_size(train_ds), &so),
        "creating the sampler");
  ddp_loader_config lc = ddp_loader_config_default();
  lc.batch_size = a.batch_size;
  lc.sampler = train_sampler;
  lc.num_workers = a.workers;
  ddp_loader *train_loader, *test_loader;
  CHECK(ddp_loader_create(&train_loader, train_ds, &lc), "creating the training loader");
  ddp_sampler *test_sampler;
  CHECK(ddp_sampler_create_distributed_eval(&test_sampler, ddp_dataset_size(test_ds), world.size,
                                            world.rank),
        "creating the test sampler");
  ddp_loader_config tc = ddp_loader_config_default();
  tc.batch_size = a.batch_size > 1000 ? a.batch_size : 1000;
  tc.num_workers = a.workers;
  tc.sampler = test_sampler;
  CHECK(ddp_loader_create(&test_loader, test_ds, &tc), "creating the test loader");

  ddp_tape *tape;
  CHECK(ddp_tape_create(&tape, 16 << 20), "creating the tape");

  FILE *log = NULL;
  if (a.log_path && lead) {
    log = fopen(a.log_path, "w");
    if (!log) {
      fprintf(stderr, "ddp-train: error: cannot write the log %s: %s\n", a.log_path,
              strerror(errno));
      exit(1);
    }
    setvbuf(log, NULL, _IOLBF, 0); /* one line at a time, so a reader can follow it */
  }

  int64_t per_epoch = ddp_loader_num_batches(train_loader);
  progress prog = {.quiet = !lead, .tty = isatty(STDERR_FILENO), .started = ddp_time_s()};
  prog.total_steps = a.epochs * per_epoch;
  if (a.max_steps && a.max_steps < prog.total_steps) prog.total_steps = a.max_steps;

  run_meta meta;
  run_meta_init(&meta, &a, &oo);
  /* Where training starts: the beginning, or where the checkpoint stopped. */
  ddp_train_state start = resume(&a, &meta, &world, model, opt, sched, per_epoch);
  int64_t step = start.step, samples = 0, epochs_done = start.epoch;
  /* The position a checkpoint records: the epoch in progress and the batches
   * of it consumed; (next epoch, 0) once an epoch's end is processed. */
  int64_t pos_epoch = start.epoch, pos_batches = start.epoch_batches;
  double train_seconds = 0;
  /* The same rate without this process's first WARMUP_STEPS steps (first
   * touch of the activations, the one-time bucket relayout): what PyTorch's
   * reference script times, after its 10 warm-up steps. */
  double steady_seconds = 0;
  int64_t steady_samples = 0, steps_here = 0;
  step_phases steady_phases = {0};
  ddp_preempt_clock preempt_clock;
  ddp_preempt_clock_open(&preempt_clock);
  double epoch_loss_sum = 0, all_loss_sum = 0;
  int64_t epoch_steps = 0;   /* batches of this epoch consumed (also before a resume) */
  int64_t epoch_losses = 0;  /* of those, steps run by this process */
  /* Early stopping goes on from where a resumed run left it. */
  patience pat = {.limit = a.patience,
                  .best_loss = start.best_test_loss,
                  .without_better = start.evals_without_better};
  eval_result last_eval = {NAN, NAN};
  bool evaluated_now = false, stop = false;
  float loss_value = NAN;

  for (int64_t epoch = start.epoch; epoch < a.epochs && !stop; epoch++) {
    CHECK(ddp_loader_start_epoch(train_loader, epoch), "starting an epoch");
    epoch_loss_sum = 0;
    epoch_steps = 0;
    epoch_losses = 0;
    /* Resuming in the middle of an epoch: the same order (seed + epoch), less
     * the batches the saved run already consumed. */
    for (int64_t k = 0; epoch == start.epoch && k < start.epoch_batches; k++) {
      ddp_batch b;
      CHECK(ddp_loader_next(train_loader, &b), "skipping to the resumed batch");
      if (b.size == 0) break;
      epoch_steps++;
    }
    for (;;) {
      if (a.max_steps && step >= a.max_steps) {
        stop = true;
        break;
      }
      double t0 = ddp_time_s();
      int64_t preempted0 = ddp_preempt_clock_ns(&preempt_clock);
      ddp_batch b;
      CHECK(ddp_loader_next(train_loader, &b), "loading a batch");
      if (b.size == 0) break;
      double t_loaded = ddp_time_s();
      ddp_tensor *out, *loss;
      ddp_tape_reset(tape);
      ddp_model_zero_grad(model);
      if (dp) CHECK(ddp_dp_forward(dp, tape, &b.x, &out), "forward");
      else CHECK(ddp_model_forward(model, tape, &b.x, &out), "forward");
      CHECK(ddp_model_loss(model, tape, out, &b.y, &loss), "loss");
      double loss_sums[2] = {(double)ddp_tensor_f32(loss)[0] * (double)b.size, (double)b.size};
      double t_forward = ddp_time_s();
      if (dp) CHECK(ddp_dp_backward(dp, tape, loss), "backward");
      else CHECK(ddp_backward(tape, loss), "backward");
      double t_backward = ddp_time_s();
      CHECK(ddp_optimizer_step(opt), "optimizer step");
      step_phases phases = {.load = t_loaded - t0,
                            .forward = t_forward - t_loaded,
                            .backward_compute = t_backward - t_forward,
                            .optimizer = ddp_time_s() - t_backward};
      if (dp) {
        ddp_dp_trace tr;
        ddp_dp_get_trace(dp, &tr);
        if (tr.n_buckets > 0) {
          /* Same clock as ddp_time_s (ddp_time_ns, monotonic). */
          double last_launch = 1e-9 * (double)tr.buckets[tr.n_buckets - 1].launch_ns;
          double comm = 1e-9 * (double)tr.finalize_end_ns - last_launch;
          if (comm >= 0 && comm <= phases.backward_compute) {
            phases.backward_comm = comm;
            phases.backward_compute -= comm;
          }
        }
      }
      /* The loss of the global batch, reduced on this thread after the step:
       * the ranks have just met in the gradients' allreduce, so it waits for
       * no one, whereas an async reduction during backward handed to the
       * progress thread cost 2-3% of a world-2 step (BENCHMARKS.md). */
      CHECK(train_world_sum(&world, loss_sums, 2), "reducing the loss");
      double step_seconds = ddp_time_s() - t0;
      int64_t preempted1 = ddp_preempt_clock_ns(&preempt_clock);
      phases.step = step_seconds;
      phases.preempted =
          preempted0 >= 0 && preempted1 >= 0 ? 1e-9 * (double)(preempted1 - preempted0) : NAN;
      train_seconds += step_seconds;
      loss_value = (float)(loss_sums[0] / loss_sums[1]);
      if (!isfinite(loss_value)) { /* the same value on every rank: all stop here */
        if (lead)
          fprintf(stderr, "\nddp-train: error: the loss became %f at step %lld (epoch %lld); "
                          "try a smaller --lr\n", loss_value, (long long)step + 1,
                  (long long)epoch + 1);
        exit(1);
      }
      step++;
      samples += (int64_t)loss_sums[1]; /* every rank's samples */
      if (++steps_here > WARMUP_STEPS) {
        steady_seconds += step_seconds;
        steady_samples += (int64_t)loss_sums[1];
        step_phases_add(&steady_phases, &phases);
      }
      epoch_steps++;
      epoch_losses++;
      pos_epoch = epoch;
      pos_batches = epoch_steps;
      epoch_loss_sum += loss_value;
      all_loss_sum += loss_value;
      double rate = per_second(samples, train_seconds);
      if (log) {
        fprintf(log, "{\"step\": %lld, \"epoch\": %lld, ", (long long)step, (long long)epoch);
        json_number(log, "loss", loss_value, true);
        json_number(log, "lr", ddp_optimizer_get_lr(opt), true);
        json_number(log, "samples_per_s", rate, true);
        step_phases_json(log, &phases, 1, false);
        fputs("}\n", log);
      }
      show_progress(&prog, step, epoch, a.epochs, loss_value, rate, train_seconds, false);
      evaluated_now = false;
      if (a.eval_every && step % a.eval_every == 0) {
        last_eval = evaluate(model, tape, test_loader, &world);
        evaluated_now = true;
        if (record_eval(&pat, log, last_eval, step, epoch)) {
          stop = true;
          break;
        }
      }
      /* After this step's evaluation, which a resumed run does not repeat:
       * the checkpoint's early-stopping position counts it. (Evaluation
       * changes nothing else that is saved.) */
      if (a.save_every && step % a.save_every == 0)
        save_checkpoint(&a, &meta, &world, model, opt, sched, step, epoch, epoch_steps, &pat);
    }
    if (epoch_steps == per_epoch) {
      epochs_done++;
      if (sched) CHECK(ddp_scheduler_step(sched), "StepLR");
      pos_epoch = epoch + 1;
      pos_batches = 0;
    }
    /* --eval-every 0: evaluate at the end of each epoch (and of training),
     * also when this run resumed exactly there (from a --save-every
     * checkpoint of the epoch's last step, taken before this evaluation),
     * as the run that saved it went on to do. */
    const bool epoch_end = epoch_steps == per_epoch && per_epoch > 0;
    if (!a.eval_every && !evaluated_now && (epoch_losses > 0 || epoch_end)) {
      last_eval = evaluate(model, tape, test_loader, &world);
      evaluated_now = true;
      show_progress(&prog, step, epoch, a.epochs, loss_value,
                    per_second(samples, train_seconds), train_seconds, true);
      end_progress_line(&prog);
      if (lead) {
        fprintf(stderr, "epoch %lld: test loss %.4f", (long long)epoch + 1, last_eval.loss);
        if (!isnan(last_eval.accuracy))
          fprintf(stderr, ", test accuracy %.2f%%", 100 * last_eval.accuracy);
        fputc('\n', stderr);
      }
      /* Stopped mid-epoch (--max-steps): this evaluation is the end of
       * training's, which a run going on would not make here, so the
       * checkpoint's early-stopping position leaves it out. */
      patience after_stop = pat;
      if (record_eval(epoch_end ? &pat : &after_stop, log, last_eval, step, epoch))
        stop = true;
    }
  }
  /* The end of training is always evaluated. */
  if (a.save_path)
    save_checkpoint(&a, &meta, &world, model, opt, sched, step, pos_epoch, pos_batches, &pat);
  int64_t steps_run = step - start.step;
  if (!evaluated_now && (step > 0 || a.epochs == 0)) {
    last_eval = evaluate(model, tape, test_loader, &world);
    record_eval(&pat, log, last_eval, step, epochs_done);
  }
  end_progress_line(&prog);
  ddp_preempt_clock_close(&preempt_clock);
  /* Every rank's mean preempted time over its steady steps, for --json:
   * in a synchronous step one rank's preemption stalls them all. */
  double steady_steps = steps_here > WARMUP_STEPS ? (double)(steps_here - WARMUP_STEPS) : 0;
  double *preempted_per_rank = NULL;
  if (a.json) {
    preempted_per_rank = calloc((size_t)world.size, sizeof *preempted_per_rank);
    if (!preempted_per_rank) {
      fprintf(stderr, "ddp-train: error: out of memory for %d ranks' figures\n", world.size);
      exit(1);
    }
    preempted_per_rank[world.rank] =
        steady_steps > 0 ? 1e3 * steady_phases.preempted / steady_steps : NAN;
    CHECK(train_world_sum(&world, preempted_per_rank, world.size),
          "gathering the ranks' preempted time");
  }

  double rate = per_second(samples, train_seconds);
  /* Mean over the last epoch's steps, or over all steps when fewer than an epoch ran. */
  double train_loss = steps_run == 0          ? NAN
                      : steps_run < per_epoch ? all_loss_sum / (double)steps_run
                      : epoch_losses          ? epoch_loss_sum / (double)epoch_losses
                                              : NAN;
  double epochs_fraction = per_epoch ? (double)step / (double)per_epoch : 0;
  if (lead) {
    fprintf(stderr, "trained %lld steps (%.2f epochs) at %.0f samples/s", (long long)step,
            epochs_fraction, rate);
    if (world.size > 1) fprintf(stderr, " on %d ranks", world.size);
    fprintf(stderr, "; test loss %.4f", last_eval.loss);
    if (!isnan(last_eval.accuracy))
      fprintf(stderr, ", test accuracy %.2f%%", 100 * last_eval.accuracy);
    fputc('\n', stderr);
  }
  if (a.json && lead) {
    printf("{");
    json_number(stdout, "samples_per_s", rate, true);
    json_number(stdout, "steady_samples_per_s",
                steady_samples ? per_second(steady_samples, steady_seconds) : NAN, true);
    json_number(stdout, "train_loss", train_loss, true);
    json_number(stdout, "test_loss", last_eval.loss, true);
    json_number(stdout, "test_accuracy", last_eval.accuracy, true);
    printf("\"steps\": %lld, ", (long long)step);
    /* Rank 0's mean step, over the steps steady_samples_per_s counts. */
    printf("\"steady_step_phases\": {");
    step_phases_json(stdout, &steady_phases, steady_steps, false);
    printf("}, ");
    printf("\"steady_preempted_ms_per_rank\": [");
    for (int r = 0; r < world.size; r++) {
      if (isfinite(preempted_per_rank[r])) printf("%s%.6g", r ? ", " : "", preempted_per_rank[r]);
      else printf("%snull", r ? ", " : "");
    }
    printf("], ");
    json_number(stdout, "epochs", epochs_fraction, true);
    printf("\"world_size\": %d, \"model\": \"%s\", \"optimizer\": \"%s\"}\n", world.size, a.model,
           a.optimizer);
  }
  if (log && fclose(log) != 0) {
    fprintf(stderr, "ddp-train: error: writing the log %s: %s\n", a.log_path, strerror(errno));
    exit(1);
  }

  if (a.dump_state) dump_state(model, a.dump_state, world.rank);
  free(preempted_per_rank);

  ddp_dp_destroy(dp);
  ddp_tape_destroy(tape);
  ddp_loader_destroy(test_loader);
  ddp_loader_destroy(train_loader);
  ddp_sampler_destroy(test_sampler);
  ddp_sampler_destroy(train_sampler);
  ddp_scheduler_destroy(sched);
  ddp_optimizer_destroy(opt);
  ddp_dataset_destroy(test_ds);
  ddp_dataset_destroy(train_ds);
  ddp_model_destroy(model);
  train_world_destroy(&world);
  return 0;
}
