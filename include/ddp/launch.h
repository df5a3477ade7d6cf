/* ddp launch: starting and supervising the worker processes of a job, as
 * torchrun (ddprun) and torch.multiprocessing.spawn (ddp_spawn) do. The
 * launcher hosts ddp's store, gives every worker torchrun's environment
 * (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... and DDP_STORE_ADDR), tears
 * the whole group down when one worker fails, prints which worker failed
 * first and why, and restarts the group when asked. docs/launch.md has the
 * options, the variables and the summary's format. */
#ifndef DDP_LAUNCH_H
#define DDP_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ddp_launch_rdzv_backend {
  DDP_LAUNCH_RDZV_STATIC = 0, /* node ranks given (--node-rank) */
  DDP_LAUNCH_RDZV_C10D = 1,   /* node ranks by order of arrival at the store */
} ddp_launch_rdzv_backend;

/* Where each worker runs (--bind, docs/launch.md "Where the workers run").
 * AUTO, the default: cores of its own for every worker when the CPUs this
 * process may use (sched_getaffinity) number at least workers x threads per
 * worker, spread over the packages; otherwise left to the scheduler, with a
 * note on stderr (once per process). Under srun (SLURM_STEP_ID or
 * SLURM_CPU_BIND set) AUTO leaves Slurm's binding as it is. */
typedef enum ddp_launch_bind {
  DDP_LAUNCH_BIND_AUTO = 0,
  DDP_LAUNCH_BIND_NONE = 1,     /* the scheduler places every worker */
  DDP_LAUNCH_BIND_CORE = 2,     /* cores of its own (hardware threads where cores are too few); an error when CPUs are too few */
  DDP_LAUNCH_BIND_SOCKET = 3,   /* every CPU of one package, the workers spread over the packages */
  DDP_LAUNCH_BIND_HWTHREAD = 4, /* hardware threads of its own, SMT siblings counted apart */
} ddp_launch_bind;

#define DDP_LAUNCH_HOST_BYTES 256
#define DDP_LAUNCH_ID_BYTES 128
#define DDP_LAUNCH_PATH_BYTES 4096
#define DDP_LAUNCH_SPEC_BYTES 256

/* What ddprun's command line says (torchrun's options). Start from
 * ddp_launch_defaults(), then ddp_launch_parse_args (or set the fields
 * directly). `program` and `args` borrow from argv. */
typedef struct ddp_launch_config {
  int32_t nproc_per_node;  /* workers on this node, >= 1 */
  int32_t nnodes;          /* nodes of the job, >= 1 */
  int32_t node_rank;       /* this node's rank; -1: not given (0, or by arrival with c10d) */
  int32_t nodes_given;     /* 1: --nnodes or --node-rank was on the command line */
  char master_addr[DDP_LAUNCH_HOST_BYTES]; /* "" : not given */
  int32_t master_port;     /* 0: not given (one node: a free port; several: 29500) */
  char rdzv_endpoint[DDP_LAUNCH_HOST_BYTES + 8]; /* "host[:port]"; "": not given */
  char rdzv_id[DDP_LAUNCH_ID_BYTES];             /* TORCHELASTIC_RUN_ID; "none" by default */
  ddp_launch_rdzv_backend rdzv_backend;
  int32_t standalone;      /* --standalone: one node, a random run id, a free port */
  int32_t max_restarts;    /* restarts of the whole group after a failure, >= 0 */
  double monitor_interval_s; /* how often the node agents look at the store (> 0) */
  double grace_s;            /* SIGTERM -> SIGKILL when stopping workers (>= 0) */
  double rdzv_timeout_s;     /* how long nodes wait for each other (> 0) */
  double job_timeout_s;      /* the whole job, every attempt; <= 0: no limit */
  char log_dir[DDP_LAUNCH_PATH_BYTES]; /* "": none (a temporary one for --redirects/--tee) */
  /* --redirects / --tee: "3", or per local rank "0:1,1:2"; 1 stdout, 2 stderr,
   * 3 both, 0 none. Redirected streams go to the log dir only; teed ones to
   * the log dir and the console. */
  char redirects[DDP_LAUNCH_SPEC_BYTES];
  char tee[DDP_LAUNCH_SPEC_BYTES];
  /* --local-ranks-filter "0,2": only these local ranks' output reaches the
   * console ("" : all). Their output still reaches the log dir and the tails. */
  char local_ranks_filter[DDP_LAUNCH_SPEC_BYTES];
  int32_t no_python;       /* execute the program directly even if it ends in .py */
  int32_t module;          /* -m: run the program as a Python module (python -m) */
  int32_t pass_local_rank; /* give the program --local-rank=N (torch.distributed.launch) */
  int32_t help;            /* --help was given */
  int32_t tail_lines;      /* lines of each worker's output kept for the summary */
  const char *program;
  char *const *args;       /* program arguments after the program */
  int32_t num_args;
  int32_t bind;            /* ddp_launch_bind (--bind, --bind-to, --numa-binding); 0: AUTO */
  int32_t report_bindings; /* --report-bindings: each worker's CPUs on stderr as it starts */
  int32_t threads_per_worker; /* --threads N: CPUs each worker needs, and its OMP_NUM_THREADS;
                                 0: $OMP_NUM_THREADS for the placement, else 1 */
  /* --trace DIR: each worker gets DDP_TRACE_FILE=DIR/rank<N>.json, and
   * after the job the rank files found there are merged into
   * DIR/trace.json (docs/debugging.md, "Timeline"). NULL: none. Borrowed
   * (from argv). */
  const char *trace_dir;
  /* --may-fail RANKS: these global ranks ("1,3-5", or "all") may fail (an
   * exit code, a signal) without stopping the others: each such exit is
   * told on stderr, and the job's result counts only the other ranks (a
   * parameter server's trainers, docs/ps.md). Their peers must survive the
   * loss themselves (a process group's operations with such a rank fail).
   * NULL: none. Borrowed (from argv). */
  const char *may_fail;
  /* Elastic membership (--nnodes MIN:MAX with MIN < MAX, c10d only; docs/launch.md
   * "Elastic jobs"): min_nnodes is MIN (0: not elastic, nnodes nodes exactly);
   * nnodes is then MAX. A round of the node rendezvous closes at MAX nodes, or
   * at >= MIN once last_call_timeout_s passed without another arrival. A node
   * whose agent stays silent for keep_alive_s is taken for dead. */
  int32_t min_nnodes;
  int32_t reserved_int;
  double last_call_timeout_s; /* --rdzv-conf last_call_timeout; torchrun's 30 s */
  double keep_alive_s;        /* keep_alive_interval x keep_alive_max_attempt; torchrun's 5 x 3 s */
  uint64_t reserved[2];
} ddp_launch_config;
DDP_STRUCT_SIZE(ddp_launch_config, 5688);

/* The defaults: one worker on one node, static rendezvous, no restarts,
 * monitor every 0.1 s, 10 s grace, 900 s node rendezvous timeout, run id "none". */
ddp_launch_config ddp_launch_defaults(void);

/* Parses ddprun's command line (argv[0] is the tool's name) into *cfg, which
 * must hold the defaults. Every option has both spellings (--nproc-per-node and
 * --nproc_per_node) and both forms (--opt VALUE and --opt=VALUE). Options end
 * at the program, whose arguments are left untouched. Errors name the option
 * and the value ("--nnodes 3:2: MIN 3 is above MAX 2"). --help sets cfg->help and returns DDP_OK without a program. */
ddp_status ddp_launch_parse_args(int argc, char *const *argv, ddp_launch_config *cfg);

/* Inside a Slurm allocation (SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID and
 * SLURM_JOB_NODELIST (or SLURM_NODELIST) all in `envp`, a NULL-terminated
 * "NAME=VALUE" table such as environ) and with neither --nnodes nor
 * --node-rank given, sets nnodes, node_rank and (unless given) master_addr =
 * the first host of the node list. *applied is 1 when it did. A variable that
 * is present but malformed is an error naming it. */
ddp_status ddp_launch_apply_slurm(ddp_launch_config *cfg, char *const *envp, int *applied);

/* Runs the job on this node: hosts or joins the store, starts the workers,
 * supervises them, restarts the group up to max_restarts times, and returns
 * when it is over. *exit_code: 0 when every worker of the last attempt
 * exited 0; 1 when the job failed (the summary went to stderr); 128+signal
 * when ddprun was stopped by SIGINT, SIGTERM or SIGHUP. The return value is
 * an error only when the launch itself failed (bad configuration, the store,
 * the node rendezvous): then *exit_code is 1 and the message says why. */
ddp_status ddp_launch_run(const ddp_launch_config *cfg, int *exit_code);

/* ---- ddp_spawn: torch.multiprocessing.spawn ------------------------------
 * Forks `nprocs` workers of the calling program; each runs fn(rank, arg) with
 * torchrun's environment set (so ddp_init_process_group("env://") works, and
 * meets in a store served by a child process that ddp_spawn forks first and
 * stops last), and exits with fn's return value.
 * The caller is supervised like ddprun's workers: the first failure (non-zero
 * return, a signal) stops the others and prints the summary on stderr.
 *
 * The workers are forked, not executed: they see a copy of the caller's memory
 * at the call (as mp.spawn's "fork" start method), and only the calling thread.
 * So the caller must be single-threaded when it calls ddp_spawn (as with
 * mp.spawn's fork method): a worker forked while another thread held a lock
 * (malloc's, stdio's) would wait on it forever (DDP_LOG_LEVEL=debug notes
 * other threads; OpenBLAS's idle pool stops itself around fork, so it is
 * safe). The workers hold none of the store server's fds.
 * Each worker is placed as ddprun's are (opts->bind, ddp_launch_bind): bound
 * in the child before fn runs, so every thread it starts inherits the CPUs.
 * While it runs, ddp_spawn handles SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1
 * and SIGUSR2 (forwarding them to the workers) and restores the caller's
 * handlers before returning. It also makes the caller a child subreaper for
 * the time (PR_SET_CHILD_SUBREAPER, restored after): what the workers started
 * outside their process groups (setsid) is adopted, reaped if it exits
 * meanwhile and SIGKILLed at the end; the caller's own children from before
 * the call are left alone (docs/launch.md), but a child another thread of the
 * caller forks during the call is taken for such an orphan.
 * Not reentrant: one ddp_spawn per process at a time. */
typedef int (*ddp_spawn_fn)(int rank, void *arg);

/* Start from ddp_spawn_defaults(); NULL wherever options are taken means
 * the defaults. */
typedef struct ddp_spawn_options {
  double timeout_s;      /* the whole job; <= 0: no limit */
  double grace_s;        /* SIGTERM -> SIGKILL; < 0: the default (10 s) */
  int32_t max_restarts;  /* restarts of the whole group after a failure */
  int32_t tail_lines;    /* lines of output kept per worker for the summary; 0: 10 */
  int32_t quiet;         /* 1: do not print the summary (the error still says who failed) */
  int32_t bind;          /* ddp_launch_bind; 0: AUTO (cores of its own when there are enough) */
  int32_t report_bindings; /* 1: each worker's CPUs on stderr as it starts */
  int32_t threads_per_worker; /* CPUs each worker needs (and its OMP_NUM_THREADS); 0: $OMP_NUM_THREADS, else 1 */
  uint64_t reserved[7];
} ddp_spawn_options;
DDP_STRUCT_SIZE(ddp_spawn_options, 96);

/* The defaults: no timeout, grace 10 s, no restarts, tail 10 lines, the
 * summary printed, placement AUTO, no report, threads_per_worker 0. */
ddp_spawn_options ddp_spawn_defaults(void);

/* Returns DDP_OK when every worker returned 0. Otherwise DDP_ERR_PEER (a
 * worker failed: the message names the first, "rank 2 (pid 4711) exited with
 * code 3"), DDP_ERR_TIMEOUT (timeout_s passed), DDP_ERR_ABORTED (a SIGINT,
 * SIGTERM or SIGHUP arrived), DDP_ERR_CLOSED (the store's process died: the
 * message names it, "the store server process (pid 4712, 127.0.0.1:41234)
 * killed by signal 9 (SIGKILL)"), or the error that kept it from starting.
 * Every worker is gone when it returns. opts may be NULL. */
ddp_status ddp_spawn(int32_t nprocs, ddp_spawn_fn fn, void *arg, const ddp_spawn_options *opts);

/* Moves every thread of this process to the CPUs near GPU cuda:`cuda_index`
 * (docs/cuda.md, "CPUs near the GPU"): of the CPUs it may run on now, those
 * of the GPU's NUMA node; when none of them is, every CPU of that node. The
 * machine tells through /sys/bus/pci/devices/<the GPU's PCI address>/
 * local_cpulist; where it does not (or a build without CUDA, or no such
 * GPU) nothing changes and report says why. $DDP_GPU_AFFINITY=off (or 0,
 * none) turns it off. report (NULL ok) gets one line saying what was done.
 * Fails only when the kernel refuses the new CPUs (sched_setaffinity's
 * errno named); the process then runs where it ran. Call it at start-up,
 * once the rank's GPU is known (ddp-train --device cuda does). */
ddp_status ddp_bind_near_gpu(int cuda_index, char *report, size_t bytes);

#ifdef __cplusplus
}
#endif
#endif /* DDP_LAUNCH_H */
