/* ddprun: the launcher (torchrun's options): starts nproc-per-node workers on
 * this node, hosts ddp's store for them, supervises and restarts them.
 * Everything but the command line and exit() lives in src/launch/. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/launch.h"

extern char **environ;

static const char usage[] =
    "usage: ddprun [options] PROGRAM [ARGS...]\n"
    "\n"
    "Starts PROGRAM as the workers of a distributed job on this node, with the\n"
    "environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)\n"
    "plus DDP_STORE_ADDR, the store ddprun hosts for ddp programs. A PROGRAM\n"
    "ending in .py runs with $PYTHON (default: python3 from PATH); anything\n"
    "else is executed directly. Every option also has an underscore spelling\n"
    "(--nproc_per_node) and takes its value as --opt VALUE or --opt=VALUE.\n"
    "\n"
    "Workers:\n"
    "  --nproc-per-node N|auto|cpu|gpu  workers on this node (default 1; auto:\n"
    "                        the GPUs if any, else the CPUs)\n"
    "  --no-python           execute PROGRAM directly even if it ends in .py\n"
    "  -m, --module          run PROGRAM as a Python module (python -m)\n"
    "  --pass-local-rank     give PROGRAM --local-rank=N (torch.distributed.launch)\n"
    "\n"
    "Nodes (one node when none is given):\n"
    "  --nnodes N|MIN:MAX    nodes in the job; MIN:MAX: elastic (c10d), rounds of\n"
    "                        MIN..MAX nodes (docs/launch.md, \"Elastic jobs\")\n"
    "  --node-rank R         this node's rank (static rendezvous; default 0)\n"
    "  --master-addr HOST    node 0's address (default 127.0.0.1)\n"
    "  --master-port P       one node: MASTER_PORT (default: a free port);\n"
    "                        several: where node 0 hosts the store (default 29500)\n"
    "  --rdzv-backend static|c10d  static: --node-rank; c10d: ranks by arrival\n"
    "  --rdzv-endpoint HOST[:PORT] where the store is (c10d default port 29400)\n"
    "  --rdzv-id ID          the job's name (TORCHELASTIC_RUN_ID; default none)\n"
    "  --rdzv-conf K=V,...   join_timeout, last_call_timeout (30), keep_alive_interval\n"
    "                        (5), keep_alive_max_attempt (3); the rest ignored\n"
    "  --rdzv-timeout S      how long nodes wait for each other (default 900)\n"
    "  --standalone          one node, a random run id and a free port\n"
    "  Inside a Slurm allocation (SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID and\n"
    "  SLURM_JOB_NODELIST set) and without --nnodes/--node-rank, the nodes, this\n"
    "  node's rank and the master come from Slurm: srun ddprun ... on every node.\n"
    "\n"
    "Placement (where the workers run):\n"
    "  --bind auto|core|socket|hwthread|none  auto (default): cores of its own for\n"
    "                        each worker when this process may use at least\n"
    "                        workers x threads CPUs, spread over the packages;\n"
    "                        else, and under srun, left to the scheduler (Slurm)\n"
    "                        with a note. core: the same, an error when too few;\n"
    "                        socket: a whole package each; none: never bind.\n"
    "                        Also --bind-to (mpirun) and --numa-binding (torchrun:\n"
    "                        node, socket, exclusive)\n"
    "  --threads N           threads each worker runs: N CPUs each, and the\n"
    "                        workers' OMP_NUM_THREADS=N (default: OMP_NUM_THREADS\n"
    "                        if set, else 1)\n"
    "  --report-bindings     print each worker's CPUs on stderr as it starts\n"
    "\n"
    "Supervision:\n"
    "  --max-restarts N      restart the whole group after a failure, N times\n"
    "  --monitor-interval S  how often nodes check the store (default 0.1)\n"
    "  --grace-period S      SIGTERM -> SIGKILL when stopping workers (default 10)\n"
    "  --job-timeout S       stop the job after S seconds (default: no limit)\n"
    "  --tail-lines N        lines of output shown per failed worker (default 10)\n"
    "  --may-fail RANKS      these global ranks (1,3-5 or all) may fail without\n"
    "                        stopping the others: each failure is told on stderr\n"
    "                        and the exit status counts the other ranks only\n"
    "\n"
    "Output (the console gets every worker's stdout and stderr unless told):\n"
    "  --log-dir DIR         also write DIR/RUN_ID/attempt_N/LOCAL_RANK/std{out,err}.log\n"
    "  -r, --redirects 0-3|R:N,...  send stdout (1), stderr (2), both (3) to the\n"
    "                        log files only (a temporary dir without --log-dir)\n"
    "  -t, --tee 0-3|R:N,... write them to the log files and the console\n"
    "  --local-ranks-filter R,...  only these local ranks reach the console (0,2 or 0-3)\n"
    "  --trace DIR           each worker a timeline file: DDP_TRACE_FILE=DIR/rank<N>.json\n"
    "                        (ddp-train writes it), merged after the job into\n"
    "                        DIR/trace.json (Perfetto, chrome://tracing), a process\n"
    "                        per rank, clocks aligned on CLOCK_REALTIME\n"
    "  -h, --help            this text\n"
    "  --version             print \"ddprun (ddp) VERSION\" (before PROGRAM and\n"
    "                        before any option's separate value)\n"
    "\n"
    "When a worker fails, ddprun stops the others (SIGTERM, grace period,\n"
    "SIGKILL), prints a summary on stderr naming the first failure (rank, host,\n"
    "pid, exit code or signal, its last lines of output) and restarts the group\n"
    "if restarts are left. SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are\n"
    "forwarded to the workers; workers die with ddprun, even if it is SIGKILLed.\n"
    "\n"
    "Exit status: 0 when every worker exited 0 (or failed under --may-fail);\n"
    "1 when the job failed; 2 on bad usage; 128+N when stopped by signal N.\n"
    "docs/launch.md has the details.\n";

/* --version among ddprun's leading options. The scan stops at the first
 * word that is not an option (an option's separate value, or PROGRAM), so
 * it never takes PROGRAM's own --version. */
static int asks_version(int argc, char **argv) {
  for (int i = 1; i < argc && argv[i][0] == '-'; i++)
    if (strcmp(argv[i], "--version") == 0) return 1;
  return 0;
}

int main(int argc, char **argv) {
  if (asks_version(argc, argv)) {
    printf("ddprun (ddp) %s\n", ddp_version());
    return 0;
  }
  ddp_launch_config cfg = ddp_launch_defaults();
  if (ddp_launch_parse_args(argc, argv, &cfg) != DDP_OK) {
    fprintf(stderr, "ddprun: %s\n(see ddprun --help)\n", ddp_last_error());
    return 2;
  }
  if (cfg.help) {
    fputs(usage, stdout);
    return 0;
  }
  int applied = 0;
  if (ddp_launch_apply_slurm(&cfg, environ, &applied) != DDP_OK) {
    fprintf(stderr, "ddprun: %s\n", ddp_last_error());
    return 2;
  }
  /* A console that goes away (ddprun ... | head) must not kill the job; the
   * workers get SIGPIPE's default action back before they start. */
  signal(SIGPIPE, SIG_IGN);
  int code = 1;
  if (ddp_launch_run(&cfg, &code) != DDP_OK) {
    fprintf(stderr, "ddprun: %s\n", ddp_last_error());
    exit(code ? code : 1);
  }
  return code;
}
