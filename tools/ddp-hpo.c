/* ddp-hpo: hyperparameter search from the command line (include/ddp/hpo.h,
 * docs/hpo.md): Propulate's evolutionary algorithm over a search space, on
 * one of Propulate's benchmark functions or on seed 002's job (a
 * convnet-N trained per individual by the trainer). Started by a launcher
 * it searches with every rank: workers of --ranks-per-worker ranks on one
 * island (islands and checkpoints come with issue 22's rest). Tools are the
 * only code that calls exit(). */
#include <cblas.h>
#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "ddp/ddp.h"
#include "ddp_hpo/cmd_objective.h"
#include "io/io_internal.h"

#define DEFAULT_DATA "/usr/share/datasets/fashion-mnist"
#define CONVNET_SPACE \
  "conv_layers=int:2:10,activation=cat:relu|sigmoid|tanh,lr=logfloat:0.0001:0.01,gamma=float:0.5:0.999"

static void usage(FILE *f) {
  fprintf(f,
"usage: ddp-hpo [options]          (or under ddprun / srun / mpirun: every rank searches)\n"
"\n"
"Searches hyperparameters with Propulate's evolutionary algorithm.\n"
"\n"
"Objective\n"
"  --objective NAME     a benchmark function: sphere | rosenbrock | step | quartic |\n"
"                       rastrigin | griewank | schwefel | bisphere | birastrigin (Propulate's,\n"
"                       with its space), or convnet: seed 002's job, a convnet-N trained per\n"
"                       individual on Fashion-MNIST with Adadelta and StepLR, its loss the best\n"
"                       test loss (default sphere); or cmd:PROGRAM [ARGS]: PROGRAM run per\n"
"                       evaluation with the hyperparameters as --name value arguments (and\n"
"                       DDP_HPO_NAME variables), its loss the last line it prints (a number or\n"
"                       JSON with a \"loss\" field); a worker of several ranks runs it on each\n"
"                       rank as one torchrun/ddprun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT,\n"
"                       DDP_STORE_ADDR with a prefix of its own); failures count as inf\n"
"  --loss-key KEY       cmd:'s JSON field holding the loss (default loss; ddp-train --json:\n"
"                       test_loss)\n"
"  --eval-timeout S     kill a cmd: evaluation after S seconds, every rank's (default 3600)\n"
"  --space SPEC         name=int:LO:HI,name=float:LO:HI,name=logfloat:LO:HI,name=cat:A|B|C\n"
"                       (default: the objective's own; convnet: " CONVNET_SPACE ")\n"
"convnet's training\n"
"  --device D           cpu (default), cuda (each rank on cuda:(LOCAL_RANK %% GPUs), a\n"
"                       worker's ranks on their own GPUs, its threads on the CPUs near it)\n"
"                       or cuda:N; convnet only\n"
"  --data DIR           MNIST-format IDX files (default " DEFAULT_DATA ")\n"
"  --epochs N           at most N epochs per individual (default 20)\n"
"  --patience K         stop an individual after K evaluations without a better loss (5)\n"
"  --batch-size N       (default 8, as seed 002)\n"
"  --max-steps N        at most N steps per individual (default 0: no limit)\n"
"  --train-samples N    train on the first N training images (default 0: all 60,000)\n"
"  --val-samples N      evaluate on the first N test images (default 0: all 10,000)\n"
"  --eval-batch-size N  the test set's batch (default 100, as seed 002's validation loader)\n"
"  --trace DIR          each evaluation's timeline (steps and their phases, allreduces,\n"
"                       evaluations) as Chrome trace JSON, DIR/w<W>-g<G>-r<R>.json (worker,\n"
"                       generation, the rank in the worker)\n"
"Search (Propulate's defaults)\n"
"  --generations N      evaluations (default 100)\n"
"  --pop-size N         breeding population (default 4)\n"
"  --crossover-prob X   a trait comes from the second parent when a draw exceeds X (0.7)\n"
"  --mutation-prob X    point mutation (0.4)\n"
"  --random-init-prob X a fresh random individual instead (0.1)\n"
"  --sigma-factor X     interval mutation's sigma over the interval (0.05)\n"
"  --seed N             worker w's generator is CPython's random.Random(N + the world rank\n"
"                       of its first rank): --seed 0 reproduces Propulate's tutorials (0)\n"
"Workers (under a launcher)\n"
"  --ranks-per-worker R consecutive ranks train each individual together, data-parallel\n"
"                       (convnet); the world's size must be a multiple of R (default 1)\n"
"  --exchange-interval S  a worker sends and takes in individuals at most every S seconds\n"
"                       (default 0.001: every generation unless evaluations are cheaper)\n"
"  --islands I          the workers split into I islands (contiguous, as even as possible; 1)\n"
"  --migration-prob X   each generation a worker sends emigrants to every other island with\n"
"                       probability X / its island's size (default 0.9)\n"
"  --num-migrants N     emigrants per island per emigration (default 1)\n"
"  --pollination        copies of the best go, each arrival replacing its worker's worst\n"
"                       (default, as Propulate's)\n"
"  --real-migration     the worker's own best go and are deactivated at home\n"
"Checkpoints\n"
"  --checkpoint DIR     each worker journals what enters its population in DIR, committed\n"
"                       (fsync'd, with its generator) at most every --checkpoint-interval\n"
"                       seconds (default 1) and at the end; DIR/search.meta holds the options\n"
"  --resume             continue the search in DIR (start one if DIR holds none); without it\n"
"                       a DIR holding a search is refused. Under ddprun --max-restarts N a\n"
"                       search whose rank died continues by itself\n"
"  --eval-delay-ms N    sleep N ms in every evaluation (to watch a search, or kill one)\n"
"Output\n"
"  --top-n K            the summary lists the K best individuals (default 3)\n"
"  --log FILE           one JSON object per evaluation: generation, the hyperparameters,\n"
"                       loss, start and end time (s), evaluation time\n"
"  --json               end stdout with one JSON summary line\n"
"  --backend B          the process groups' engine: ddp (default), mpi (under `mpirun` or\n"
"                       `srun --mpi=pmix`: seed 002's nccl-openmpi without GPUs) or nccl\n"
"  -h, --help           this text\n"
"  --version            print \"ddp-hpo (ddp) VERSION\"\n"
"\n"
"Rank 0 prints the summary (the island's top n), writes the log and the JSON line.\n"
"Example:\n"
"  ddp-hpo --objective rastrigin --generations 2000 --pop-size 8 --json\n"
"  ddprun --nproc-per-node 4 ddp-hpo --objective convnet --ranks-per-worker 2 \\\n"
"      --generations 8 --epochs 2 --top-n 3\n");
}

static _Noreturn void die(const char *what, ddp_status s) {
  fprintf(stderr, "ddp-hpo: error: %s: %s\n", what,
          ddp_last_error()[0] ? ddp_last_error() : ddp_strerror(s));
  exit(1);
}

#define CHECK(expr, what)            \
  do {                               \
    ddp_status s_ = (expr);          \
    if (s_ != DDP_OK) die(what, s_); \
  } while (0)

typedef struct args {
  const char *objective, *space, *data, *log_path;
  int64_t epochs, patience, batch_size, max_steps, top_n, eval_delay_ms;
  int64_t train_samples, val_samples; /* 0: all */
  int64_t eval_batch_size;
  const char *trace_dir;              /* convnet: a timeline per evaluation */
  const char *device;                 /* convnet: "cpu", "cuda", "cuda:N" */
  const char *loss_key;               /* cmd:'s JSON field */
  double eval_timeout_s;              /* cmd: */
  ddp_hpo_options o;
  bool json;
} args;

static double parse_prob(const char *flag, const char *v) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || *end || end == v || !(x >= 0 && x <= 1)) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s expects a number in [0, 1], got '%%s'", flag);
    cli_die_usage(msg, v);
  }
  return x;
}

static void parse_args(int argc, char **argv, args *a) {
  *a = (args){.objective = "sphere", .data = DEFAULT_DATA, .epochs = 20, .patience = 5,
              .batch_size = 8, .eval_batch_size = 100, .top_n = 3, .o = ddp_hpo_defaults(), .loss_key = "loss",
              .eval_timeout_s = 3600, .device = "cpu"};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    cli_help_or_version(f, usage);
    if (!strcmp(f, "--json")) {
      a->json = true;
      continue;
    }
    if (!strcmp(f, "--resume")) {
      a->o.resume = true;
      continue;
    }
    if (!strcmp(f, "--pollination") || !strcmp(f, "--real-migration")) {
      a->o.pollination = f[2] == 'p';
      continue;
    }
    static const char *const valued[] = {
        "--objective", "--space", "--data", "--epochs", "--patience", "--batch-size",
        "--max-steps", "--generations", "--pop-size", "--crossover-prob", "--mutation-prob",
        "--random-init-prob", "--sigma-factor", "--seed", "--top-n", "--log",
        "--ranks-per-worker", "--exchange-interval", "--islands", "--migration-prob",
        "--num-migrants", "--checkpoint", "--checkpoint-interval", "--eval-delay-ms",
        "--train-samples", "--val-samples", "--loss-key", "--eval-timeout", "--eval-batch-size",
        "--trace", "--backend", "--device"};
    char name[64];
    const char *eq;
    cli_valued_option(f, valued, sizeof valued / sizeof *valued, name, sizeof name, &eq);
    const char *v = cli_option_value(argc, argv, &i, eq);
    if (!strcmp(name, "--objective")) a->objective = v;
    else if (!strcmp(name, "--space")) a->space = v;
    else if (!strcmp(name, "--data")) a->data = v;
    else if (!strcmp(name, "--epochs")) a->epochs = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--patience")) a->patience = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--batch-size")) a->batch_size = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--max-steps")) a->max_steps = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--generations")) a->o.generations = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--pop-size")) a->o.pop_size = (int)cli_parse_int(name, v, 2, INT64_MAX);
    else if (!strcmp(name, "--crossover-prob")) a->o.crossover_prob = parse_prob(name, v);
    else if (!strcmp(name, "--mutation-prob")) a->o.mutation_prob = parse_prob(name, v);
    else if (!strcmp(name, "--random-init-prob")) a->o.random_init_prob = parse_prob(name, v);
    else if (!strcmp(name, "--sigma-factor")) a->o.sigma_factor = parse_prob(name, v);
    else if (!strcmp(name, "--seed")) a->o.seed = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--backend")) {
      /* The world group's engine and its workers' subgroups (DDP_BACKEND,
       * docs/comm.md): ddp, mpi or nccl. */
      setenv("DDP_BACKEND", cli_parse_backend(name, v), 1);
    }
    else if (!strcmp(name, "--top-n")) a->top_n = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--log")) a->log_path = v;
    else if (!strcmp(name, "--ranks-per-worker")) a->o.ranks_per_worker = (int)cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--islands")) a->o.islands = (int)cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--checkpoint")) a->o.checkpoint_dir = v;
    else if (!strcmp(name, "--eval-delay-ms")) a->eval_delay_ms = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--train-samples")) a->train_samples = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--loss-key")) a->loss_key = v;
    else if (!strcmp(name, "--eval-timeout")) {
      char *end;
      a->eval_timeout_s = strtod(v, &end);
      if (*end || end == v || !(a->eval_timeout_s > 0))
        cli_die_usage("--eval-timeout expects seconds > 0, got '%s'", v);
    }
    else if (!strcmp(name, "--val-samples")) a->val_samples = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--eval-batch-size")) a->eval_batch_size = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--trace")) a->trace_dir = v;
    else if (!strcmp(name, "--device")) a->device = v;
    else if (!strcmp(name, "--checkpoint-interval")) {
      char *end;
      a->o.checkpoint_interval_s = strtod(v, &end);
      if (*end || end == v || !(a->o.checkpoint_interval_s >= 0))
        cli_die_usage("--checkpoint-interval expects seconds >= 0, got '%s'", v);
    }
    else if (!strcmp(name, "--migration-prob")) a->o.migration_prob = parse_prob(name, v);
    else if (!strcmp(name, "--num-migrants")) a->o.num_migrants = (int)cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--exchange-interval")) {
      char *end;
      a->o.exchange_interval_s = strtod(v, &end);
      if (*end || end == v || !(a->o.exchange_interval_s >= 0))
        cli_die_usage("--exchange-interval expects seconds >= 0, got '%s'", v);
    }
  }
}

/* ---- Objectives ----------------------------------------------------------- */

typedef struct objective {
  const args *a;
  ddp_hpo_benchmark_fn bench; /* NULL: convnet or cmd */
  hpo_cmd cmd;                /* cmd: when cmd.argc > 0 */
  const char *store_addr;     /* the job's store, for cmd:'s multi-rank runs */
  ddp_pyrandom quartic_noise;
  bool quartic;
  ddp_dataset *train, *test; /* convnet's, opened once */
  ddp_device device;         /* convnet's: where this rank trains */
  int i_layers, i_activation, i_lr, i_gamma;
  int64_t evaluations; /* by this rank */
  int64_t worker_rank0; /* the world rank of this rank's worker's first rank */
  bool lead;            /* this rank is its worker's first: it reports progress */
  double started;
} objective;

static double benchmark_loss(objective *ob, const double *v, int n) {
  return ob->quartic ? ddp_hpo_quartic(v, n, &ob->quartic_noise) : ob->bench(v, n);
}

static bool track_best(const ddp_train_eval_info *info, void *user) {
  double *best = user;
  if (info->test_loss < *best) *best = info->test_loss;
  return false;
}

/* Seed 002's ind_loss: convnet-<conv_layers> with the activation, Adadelta
 * at lr, StepLR(1, gamma), NLL, the best test loss over the evaluations
 * (one per epoch), early stopping after `patience` without improvement.
 * The individual's seed is the search's and its generation. */
static double convnet_loss(objective *ob, const ddp_hpo_space *space, const double *v,
                           ddp_process_group *worker) {
  const args *a = ob->a;
  char model_name[32];
  snprintf(model_name, sizeof model_name, "convnet-%d", (int)v[ob->i_layers]);
  const ddp_hpo_trait *act = ddp_hpo_space_trait(space, ob->i_activation);
  ddp_model *model;
  /* The same on the worker's ranks: the search's seed, the worker, the
   * generation. */
  uint64_t seed = ((uint64_t)a->o.seed * 1000003u + (uint64_t)ob->worker_rank0) * 1000003u +
                  (uint64_t)ob->evaluations;
  if (ddp_model_build(model_name, act->choices[(int)v[ob->i_activation]], seed, &model) != DDP_OK) {
    fprintf(stderr, "ddp-hpo: %s: %s (loss inf)\n", model_name, ddp_last_error());
    return INFINITY;
  }
  ddp_train_options o = ddp_train_defaults();
  o.optim = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  o.optim.lr = v[ob->i_lr];
  o.step_lr_size = 1;
  o.step_lr_gamma = v[ob->i_gamma];
  o.epochs = a->epochs;
  o.max_steps = a->max_steps;
  o.batch_size = a->batch_size;
  o.patience = a->patience;
  o.seed = seed;
  o.workers = 0;
  /* Seed 002 validates in batches of 100; the trainer's default (1000, a
   * rank's whole 500-image share here) made each evaluation's tape hundreds
   * of MB, faulted in afresh for every individual, and took 4x as long. */
  o.eval_batch_size = a->eval_batch_size;
  o.device = ob->device;
  char trace[4096];
  if (a->trace_dir) {
    snprintf(trace, sizeof trace, "%s/w%lld-g%lld-r%d.json", a->trace_dir,
             (long long)ob->worker_rank0 / a->o.ranks_per_worker, (long long)ob->evaluations,
             worker ? ddp_process_group_rank(worker) : 0);
    o.trace_path = trace;
  }
  double best = INFINITY;
  o.callbacks.on_eval = track_best;
  o.callbacks.user = &best;
  ddp_trainer *t;
  ddp_train_result r;
  ddp_status s = ddp_trainer_create(&t, model, ob->train, ob->test, worker, &o);
  if (s == DDP_OK) {
    s = ddp_trainer_run(t, &r);
    if (s == DDP_OK) ddp_train_result_free(&r);
    ddp_trainer_destroy(t);
  }
  if (s != DDP_OK) {
    fprintf(stderr, "ddp-hpo: generation %lld (%s): %s (loss inf)\n", (long long)ob->evaluations,
            model_name, ddp_last_error());
    best = INFINITY;
  }
  ddp_model_destroy(model);
  return best;
}

/* One JSON line per individual of the final population (rank 0). */
static void log_individual(FILE *f, const ddp_hpo_space *space, const ddp_hpo_individual *ind,
                           double started) {
  fprintf(f, "{\"generation\": %lld, ", (long long)ind->generation);
  const double *v = ind->values;
  for (int i = 0; i < ddp_hpo_space_size(space); i++) {
    const ddp_hpo_trait *t = ddp_hpo_space_trait(space, i);
    ddp__json_fput_string(f, t->name);
    if (t->kind == DDP_HPO_CATEGORICAL) {
      fputs(": ", f);
      ddp__json_fput_string(f, t->choices[(int)v[i]]);
      fputs(", ", f);
    } else if (t->kind == DDP_HPO_INT) {
      fprintf(f, ": %lld, ", (long long)v[i]);
    } else {
      fprintf(f, ": %.17g, ", v[i]);
    }
  }
  if (isfinite(ind->loss)) fprintf(f, "\"loss\": %.17g, ", ind->loss);
  else fprintf(f, "\"loss\": null, ");
  fprintf(f, "\"island\": %d, \"worker\": %d, \"start_s\": %.6f, \"end_s\": %.6f, "
             "\"eval_s\": %.6f}\n", ind->island, ind->worker, ind->start_s - started,
          ind->end_s - started, ind->end_s - ind->start_s);
}

static double evaluate(const ddp_hpo_space *space, const double *v, ddp_process_group *worker,
                       void *user) {
  objective *ob = user;
  double t0 = ddp_time_s();
  if (ob->a->eval_delay_ms) usleep((useconds_t)(ob->a->eval_delay_ms * 1000));
  double loss;
  if (ob->cmd.argc) {
    hpo_cmd_eval e = {.rank = worker ? ddp_process_group_rank(worker) : 0,
                      .size = worker ? ddp_process_group_size(worker) : 1,
                      .worker = (int)(ob->worker_rank0 / ob->a->o.ranks_per_worker),
                      .generation = ob->evaluations, .store_addr = ob->store_addr,
                      .timeout_s = ob->a->eval_timeout_s};
    if (worker) { /* the first rank picks the evaluation's MASTER_PORT */
      int64_t port = e.rank == 0 ? hpo_cmd_free_port() : 0;
      if (ddp_broadcast(worker, &port, 1, DDP_INT64, 0) != DDP_OK) port = 0;
      e.master_port = (int)port;
    }
    loss = hpo_cmd_run(&ob->cmd, space, v, &e);
  } else {
    loss = ob->bench ? benchmark_loss(ob, v, ddp_hpo_space_size(space))
                     : convnet_loss(ob, space, v, worker);
  }
  double t1 = ddp_time_s();
  ob->evaluations++;
  if (!ob->bench && !ob->cmd.argc && ob->lead) {
    char buf[256];
    ddp_hpo_format(space, v, buf, sizeof buf);
    fprintf(stderr, "worker %lld generation %lld/%lld: %s: loss %.4f (%.1f s)\n",
            (long long)ob->worker_rank0 / ob->a->o.ranks_per_worker, (long long)ob->evaluations,
            (long long)ob->a->o.generations, buf, loss, t1 - t0);
  }
  return loss;
}

static int need_trait(const ddp_hpo_space *s, const char *name, ddp_hpo_trait_kind a,
                      ddp_hpo_trait_kind b) {
  int i = ddp_hpo_space_find(s, name);
  if (i < 0 || (ddp_hpo_space_trait(s, i)->kind != a && ddp_hpo_space_trait(s, i)->kind != b)) {
    fprintf(stderr, "ddp-hpo: error: --objective convnet needs a trait '%s' in --space "
                    "(default " CONVNET_SPACE ")\n", name);
    exit(2);
  }
  return i;
}

/* One BLAS thread per rank, and a heap that keeps what an evaluation frees. */
static void tune_process(void) {
  openblas_set_num_threads(1);
#ifdef __GLIBC__
  /* Every evaluation builds a trainer and frees it: keep the freed memory
   * (the tape's arena, tens of MB) in the heap for the next one instead of
   * returning it to the kernel and faulting it in again, zeroed, page by
   * page. */
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

/* Several ranks when a launcher says so: the job's store carries the
 * island's exchange, the world group the workers' splits. *world stays
 * NULL for a single process. Returns the exit code of a refusal, else 0. */
static int join_job(const args *a, ddp_rendezvous_info *job, ddp_process_group **world) {
  if (ddp_rendezvous_requested()) {
    CHECK(ddp_rendezvous("env://", NULL, job), "joining the job");
    CHECK(ddp_process_group_create(job->store, job->rank, job->world_size, NULL, world),
          "connecting the ranks");
    if (job->world_size % a->o.ranks_per_worker != 0) {
      fprintf(stderr, "ddp-hpo: %d ranks do not split into workers of %d (--ranks-per-worker "
                      "must divide the world's size)\n", job->world_size, a->o.ranks_per_worker);
      return 2;
    }
  } else if (a->o.ranks_per_worker > 1) {
    fprintf(stderr, "ddp-hpo: --ranks-per-worker %d needs that many ranks: start ddp-hpo with "
                    "ddprun, srun or mpirun\n", a->o.ranks_per_worker);
    return 2;
  }
  return 0;
}

/* The objective named by --objective (cmd:..., a benchmark function or
 * convnet) into *ob, and *spec: the space to search (--space, else the
 * objective's own, written into bench_space for a benchmark). Returns the
 * exit code of a refusal, else 0. */
static int choose_objective(const args *a, const ddp_rendezvous_info *job, objective *ob, const char **spec,
                            char *bench_space, size_t bench_space_bytes) {
  *spec = a->space;
  if (!strncmp(a->objective, "cmd:", 4)) {
    if (hpo_cmd_parse(a->objective + 4, &ob->cmd) != DDP_OK) cli_die_usage("%s", ddp_last_error());
    ob->cmd.loss_key = a->loss_key;
    ob->store_addr = job->store_addr;
    if (!*spec) cli_die_usage("--objective %s needs --space", a->objective);
  } else if (strcmp(a->objective, "convnet") != 0) {
    int dims;
    ddp_status s = ddp_hpo_benchmark(a->objective, &ob->bench, &dims, bench_space, bench_space_bytes);
    if (s != DDP_OK) {
      fprintf(stderr, "ddp-hpo: --objective: %s, or convnet\n", ddp_last_error());
      return 2;
    }
    ob->quartic = !strcmp(a->objective, "quartic");
    ddp_pyrandom_seed(&ob->quartic_noise, a->o.seed + 1000003);
    if (!*spec) *spec = bench_space;
  } else if (!*spec) {
    *spec = CONVNET_SPACE;
  }
  return 0;
}

/* What a resumed search must share besides the search's own options. */
static void write_fingerprint(const args *a, char *out, size_t bytes) {
  snprintf(out, bytes,
           "objective=%s\nspace=%s\ndata=%s\nepochs=%lld\npatience=%lld\nbatch_size=%lld\n"
           "max_steps=%lld\ntrain_samples=%lld\nval_samples=%lld\neval_batch_size=%lld",
           a->objective,
           a->space ? a->space : "(the objective's)", a->data, (long long)a->epochs,
           (long long)a->patience, (long long)a->batch_size, (long long)a->max_steps,
           (long long)a->train_samples, (long long)a->val_samples, (long long)a->eval_batch_size);
}

/* Checks the space against the objective and, for convnet, finds its
 * traits and loads the data. Returns the seconds the data took (0 when
 * none). */
static double prepare_objective(const args *a, objective *ob, const ddp_hpo_space *space, const char *spec) {
  if (ob->bench) {
    for (int i = 0; i < ddp_hpo_space_size(space); i++)
      if (ddp_hpo_space_trait(space, i)->kind != DDP_HPO_FLOAT &&
          ddp_hpo_space_trait(space, i)->kind != DDP_HPO_LOGFLOAT)
        cli_die_usage("a benchmark function takes float traits only (--space '%s')", spec);
    return 0;
  }
  if (ob->cmd.argc) return 0;
  ob->i_layers = need_trait(space, "conv_layers", DDP_HPO_INT, DDP_HPO_INT);
  ob->i_activation = need_trait(space, "activation", DDP_HPO_CATEGORICAL, DDP_HPO_CATEGORICAL);
  ob->i_lr = need_trait(space, "lr", DDP_HPO_FLOAT, DDP_HPO_LOGFLOAT);
  ob->i_gamma = need_trait(space, "gamma", DDP_HPO_FLOAT, DDP_HPO_LOGFLOAT);
  /* Once per process, and only the images the budget uses: decoding all
   * 60,000 training images took 0.6 s of CPU per rank for the 2,000 of a
   * reduced budget. */
  double data_s = ddp_time_s();
  CHECK(ddp_dataset_open_idx_dir_first(&ob->train, a->data, DDP_SPLIT_TRAIN, a->train_samples),
        "loading the training set");
  CHECK(ddp_dataset_open_idx_dir_first(&ob->test, a->data, DDP_SPLIT_TEST, a->val_samples),
        "loading the test set");
  return ddp_time_s() - data_s;
}

/* The summary, as Propulate's: the top n individuals by loss on stderr, the
 * log of every individual, and with --json one line of figures. Rank 0
 * only (it holds the island). Returns the exit code of a failure, else 0. */
static int report(const args *a, const objective *ob, const ddp_hpo_space *space, const ddp_hpo_result *r,
                  FILE *log, double seconds, double data_s, int world_size) {
  int64_t n = r->count, top = a->top_n < n ? a->top_n : n;
  int64_t *order = malloc((size_t)n * sizeof *order);
  if (!order) die("the summary", DDP_ERR_NOMEM);
  for (int64_t i = 0; i < n; i++) order[i] = i;
  for (int64_t i = 1; i < n; i++) /* stable: the earlier of equal losses first */
    for (int64_t j = i; j > 0 && r->individuals[order[j - 1]].loss > r->individuals[order[j]].loss; j--) {
      int64_t x = order[j];
      order[j] = order[j - 1];
      order[j - 1] = x;
    }
  if (log) {
    for (int64_t i = 0; i < n; i++) log_individual(log, space, &r->individuals[i], ob->started);
    if (fclose(log) != 0) {
      fprintf(stderr, "ddp-hpo: error: writing the log %s: %s\n", a->log_path, strerror(errno));
      return 1;
    }
  }
  fprintf(stderr, "%lld individuals known on rank 0's island after %.2f s; top %lld on island 0:\n",
          (long long)n, seconds, (long long)top);
  for (int64_t k = 0; k < top; k++) {
    const ddp_hpo_individual *ind = &r->individuals[order[k]];
    char buf[1024];
    ddp_hpo_format(space, ind->values, buf, sizeof buf);
    fprintf(stderr, "(%lld): %s, loss %.6g, island %d, worker %d, generation %lld\n",
            (long long)k + 1, buf, ind->loss, ind->island, ind->worker, (long long)ind->generation);
  }
  if (a->json) {
    const ddp_hpo_individual *best = &r->individuals[order[0]];
    char buf[1024];
    ddp_hpo_format(space, best->values, buf, sizeof buf);
    /* Every worker evaluated `generations`; rank 0 knows its island's. */
    const int workers = world_size / a->o.ranks_per_worker;
    const int64_t evaluations = a->o.generations * workers;
    printf("{\"evaluations\": %lld, \"seconds\": %.6g, \"evals_per_s\": %.6g, \"workers\": %d, "
           "\"islands\": %d, \"known_on_island_0\": %lld, \"data_seconds\": %.6g, ",
           (long long)evaluations, seconds, evaluations / seconds, workers, a->o.islands,
           (long long)n, data_s);
    if (isfinite(best->loss)) printf("\"best_loss\": %.17g, ", best->loss);
    else printf("\"best_loss\": null, ");
    fputs("\"best\": ", stdout);
    ddp__json_fput_string(stdout, buf);
    printf(", \"best_worker\": %d, \"best_generation\": %lld, \"objective\": ", best->worker,
           (long long)best->generation);
    ddp__json_fput_string(stdout, a->objective);
    fputs("}\n", stdout);
  }
  free(order);
  return 0;
}

/* Frees what the search used and leaves the job together (rank 0 may host
 * the store). */
static void leave_job(ddp_hpo_space *space, objective *ob, ddp_process_group *world, ddp_rendezvous_info *job) {
  ddp_hpo_space_destroy(space);
  ddp_dataset_destroy(ob->test);
  ddp_dataset_destroy(ob->train);
  hpo_cmd_free(&ob->cmd);
  if (world) {
    (void)ddp_barrier(world);
    ddp_process_group_destroy(world);
  }
  ddp_rendezvous_info_destroy(job);
}

/* --device: the rank's device, refused before the job starts where it
 * cannot be (another objective than convnet, no GPU here). cuda is
 * cuda:(LOCAL_RANK % GPUs) under a launcher: a worker of R ranks trains on
 * R GPUs when the node has them. Its gradients go over the worker's group
 * (ddp's own backend by default: GPU buffers staged through host memory,
 * docs/comm.md; --backend nccl for NCCL where every group is on GPUs). */
static ddp_device pick_device(const args *a) {
  ddp_device d = DDP_CPU;
  if (ddp_device_parse(a->device, &d) != DDP_OK) cli_die_usage("--device: %s", ddp_last_error());
  if (d.type == DDP_DEVICE_CPU) return d;
  if (strcmp(a->objective, "convnet") != 0) {
    fprintf(stderr, "ddp-hpo: --device %s applies to --objective convnet (a cmd: program chooses its "
                    "own device; the benchmark functions run on the CPU)\n", a->device);
    exit(2);
  }
  if (ddp_cuda_device_count() == 0) {
    fprintf(stderr, "ddp-hpo: --device %s: no CUDA device here (%s); run with --device cpu\n", a->device,
            ddp_cuda_unavailable_reason());
    exit(2);
  }
  int64_t local_rank = 0, local_world = 1;
  if (!strcmp(a->device, "cuda")) {
    CHECK(ddp_env_int("LOCAL_RANK", 0, &local_rank), "--device cuda: LOCAL_RANK");
    CHECK(ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_world), "--device cuda: LOCAL_WORLD_SIZE");
    CHECK(ddp_default_cuda_device((int)local_rank, (int)local_world, &d), "--device cuda");
  } else {
    CHECK(ddp_device_check(d), "--device");
  }
  char near[400];
  if (ddp_bind_near_gpu(d.index, near, sizeof near) != DDP_OK)
    fprintf(stderr, "ddp-hpo: warning: %s\n", ddp_last_error());
  else
    DDP_INFO("ddp-hpo: %s", near);
  return d;
}

int main(int argc, char **argv) {
  cli_init("ddp-hpo");
  args a;
  parse_args(argc, argv, &a);
  const ddp_device device = pick_device(&a);
  tune_process();
  ddp_rendezvous_info job = {0};
  ddp_process_group *world = NULL;
  int code = join_job(&a, &job, &world);
  if (code) return code;
  const int rank = world ? job.rank : 0;
  objective ob = {.a = &a, .started = ddp_time_s(), .lead = rank % a.o.ranks_per_worker == 0,
                  .worker_rank0 = rank - rank % a.o.ranks_per_worker, .device = device};
  char bench_space[4096];
  const char *spec;
  code = choose_objective(&a, &job, &ob, &spec, bench_space, sizeof bench_space);
  if (code) return code;
  if (a.o.resume && !a.o.checkpoint_dir) cli_die_usage("%s needs --checkpoint DIR", "--resume");
  char fingerprint[8192];
  write_fingerprint(&a, fingerprint, sizeof fingerprint);
  a.o.fingerprint = fingerprint;
  ddp_hpo_space *space;
  if (ddp_hpo_space_parse(spec, &space) != DDP_OK) {
    fprintf(stderr, "ddp-hpo: --space: %s\n(run ddp-hpo --help for the options)\n",
            ddp_last_error());
    return 2;
  }
  double data_s = prepare_objective(&a, &ob, space, spec); /* convnet: once per process */
  FILE *log = NULL;
  if (a.log_path && rank == 0) {
    log = fopen(a.log_path, "w");
    if (!log) {
      fprintf(stderr, "ddp-hpo: error: cannot write the log %s: %s\n", a.log_path, strerror(errno));
      return 1;
    }
  }
  ddp_hpo_result r;
  double t0 = ddp_time_s();
  CHECK(ddp_hpo_search_world(space, &a.o, evaluate, &ob, world, job.store, &r), "searching");
  double seconds = ddp_time_s() - t0;
  if (rank == 0) { /* rank 0 holds the island and reports */
    code = report(&a, &ob, space, &r, log, seconds, data_s, world ? job.world_size : 1);
    if (code) return code;
  }
  ddp_hpo_result_free(&r);
  leave_job(space, &ob, world, &job);
  return 0;
}
