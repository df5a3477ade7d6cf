/* ddp-train: trains one of the seeds' models from the command line. The
 * tool parses the options, builds the model and opens the data, and hands
 * the run to the trainer (include/ddp/train.h: the loop, evaluation,
 * checkpoints, the JSON-lines log); it shows progress on stderr and prints
 * the JSON summary. Under a launcher (ddprun, torchrun's variables, srun,
 * mpirun) it trains data-parallel: tools/ddp_train/world.c joins the group
 * and rank 0 reports. Tools are the only code that calls exit(). */
#include <cblas.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "ddp/ddp.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/parallel.h"
#include "ddp/train.h"
#include "ddp_train/elastic.h"
#include "ddp_train/ps_setup.h"
#include "ddp_train/world.h"
#include "io/io_internal.h"

#define DEFAULT_DATA "/usr/share/datasets/fashion-mnist"

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
  int64_t replicas;        /* --replicas: DataParallel over this many threads (0: none) */
  const char *dump_state; /* NULL unless given */
  int64_t eval_every;     /* 0 = at the end of each epoch and of training */
  int64_t patience;       /* 0 = never stop early */
  const char *log_path;
  bool json;
  const char *save_path;   /* --save: checkpoint at the end (and every save_every steps) */
  int64_t save_every;      /* 0 = only at the end */
  const char *resume_path; /* --resume: continue from this checkpoint */
  const char *init_path;   /* --init: start from this state dict */
  const char *device;      /* --device: auto, cpu, cuda, cuda:N */
  const char *tensorboard; /* --tensorboard DIR: event files there (rank 0) */
  bool cuda_graph;         /* --cuda-graph */
  const char *trace;       /* --trace PATH, else $DDP_TRACE_FILE (ddprun --trace) */
  double bucket_cap_mb;    /* --bucket-cap-mb: 0 = the wrapper's default (25) */
  bool elastic_per_rank;   /* --elastic-batch per-rank: keep the per-rank batch at a new world */
  train_ps_args ps;        /* --param-servers, --ps-mode, ... (tools/ddp_train/ps_setup.c) */
  int64_t microbatches;    /* --microbatches M: 0 = the whole batch at once */
  int64_t pp;              /* --pp P: pipeline stages (0 = no pipeline) */
  const char *schedule;    /* --schedule: gpipe | 1f1b | interleaved (1f1b) */
  int64_t virtual_stages;  /* --virtual-stages v (interleaved: 2) */
  const char *split;       /* --split NAMES | auto (auto) */
  int64_t zero;            /* --zero S: ZeRO stage (0 = none) */
  int comm_hook;           /* --comm-hook: a ddp_dp_hook_kind (0 = allreduce) ... */
  int powersgd_rank;       /* ... or powersgd:RANK (0 = none) */
  int64_t powersgd_start;  /* --powersgd-start N (0 = PyTorch's 1000) */
  bool sharded_checkpoint; /* --sharded-checkpoint */
  const char *precision;   /* --precision fp32 | bf16 | fp16 | tf32 (fp32) */
  int precision_value;     /* its ddp_precision (0: fp32) */
  const char *grad_scaler; /* --grad-scaler auto | on | off (auto: on for fp16) */
  int64_t grad_scaler_growth_interval; /* --grad-scaler-growth-interval N (0: 2000) */
  double clip_grad_norm;   /* --clip-grad-norm MAX: 0 = none */
} train_args;

/* --grad-scaler's names (ddp_train_grad_scaler), -1 for another. */
static int parse_grad_scaler(const char *v) {
  if (!strcmp(v, "auto")) return DDP_TRAIN_GRAD_SCALER_AUTO;
  if (!strcmp(v, "on")) return DDP_TRAIN_GRAD_SCALER_ON;
  if (!strcmp(v, "off")) return DDP_TRAIN_GRAD_SCALER_OFF;
  return -1;
}

static void usage(FILE *f) {
  fprintf(f,
"usage: ddp-train [options]\n"
"\n"
"Trains one of the seeds' models on one process (PyTorch's training loop, in C).\n"
"\n"
"Model\n"
"  --model NAME         toy | headtail | convnet | psnet | convnet-N (N in 2..10) |\n"
"                       mlp:WxD (D linear layers of width W on the regression data)\n"
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
"  --clip-grad-norm MAX before each step scale the gradients so that their global L2\n"
"                       norm is at most MAX (torch.nn.utils.clip_grad_norm_; single,\n"
"                       data parallel and --zero; a non-finite norm stops the run)\n"
"  --scheduler step     StepLR: multiply the lr by --gamma every --step-size epochs\n"
"  --step-size N        epochs between lr changes (default 1)\n"
"  --gamma X            lr factor (default 0.1)\n"
"  --seed N             seeds the weights, the shuffle and dropout (default 1)\n"
"  --threads N          BLAS threads per process (default: $OMP_NUM_THREADS if set, else 1;\n"
"                       ddprun sets OMP_NUM_THREADS=1 for several workers)\n"
"  --device D           cpu | cuda | cuda:N | auto (default auto: a GPU when this build\n"
"                       has CUDA, one is present and training is one process, else\n"
"                       cpu; cuda and auto take cuda:(LOCAL_RANK %% GPUs) under a\n"
"                       launcher). On a GPU the whole step runs there; --save, --resume\n"
"                       and data parallelism need the CPU for now\n"
"  --cuda-graph         on a GPU, capture the step of a full batch once as a CUDA graph\n"
"                       (after 3 eager steps) and replay it for every full batch: one\n"
"                       launch instead of dozens. Not with dropout or --sync-bn\n"
"Mixed precision (docs/mixed-precision.md)\n"
"  --precision P        fp32 (default) | bf16 | fp16 | tf32. bf16 and fp16: autocast's ops\n"
"                       in that type with float32 accumulation, parameters and gradients\n"
"                       float32, on the CPU and on GPUs (cuBLAS/cuDNN); tf32 is a GPU-only\n"
"                       opt-in (TF32 tensor cores for float32 matmuls; refused on the CPU)\n"
"  --grad-scaler S      auto (default: on for fp16, off otherwise) | on | off: scale the\n"
"                       loss (PyTorch's GradScaler: initial scale 2^16, x2 after 2000 steps\n"
"                       without inf/NaN, x0.5 and the step skipped on every rank when a\n"
"                       gradient is inf/NaN); its state is saved and resumed\n"
"  --grad-scaler-growth-interval N  steps without inf/NaN before the scale doubles (2000)\n"
"Micro-batches and pipelines (docs/train.md, \"Pipeline\")\n"
"  --microbatches M     split each step's batch into M micro-batches along dim 0 (uneven\n"
"                       sizes as torch.tensor_split) and accumulate their gradients,\n"
"                       scaled by 1/M; with --pp, the pipeline's micro-batches\n"
"  --pp P               split the model into P pipeline stages, one rank each (under a\n"
"                       launcher; the world is P stages x WORLD_SIZE/P replicas, ranks\n"
"                       [k*P, (k+1)*P) forming replica k, data parallel across replicas)\n"
"  --schedule S         gpipe | 1f1b | interleaved (default 1f1b)\n"
"  --virtual-stages v   stages per rank for interleaved (default 2)\n"
"  --split NAMES|auto   where stages begin: top-level module names (\"layer2\", \"a,b\")\n"
"                       or auto (measured cost, rank 0 decides; the default)\n"
"Parameter server (under a launcher; docs/ps.md)\n"
"  --param-servers S    ranks 0..S-1 hold the parameters and optimizer state, sharded by\n"
"                       whole tensors; the other ranks train on their shard of the data,\n"
"                       push gradients and pull fresh parameters\n"
"  --ps-mode M          sync (gradients averaged over all trainers each step, as data\n"
"                       parallelism), async (each push applied on arrival) or ssp:K (no\n"
"                       trainer more than K steps ahead of the slowest); default sync\n"
"  --step-sleep-ms X    (test model) each trainer sleeps X ms after every step\n"
"  --straggler SPEC     (test model) I:half (trainer I sleeps twice as long) or\n"
"                       I:pause:P:MS (trainer I pauses MS ms after a step with probability P);\n"
"                       I = all: every trainer\n"
"DataParallel (one process)\n"
"  --replicas N         the batch of each step spread over N replicas, threads of this\n"
"                       process on cores of their own, gradients summed into the one model\n"
"                       (PyTorch's DataParallel without its lock; --sync-bn: SyncBatchNorm\n"
"                       across them); not under a launcher\n"
"Data parallel (automatic under ddprun, torchrun's variables, srun or mpirun)\n"
"  --sync-bn            BatchNorm statistics over the whole global batch (SyncBatchNorm)\n"
"  --bucket-cap-mb X    gradients are reduced in buckets of X MiB (the first 1 MiB;\n"
"                       default 25, PyTorch's): smaller buckets overlap more of\n"
"                       backward with communication, in more messages\n"
"  --comm-hook H        how gradients are averaged (PyTorch's DDP comm hooks, docs/parallel.md):\n"
"                       allreduce (default, float32), fp16 or bf16 (halves compressed before\n"
"                       the allreduce), powersgd:RANK (PowerSGD: each matrix-shaped gradient\n"
"                       as a rank-RANK approximation with error feedback and warm start;\n"
"                       its state is saved beside --save, one file per rank)\n"
"  --powersgd-start N   PowerSGD's first N steps are plain allreduces (default 1000,\n"
"                       PyTorch's start_powerSGD_iter; N > 1)\n"
"  --zero S            ZeRO stage 1, 2 or 3 (docs/sharding.md): each rank keeps the optimizer\n"
"                       state of its 1/W of the parameters (1), and receives only that\n"
"                       range's reduced gradients (2), and holds only that range of the\n"
"                       parameters, gathering each top-level module when it runs (3,\n"
"                       FSDP's FULL_SHARD); --save writes the ordinary\n"
"                       checkpoint, which --resume loads at any world size and stage\n"
"  --sharded-checkpoint --save DIR writes a directory: each rank its range of the\n"
"                       parameters and optimizer state, rank 0 the metadata; --resume\n"
"                       DIR loads it at any world size (ddp-ckpt consolidate DIR\n"
"                       OUT.safetensors makes the model's state dict of it)\n"
"  --dump-state PATH    after training, write every state-dict tensor as text lines\n"
"                       'name numel v0 v1 ...' to PATH ({rank} in PATH: every rank writes\n"
"                       its own file; otherwise rank 0 only). For comparing runs\n"
"Evaluation and output\n"
"  --eval-every N       evaluate on the test set every N steps (default 0: at the end\n"
"                       of each epoch and of training)\n"
"  --patience K         stop after K evaluations in a row without a better test loss\n"
"  --tensorboard DIR    TensorBoard event files in DIR (rank 0; SummaryWriter's naming):\n"
"                       train/loss, train/lr, train/samples_per_s and phases/*_ms per\n"
"                       step, test/loss and test/accuracy per evaluation, the options\n"
"                       as text (tensorboard --logdir DIR)\n"
"  --log FILE           one JSON object per line: per step {step, epoch, loss, lr,\n"
"                       samples_per_s, and where the step's time went: load_ms,\n"
"                       forward_ms, backward_compute_ms, backward_comm_ms (the\n"
"                       communication backward did not hide, waiting for the slowest\n"
"                       rank included), optimizer_ms, step_ms, and preempted_ms (the\n"
"                       time the rank was ready to run while another task held its\n"
"                       CPU)}, per evaluation {step, epoch, test_loss, test_accuracy}\n"
"  --trace PATH         a timeline of the run as Chrome trace JSON (Perfetto,\n"
"                       chrome://tracing): each step's load, forward, backward,\n"
"                       optimizer and loss allreduce, each bucket's allreduce from\n"
"                       launch to completion, the waits, evaluations. Written at\n"
"                       the end ({rank} in PATH: every rank writes its own file,\n"
"                       otherwise rank 0 only; ddprun --trace DIR sets\n"
"                       DDP_TRACE_FILE for each rank and merges them)\n"
"  --json               end stdout with one JSON summary line (samples_per_s,\n"
"                       steady_samples_per_s (without the first 10 steps), train_loss,\n"
"                       test_loss, test_accuracy, steps, steady_step_phases (rank 0's\n"
"                       mean of the per-step times above over those steps),\n"
"                       steady_preempted_ms_per_rank (every rank's mean preempted_ms),\n"
"                       memory_per_rank (every rank's param_bytes, grad_bytes,\n"
"                       optim_state_bytes, grad_reduced_bytes, peak_tensor_bytes,\n"
"                       max_rss_bytes; docs/train.md \"Memory\"), epochs, world_size)\n"
"Checkpoints (safetensors; docs/io.md)\n"
"  --save PATH          at the end of training write the model's state dict to PATH (loads\n"
"                       into PyTorch with load_state_dict(strict=True)) and the training\n"
"                       state (optimizer, scheduler, step, epoch, RNG) beside it, in\n"
"                       PATH's .train.safetensors (PATH.safetensors -> PATH.train.safetensors);\n"
"                       rank 0 writes\n"
"  --save-every N       also save every N optimizer steps (default 0: only at the end)\n"
"  --resume PATH        continue the run saved in PATH exactly where it stopped: the step\n"
"                       count continues (--max-steps and --epochs count from the start of\n"
"                       training); model, optimizer and data options must be the same.\n"
"                       --resume auto: --save's checkpoint when it exists, else a fresh\n"
"                       start (each round of an elastic ddprun job); at another world\n"
"                       size the rest of the epoch is dealt over the new ranks\n"
"  --elastic-batch global|per-rank  at a new world size keep the global batch (the\n"
"                       per-rank batch recomputed; default) or the per-rank batch\n"
"  --init PATH          start from the model state dict in PATH instead of a fresh\n"
"                       initialisation (a safetensors file from --save or from PyTorch's\n"
"                       state_dict(); a 'module.' prefix is accepted); with --epochs 0 this\n"
"                       evaluates a saved model\n"
"  --backend B          the process group's engine: ddp (default: ddp's own shared memory\n"
"                       and TCP), mpi (the cluster's MPI: run under `mpirun -np N` or\n"
"                       `srun --mpi=pmix`, ranks from MPI) or nccl; sets DDP_BACKEND\n"
"  -h, --help           this text\n"
"  --version            print \"ddp-train (ddp) VERSION\"\n"
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

static double parse_double(const char *flag, const char *v) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || *end || end == v || !isfinite(x) || x < 0) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s expects a non-negative number, got '%%s'", flag);
    cli_die_usage(msg, v);
  }
  return x;
}

static void parse_args(int argc, char **argv, train_args *a) {
  *a = (train_args){.model = "convnet", .epochs = 1, .batch_size = 100, .lr = NAN,
                    .optimizer = "sgd", .step_size = 1, .gamma = 0.1, .seed = 1,
                    .threads = 0, .workers = -1};
  for (int i = 1; i < argc; i++) {
    const char *f = argv[i];
    cli_help_or_version(f, usage);
    if (!strcmp(f, "--json")) {
      a->json = true;
      continue;
    }
    if (!strcmp(f, "--sync-bn") || !strcmp(f, "--sync_bn")) {
      a->sync_bn = true;
      continue;
    }
    if (!strcmp(f, "--cuda-graph") || !strcmp(f, "--cuda_graph")) {
      a->cuda_graph = true;
      continue;
    }
    if (!strcmp(f, "--sharded-checkpoint") || !strcmp(f, "--sharded_checkpoint")) {
      a->sharded_checkpoint = true;
      continue;
    }
    /* Every other option takes a value, as "--opt V" or "--opt=V". */
    static const char *const valued[] = {
        "--model", "--activation", "--data", "--samples", "--epochs", "--max-steps",
        "--batch-size", "--lr", "--optimizer", "--momentum", "--weight-decay", "--scheduler",
        "--step-size", "--gamma", "--seed", "--threads", "--workers", "--eval-every",
        "--patience", "--log", "--dump-state", "--save", "--save-every", "--resume", "--init",
        "--device", "--tensorboard", "--trace", "--bucket-cap-mb", "--microbatches", "--pp",
        "--schedule", "--virtual-stages", "--split", "--param-servers", "--ps-mode", "--backend",
        "--step-sleep-ms", "--straggler", "--replicas",
        "--elastic-batch", "--zero", "--comm-hook", "--powersgd-start", "--precision",
        "--grad-scaler", "--grad-scaler-growth-interval", "--clip-grad-norm"};
    char name[64];
    const char *eq;
    cli_valued_option(f, valued, sizeof valued / sizeof *valued, name, sizeof name, &eq);
    const char *v = cli_option_value(argc, argv, &i, eq);
    if (!strcmp(name, "--model")) a->model = v;
    else if (!strcmp(name, "--activation")) a->activation = v;
    else if (!strcmp(name, "--data")) a->data = v;
    else if (!strcmp(name, "--samples")) a->samples = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--epochs")) a->epochs = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--max-steps")) a->max_steps = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--batch-size")) a->batch_size = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--lr")) a->lr = parse_double(name, v);
    else if (!strcmp(name, "--optimizer")) a->optimizer = v;
    else if (!strcmp(name, "--momentum")) a->momentum = parse_double(name, v);
    else if (!strcmp(name, "--weight-decay")) a->weight_decay = parse_double(name, v);
    else if (!strcmp(name, "--scheduler")) a->scheduler = v;
    else if (!strcmp(name, "--step-size")) a->step_size = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--gamma")) a->gamma = parse_double(name, v);
    else if (!strcmp(name, "--seed")) a->seed = (uint64_t)cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--threads")) a->threads = (int)cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--workers")) a->workers = (int)cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--eval-every")) a->eval_every = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--patience")) a->patience = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--log")) a->log_path = v;
    else if (!strcmp(name, "--dump-state")) a->dump_state = v;
    else if (!strcmp(name, "--save")) a->save_path = v;
    else if (!strcmp(name, "--save-every")) a->save_every = cli_parse_int(name, v, 0, INT64_MAX);
    else if (!strcmp(name, "--resume")) a->resume_path = v;
    else if (!strcmp(name, "--elastic-batch")) {
      if (strcmp(v, "global") && strcmp(v, "per-rank"))
        cli_die_usage("--elastic-batch expects global or per-rank, got '%s'", v);
      a->elastic_per_rank = !strcmp(v, "per-rank");
    }
    else if (!strcmp(name, "--init")) a->init_path = v;
    else if (!strcmp(name, "--device")) a->device = v;
    else if (!strcmp(name, "--tensorboard")) a->tensorboard = v;
    else if (!strcmp(name, "--trace")) a->trace = v;
    else if (!strcmp(name, "--microbatches")) a->microbatches = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--pp")) a->pp = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--schedule")) a->schedule = v;
    else if (!strcmp(name, "--virtual-stages")) a->virtual_stages = cli_parse_int(name, v, 1, INT64_MAX);
    else if (!strcmp(name, "--split")) a->split = v;
    else if (!strcmp(name, "--zero")) a->zero = cli_parse_int(name, v, 1, 3);
    else if (!strcmp(name, "--clip-grad-norm")) {
      a->clip_grad_norm = parse_double(name, v);
      if (!(a->clip_grad_norm > 0) || isinf(a->clip_grad_norm))
        cli_die_usage("--clip-grad-norm: %s is not a finite max_norm > 0", v);
    }
    else if (!strcmp(name, "--comm-hook")) {
      a->comm_hook = 0;
      a->powersgd_rank = 0;
      if (!strcmp(v, "allreduce")) a->comm_hook = DDP_DP_HOOK_ALLREDUCE;
      else if (!strcmp(v, "fp16")) a->comm_hook = DDP_DP_HOOK_FP16;
      else if (!strcmp(v, "bf16")) a->comm_hook = DDP_DP_HOOK_BF16;
      else if (!strncmp(v, "powersgd:", 9))
        a->powersgd_rank = (int)cli_parse_int("--comm-hook powersgd:RANK", v + 9, 1, 1 << 20);
      else
        cli_die_usage("--comm-hook expects allreduce, fp16, bf16 or powersgd:RANK, got '%s'", v);
    }
    else if (!strcmp(name, "--powersgd-start"))
      a->powersgd_start = cli_parse_int(name, v, 2, INT32_MAX);
    else if (!strcmp(name, "--precision")) {
      a->precision = v;
      a->precision_value = cli_parse_precision(name, v);
    }
    else if (!strcmp(name, "--grad-scaler")) a->grad_scaler = v;
    else if (!strcmp(name, "--grad-scaler-growth-interval"))
      a->grad_scaler_growth_interval = cli_parse_int(name, v, 1, INT32_MAX);
    else if (!strcmp(name, "--param-servers") || !strcmp(name, "--ps-mode") ||
             !strcmp(name, "--step-sleep-ms") || !strcmp(name, "--straggler"))
      train_ps_parse(&a->ps, name, v);
    else if (!strcmp(name, "--backend")) {
      /* The process group's engine (options.backend, read as DDP_BACKEND by
       * the group ddp-train makes): ddp, mpi or nccl (docs/comm.md). */
      setenv("DDP_BACKEND", cli_parse_backend(name, v), 1);
    }
    else if (!strcmp(name, "--replicas")) a->replicas = cli_parse_int(name, v, 1, 1024);
    else if (!strcmp(name, "--bucket-cap-mb")) {
      a->bucket_cap_mb = parse_double(name, v);
      if (!(a->bucket_cap_mb > 0)) cli_die_usage("--bucket-cap-mb expects MiB > 0, got '%s'", v);
    }
    else cli_die_usage("unknown option '%s'", f);
  }
  if (a->scheduler && strcmp(a->scheduler, "step") && strcmp(a->scheduler, "none"))
    cli_die_usage("--scheduler expects 'step' (StepLR) or 'none', got '%s'", a->scheduler);
  if (a->scheduler && !strcmp(a->scheduler, "none")) a->scheduler = NULL;
  if (a->save_every && !a->save_path) cli_die_usage("%s needs --save PATH", "--save-every");
  if (a->microbatches > INT32_MAX) cli_die_usage("--microbatches: %s is too many", "M");
  if (a->grad_scaler && parse_grad_scaler(a->grad_scaler) < 0)
    cli_die_usage("--grad-scaler expects auto, on or off, got '%s'", a->grad_scaler);
  if (a->pp > DDP_PIPELINE_MAX_STAGES) cli_die_usage("--pp: at most 64 stages (%s)", "DDP_PIPELINE_MAX_STAGES");
  if (!a->pp && (a->schedule || a->virtual_stages || a->split))
    cli_die_usage("%s: --schedule, --virtual-stages and --split need --pp P", "--pp");
  if (a->resume_path && !strcmp(a->resume_path, "auto") && !a->save_path)
    cli_die_usage("--resume auto resumes from --save's checkpoint when it exists: give %s", "--save PATH");
  if (a->init_path && a->resume_path)
    cli_die_usage("%s: --resume restores the model already; give one of --init and --resume",
              "--init");
}

/* ---- Data ------------------------------------------------------------------ */

static const char *default_data(const char *model) {
  if (!strcmp(model, "toy") || !strncmp(model, "mlp:", 4)) return "regression";
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

/* ---- Output ---------------------------------------------------------------- */

/* JSON has no NaN: write null. */
static void json_number(FILE *f, const char *key, double v, bool comma) {
  ddp__json_fput_string(f, key);
  if (isfinite(v))
    fprintf(f, ": %.6g%s", v, comma ? ", " : "");
  else
    fprintf(f, ": null%s", comma ? ", " : "");
}

/* "load_ms": ..., one key per phase, in milliseconds. */
static void phases_json(FILE *f, const ddp_train_phases *p, bool comma) {
  json_number(f, "load_ms", p->load_ms, true);
  json_number(f, "forward_ms", p->forward_ms, true);
  json_number(f, "backward_compute_ms", p->backward_compute_ms, true);
  json_number(f, "backward_comm_ms", p->backward_comm_ms, true);
  json_number(f, "optimizer_ms", p->optimizer_ms, true);
  json_number(f, "step_ms", p->step_ms, true);
  json_number(f, "preempted_ms", p->preempted_ms, comma);
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

/* ---- Training -------------------------------------------------------------- */

static ddp_optim_kind optimizer_kind(const char *name) {
  if (!strcmp(name, "sgd")) return DDP_OPTIM_SGD;
  if (!strcmp(name, "adam")) return DDP_OPTIM_ADAM;
  if (!strcmp(name, "adadelta")) return DDP_OPTIM_ADADELTA;
  cli_die_usage("--optimizer expects sgd, adam or adadelta, got '%s'", name);
}

/* `pattern` for this rank: "{rank}" replaced by the rank (every rank its
 * own file); without it rank 0 only (NULL elsewhere). NULL and "" give
 * NULL. */
static const char *rank_path(const char *pattern, int rank, char *buf, size_t bytes) {
  if (!pattern || !*pattern) return NULL;
  const char *mark = strstr(pattern, "{rank}");
  if (!mark) return rank == 0 ? pattern : NULL;
  snprintf(buf, bytes, "%.*s%d%s", (int)(mark - pattern), pattern, rank, mark + 6);
  return buf;
}

/* Writes every state-dict tensor as a line "name numel v0 v1 ..." (%.9g:
 * float32 round-trips), composed in memory and written atomically (io's
 * writer). With "{rank}" in `pattern` every rank writes its own file,
 * otherwise rank 0 only. */
static void dump_state(const ddp_model *model, const char *pattern, int rank) {
  const char *mark = strstr(pattern, "{rank}");
  if (!mark && rank != 0) return;
  char path[4096];
  if (mark)
    snprintf(path, sizeof path, "%.*s%d%s", (int)(mark - pattern), pattern, rank, mark + 6);
  else
    snprintf(path, sizeof path, "%s", pattern);
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f) die("--dump-state", ddp_error(DDP_ERR_NOMEM, "out of memory"));
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
  if (fclose(f) != 0) die("--dump-state", ddp_error(DDP_ERR_NOMEM, "out of memory"));
  ddp_status s = ddp__atomic_write_file(path, text, len);
  free(text); /* open_memstream's buffer comes from malloc */
  CHECK(s, "writing the state");
}

/* ---- Checkpoints ----------------------------------------------------------- */

/* The options a resumed run must share with the saved one (everything that
 * decides the model, the data order or the update), recorded as metadata in
 * both checkpoint files and compared by ddp_checkpoint_load. --epochs,
 * --max-steps, evaluation, logging and thread counts may change. */
typedef struct run_meta {
  char values[20][64];
  ddp_kv kv[20];
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

/* replicas > 0: the batch is recorded as the global batch (per-rank x
 * replicas), which an elastic resume at another world keeps; 0: as the
 * per-rank batch (--elastic-batch per-rank, the pipeline, the parameter
 * server), which a resume keeps. */
static void run_meta_init(run_meta *m, const train_args *a, const ddp_optim_options *oo, int64_t replicas) {
  m->n = 0;
  meta_add(m, "ddp-train.model", "%s", a->model);
  meta_add(m, "ddp-train.activation", "%s", a->activation ? a->activation : "");
  meta_add(m, "ddp-train.data", "%s", a->data ? a->data : default_data(a->model));
  meta_add(m, "ddp-train.samples", "%lld", (long long)a->samples);
  if (replicas > 0)
    meta_add(m, "ddp-train.global_batch", "%lld", (long long)(a->batch_size * replicas));
  else
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
  /* The micro-batches decide BatchNorm's statistics and the loss's
   * scaling; the pipeline's P, split, schedule and v do not change the
   * update, so a run may resume with others (docs/train.md). */
  meta_add(m, "ddp-train.microbatches", "%lld", (long long)(a->microbatches > 1 ? a->microbatches : 1));
}


/* ---- Progress, through the trainer's callbacks ------------------------------ */

/* What the callbacks share: the progress display, the resume notice, and
 * the last step's figures for the forced display before an epoch's
 * evaluation. */
typedef struct tool_view {
  progress prog;
  const train_args *a;
  bool lead;
  int64_t epochs;
  double last_loss, last_rate, last_train_seconds;
  int64_t last_step;
  double loss_scale;     /* the gradient scaler's after the last step (NaN: none) */
  int64_t skipped_steps; /* steps it skipped for inf/NaN */
  const char *hold_file; /* $DDP_TRAIN_HOLD_FILE, or NULL */
} tool_view;

/* DDP_TRAIN_HOLD_FILE=PATH (a test aid, docs/launch.md): after each step,
 * while PATH exists, the rank waits (polling every 20 ms, at most 120 s,
 * then goes on saying so), so that a test can keep a run going while
 * something else happens (a node joining an elastic job) however fast the
 * model trains. Unset: one branch per step. */
static void hold_while_file(const tool_view *v) {
  if (!v->hold_file) return;
  for (int i = 0; access(v->hold_file, F_OK) == 0; i++) {
    if (i == 6000) {
      fprintf(stderr, "ddp-train: DDP_TRAIN_HOLD_FILE %s still exists after 120 s: going on\n",
              v->hold_file);
      return;
    }
    usleep(20 * 1000);
  }
}

static void on_start(const ddp_train_start_info *info, void *user) {
  tool_view *v = user;
  v->prog.total_steps = info->total_steps;
  if (info->resumed && v->lead)
    fprintf(stderr, "resuming %s at step %lld (epoch %lld, batch %lld of %lld)\n",
            v->a->resume_path, (long long)info->step, (long long)info->epoch + 1,
            (long long)info->epoch_batches, (long long)info->steps_per_epoch);
}

static bool on_step(const ddp_train_step_info *info, void *user) {
  tool_view *v = user;
  v->last_step = info->step;
  v->last_loss = info->loss;
  v->last_rate = info->samples_per_s;
  v->last_train_seconds = info->train_seconds;
  v->loss_scale = info->loss_scale;
  v->skipped_steps = info->skipped_steps;
  show_progress(&v->prog, info->step, info->epoch, v->epochs, info->loss, info->samples_per_s,
                info->train_seconds, false);
  hold_while_file(v);
  return false;
}

/* An epoch's evaluation: the progress line brought up to date and closed,
 * then the test figures. */
static bool on_eval(const ddp_train_eval_info *info, void *user) {
  tool_view *v = user;
  if (info->kind != DDP_TRAIN_EVAL_EPOCH) return false;
  show_progress(&v->prog, info->step, info->epoch, v->epochs, v->last_loss, v->last_rate,
                v->last_train_seconds, true);
  end_progress_line(&v->prog);
  if (v->lead) {
    fprintf(stderr, "epoch %lld: test loss %.4f", (long long)info->epoch + 1, info->test_loss);
    if (!isnan(info->test_accuracy))
      fprintf(stderr, ", test accuracy %.2f%%", 100 * info->test_accuracy);
    fputc('\n', stderr);
  }
  return false;
}

/* The --json summary line (rank 0). */
static void print_summary(const train_args *a, const ddp_train_result *r, const tool_view *v) {
  printf("{");
  json_number(stdout, "samples_per_s", r->samples_per_s, true);
  json_number(stdout, "steady_samples_per_s", r->steady_samples_per_s, true);
  json_number(stdout, "train_loss", r->train_loss, true);
  json_number(stdout, "test_loss", r->test_loss, true);
  json_number(stdout, "test_accuracy", r->test_accuracy, true);
  printf("\"steps\": %lld, ", (long long)r->steps);
  /* Rank 0's mean step, over the steps steady_samples_per_s counts. */
  printf("\"steady_step_phases\": {");
  phases_json(stdout, &r->steady_phases, false);
  printf("}, ");
  printf("\"steady_preempted_ms_per_rank\": [");
  for (int k = 0; k < r->world_size; k++) {
    double v = r->steady_preempted_ms_per_rank[k];
    if (isfinite(v)) printf("%s%.6g", k ? ", " : "", v);
    else printf("%snull", k ? ", " : "");
  }
  printf("], ");
  json_number(stdout, "epochs", r->epochs, true);
  /* Each rank's training-state bytes (ZeRO shards the optimizer's). */
  if (r->memory_per_rank) {
    printf("\"memory_per_rank\": [");
    for (int k = 0; k < r->world_size; k++) {
      const ddp_train_memory *m = &r->memory_per_rank[k];
      printf("%s{\"param_bytes\": %lld, \"grad_bytes\": %lld, \"optim_state_bytes\": %lld, "
             "\"grad_reduced_bytes\": %lld, \"peak_tensor_bytes\": %lld, \"max_rss_bytes\": %lld}",
             k ? ", " : "", (long long)m->param_bytes, (long long)m->grad_bytes,
             (long long)m->optim_state_bytes, (long long)m->grad_reduced_bytes,
             (long long)m->peak_tensor_bytes, (long long)m->max_rss_bytes);
    }
    printf("], ");
  }
  /* Under a pipeline: each stage's idle fraction and activation
   * high-water mark (replica 0's ranks). */
  if (r->n_stages) {
    printf("\"pipeline\": {\"stages\": %lld, \"microbatches\": %lld, \"schedule\": ",
           (long long)r->n_stages, (long long)a->microbatches);
    ddp__json_fput_string(stdout, a->schedule ? a->schedule : "1f1b");
    printf(", \"per_stage\": [");
    for (int64_t k = 0; k < r->n_stages; k++) {
      const ddp_train_stage_stats *st = &r->stages[k];
      printf("%s{\"rank\": %d, ", k ? ", " : "", (int)st->rank);
      json_number(stdout, "idle_fraction", st->idle_fraction, true);
      printf("\"activation_bytes_high_water\": %lld, \"microbatch_activation_bytes\": %lld, "
             "\"live_microbatches_high_water\": %d}",
             (long long)st->activation_bytes_high_water,
             (long long)st->microbatch_activation_bytes, (int)st->live_high_water);
    }
    printf("]}, ");
  }
  printf("\"world_size\": %d, \"model\": ", r->world_size);
  ddp__json_fput_string(stdout, a->model);
  printf(", \"optimizer\": ");
  ddp__json_fput_string(stdout, a->optimizer);
  /* Only off the default, so an fp32 run's summary stays as it was. */
  if (a->precision && strcmp(a->precision, "fp32")) {
    printf(", \"precision\": ");
    ddp__json_fput_string(stdout, a->precision);
  }
  /* The gradient scaler's, when the run had one and stepped. */
  if (!isnan(v->loss_scale)) {
    printf(", ");
    json_number(stdout, "loss_scale", v->loss_scale, true);
    printf("\"skipped_steps\": %lld", (long long)v->skipped_steps);
  }
  printf(", \"cuda_graph\": %s}\n", a->cuda_graph ? "true" : "false");
}

/* --device: what was asked, or for auto the first GPU when there is one and
 * training is one process without checkpoints (auto keeps data-parallel and
 * checkpointed runs on the CPU, as before they ran on GPUs; ask for cuda). A GPU
 * named without its index (cuda, or auto) is the rank's own under a
 * launcher: cuda:(LOCAL_RANK % GPUs), as torchrun's users set device_ids. */
static ddp_device choose_device(const train_args *a, const train_world *world) {
  bool automatic = !a->device || !strcmp(a->device, "auto");
  if (automatic && (world->pg || a->save_path || a->resume_path || ddp_cuda_device_count() == 0))
    return DDP_CPU;
  ddp_device d = DDP_CUDA(0);
  if (!automatic && ddp_device_parse(a->device, &d) != DDP_OK)
    cli_die_usage("--device: %s", ddp_last_error());
  int64_t local_rank, local_world;
  if (d.type == DDP_DEVICE_CUDA && (automatic || !strcmp(a->device, "cuda")) &&
      getenv("LOCAL_RANK") && ddp_env_int("LOCAL_RANK", 0, &local_rank) == DDP_OK &&
      ddp_env_int("LOCAL_WORLD_SIZE", 1, &local_world) == DDP_OK && ddp_cuda_device_count() > 0)
    CHECK(ddp_default_cuda_device((int)local_rank, (int)local_world, &d), "choosing the rank's GPU");
  return d;
}

/* The group's backend for --device cuda under a launcher (torch's
 * init_process_group("nccl") with device_ids=[rank]): nccl when NCCL loads,
 * else ddp's own, which stages GPU buffers through pinned host memory
 * (docs/comm.md), said once. $DDP_BACKEND decides when set; NULL leaves it
 * to the group (the CPU: ddp's own). */
static const char *world_backend(const train_args *a) {
  if (!a->device || strncmp(a->device, "cuda", 4) != 0 || !train_world_requested()) return NULL;
  const char *env = getenv("DDP_BACKEND");
  if (env && *env) return NULL;
  char version[128];
  if (ddp_nccl_version(version, sizeof version) == DDP_OK) return "nccl";
  if (!getenv("RANK") || !strcmp(getenv("RANK"), "0"))
    fprintf(stderr, "ddp-train: --device %s: NCCL is not available (%s); the gradients go over "
                    "ddp's own backend, staged through pinned host memory (slower; set "
                    "DDP_NCCL_LIBRARY to an NCCL library to use NCCL)\n",
            a->device, ddp_last_error());
  return "ddp";
}

int main(int argc, char **argv) {
  cli_init("ddp-train");
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

  /* Data parallel when a launcher says so (tools/ddp_train/world.c). */
  train_world world;
  train_ps ps = {0};
  if (a.ps.servers) { /* a parameter server: RPC, no group (tools/ddp_train/ps_setup.c) */
    CHECK(train_ps_join(&ps, &a.ps), "joining the parameter-server job");
    world = (train_world){.rank = ps.rank, .size = ps.world_size, .local_size = ps.world_size};
    snprintf(rank_tag, sizeof rank_tag, "rank %d: ", world.rank);
  } else {
    CHECK(train_world_init_on(&world, world_backend(&a)), "starting data-parallel training");
  }
  if (world.pg) snprintf(rank_tag, sizeof rank_tag, "rank %d: ", world.rank);
  /* Prints progress and the summary: rank 0, or the first trainer. */
  bool lead = world.rank == a.ps.servers;

  /* Elastic rounds (ddprun --nnodes MIN:MAX): the latest checkpoint if any,
   * and the global batch kept at a new world (tools/ddp_train/elastic.h). */
  a.resume_path = train_elastic_resume_path(a.resume_path, a.save_path);
  /* Data-parallel replicas: the ranks, or a pipeline's P-stage replicas
   * (0 for the parameter server, whose trainers keep their batch). */
  const int64_t replicas = a.elastic_per_rank || a.ps.servers ? 0 : a.pp ? world.size / a.pp : world.size;
  if (replicas > 0) {
    int changed = 0;
    int64_t was = a.batch_size;
    CHECK(train_elastic_batch(a.resume_path, replicas, &a.batch_size, &changed), "resuming at a new world size");
    if (changed && lead)
      fprintf(stderr, "ddp-train: resuming %s: %lld per replica (not --batch-size %lld) keeps its global "
                      "batch of %lld at %lld replicas\n", a.resume_path, (long long)a.batch_size,
              (long long)was, (long long)(a.batch_size * replicas), (long long)replicas);
  }

  ddp_model *model;
  CHECK(ddp_model_build(a.model, a.activation, a.seed, &model), "building the model");
  if (a.init_path) CHECK(ddp_model_load(model, a.init_path), "loading --init");
  ddp_dataset *train_ds, *test_ds;
  open_datasets(&a, &train_ds, &test_ds);
  check_shapes(model, train_ds, a.model);

  ddp_train_options o = ddp_train_defaults();
  ddp_optim_kind kind = optimizer_kind(a.optimizer);
  o.optim = ddp_optim_defaults(kind);
  if (!isnan(a.lr)) o.optim.lr = a.lr;
  else if (kind == DDP_OPTIM_SGD) o.optim.lr = 0.01;
  o.optim.weight_decay = a.weight_decay;
  if (kind == DDP_OPTIM_SGD) o.optim.sgd.momentum = a.momentum;
  else if (a.momentum != 0)
    cli_die_usage("--momentum applies to sgd only (got --optimizer %s)", a.optimizer);
  o.epochs = a.epochs;
  o.max_steps = a.max_steps;
  o.batch_size = a.batch_size;
  if (a.scheduler) {
    o.step_lr_size = a.step_size;
    o.step_lr_gamma = a.gamma;
  }
  o.seed = a.seed;
  o.workers = a.workers;
  o.sync_bn = a.sync_bn;
  o.replicas = (int32_t)a.replicas;
  o.eval_every = a.eval_every;
  o.patience = a.patience;
  o.log_path = a.log_path;
  o.save_path = a.save_path;
  o.save_every = a.save_every;
  o.resume_path = a.resume_path;
  o.device = choose_device(&a, &world);
  if (o.device.type == DDP_DEVICE_CUDA) {
    /* The rank's threads on the CPUs near its GPU (docs/cuda.md, "CPUs
     * near the GPU"; DDP_GPU_AFFINITY=off leaves them). */
    char near[400];
    if (ddp_bind_near_gpu(o.device.index, near, sizeof near) != DDP_OK)
      fprintf(stderr, "ddp-train: %swarning: %s\n", rank_tag, ddp_last_error());
    else
      DDP_INFO("ddp-train: %s%s", rank_tag, near);
  }
  o.cuda_graph = a.cuda_graph;
  o.bucket_cap_mb = a.bucket_cap_mb;
  o.microbatches = (int32_t)a.microbatches;
  o.zero_stage = (int32_t)a.zero;
  o.comm_hook = a.comm_hook;
  o.powersgd_rank = a.powersgd_rank;
  o.powersgd_start_iter = (int32_t)a.powersgd_start;
  if (a.powersgd_start && !a.powersgd_rank)
    cli_die_usage("--powersgd-start needs --comm-hook powersgd:RANK%s", "");
  o.precision = a.precision_value;
  o.grad_scaler = a.grad_scaler ? parse_grad_scaler(a.grad_scaler) : DDP_TRAIN_GRAD_SCALER_AUTO;
  o.grad_scaler_growth_interval = (int32_t)a.grad_scaler_growth_interval;
  o.sharded_checkpoint = a.sharded_checkpoint;
  o.clip_grad_norm = a.clip_grad_norm;
  ddp_train_pipeline pipeline = {0};
  if (a.pp) {
    if (!world.pg || world.size % a.pp)
      cli_die_usage("--pp %s: the world must be P stages x D replicas: run under a launcher "
                "with a multiple of P ranks (ddprun --nproc-per-node P ...)",
                a.schedule ? a.schedule : "P");
    pipeline.stages = (int32_t)a.pp;
    pipeline.schedule = DDP_PIPELINE_1F1B;
    if (a.schedule && ddp_pipeline_schedule_parse(a.schedule, &pipeline.schedule) != DDP_OK)
      cli_die_usage("--schedule: %s", ddp_last_error());
    pipeline.virtual_stages = a.virtual_stages ? (int32_t)a.virtual_stages
                              : pipeline.schedule == DDP_PIPELINE_INTERLEAVED ? 2
                                                                              : 1;
    pipeline.split = a.split;
    o.pipeline = &pipeline;
    if (!o.microbatches) o.microbatches = (int32_t)a.pp; /* PyTorch's tutorials: M = P at least */
    a.microbatches = o.microbatches;
  }
  char trace_path[4096];
  /* ddprun --trace gives each worker its own file in DDP_TRACE_FILE. */
  const char *trace_env = getenv("DDP_TRACE_FILE");
  o.trace_path = a.trace ? rank_path(a.trace, world.rank, trace_path, sizeof trace_path)
                 : trace_env && *trace_env ? trace_env
                                           : NULL;
  run_meta meta;
  run_meta_init(&meta, &a, &o.optim, replicas);
  o.checkpoint_meta = meta.kv;
  o.checkpoint_meta_count = meta.n;
  tool_view view = {.prog = {.quiet = !lead, .tty = isatty(STDERR_FILENO),
                             .started = ddp_time_s()},
                    .a = &a, .lead = lead, .epochs = a.epochs, .last_loss = NAN,
                    .loss_scale = NAN};
  const char *hold = getenv("DDP_TRAIN_HOLD_FILE");
  view.hold_file = hold && hold[0] ? hold : NULL;
  o.callbacks = (ddp_train_callbacks){on_start, on_step, on_eval, &view};

  /* --param-servers: the servers serve and exit here; the trainers train
   * through their client. */
  if (a.ps.servers && ps.server) exit(train_ps_serve(&ps, model, &o));
  if (a.ps.servers) CHECK(train_ps_start(&ps, &o), "starting the parameter-server trainer");

  /* On every rank: the trainer reduces the callbacks' stop requests over the
   * group; only rank 0 writes. */
  ddp_train_tensorboard *tb = NULL;
  if (a.tensorboard)
    CHECK(ddp_train_tensorboard_attach(&tb, &o, a.tensorboard, world.pg), "opening --tensorboard");
  ddp_trainer *trainer;
  CHECK(ddp_trainer_create(&trainer, model, train_ds, test_ds, world.pg, &o),
        "setting up training");
  if (lead && o.device.type != DDP_DEVICE_CPU) {
    char dev[DDP_DEVICE_STR_BYTES];
    fprintf(stderr, "ddp-train: training on %s%s%s%s%s\n", ddp_device_str(o.device, dev, sizeof dev),
            o.cuda_graph ? ", the step replayed as a CUDA graph" : "",
            world.pg ? ", gradients over backend " : "",
            world.pg ? ddp_process_group_backend(world.pg) : "",
            world.pg && strcmp(ddp_process_group_backend(world.pg), "nccl") != 0
                ? " (staged through pinned host memory)" : "");
  }
  ddp_train_result r;
  ddp_status s = ddp_trainer_run(trainer, &r);
  if (s != DDP_OK) {
    end_progress_line(&view.prog);
    fprintf(stderr, "ddp-train: %serror: %s\n", rank_tag,
            ddp_last_error()[0] ? ddp_last_error() : ddp_strerror(s));
    exit(1);
  }
  end_progress_line(&view.prog);
  CHECK(ddp_train_tensorboard_close(tb), "writing --tensorboard");
  if (lead) {
    fprintf(stderr, "trained %lld steps (%.2f epochs) at %.0f samples/s", (long long)r.steps,
            r.epochs, r.samples_per_s);
    if (world.size > 1) fprintf(stderr, " on %d ranks", world.size);
    fprintf(stderr, "; test loss %.4f", r.test_loss);
    if (!isnan(r.test_accuracy)) fprintf(stderr, ", test accuracy %.2f%%", 100 * r.test_accuracy);
    fputc('\n', stderr);
  }
  if (a.json && lead) print_summary(&a, &r, &view);
  if (a.dump_state) {
    CHECK(ddp_model_to(model, DDP_CPU), "bringing the model back to the CPU for --dump-state");
    dump_state(model, a.dump_state, world.rank);
  }
  ddp_train_result_free(&r);
  ddp_trainer_destroy(trainer);
  ddp_dataset_destroy(test_ds);
  ddp_dataset_destroy(train_ds);
  ddp_model_destroy(model);
  if (a.ps.servers) train_ps_end(&ps, true);
  train_world_destroy(&world);
  return 0;
}
