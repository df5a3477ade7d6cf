/* Internal pieces of the launch layer, shared by ddprun's path (run.c) and
 * ddp_spawn (spawn.c): signal plumbing, worker output, the worker
 * environment, the supervised group of workers, the failure summary and the
 * node agent (store hosting, node rendezvous, restart agreement), reading
 * flight recorder dumps. Also launch's one internal header for the tools
 * (docs/architecture.md): placement (launch/placement.h, included here) and
 * the dump reader. Not installed. */
#ifndef DDP_LAUNCH_INTERNAL_H
#define DDP_LAUNCH_INTERNAL_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "ddp/core.h"
#include "ddp/launch.h"
#include "ddp/store.h"
#include "comm/flight/flight.h"
#include "launch/placement.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP__LAUNCH_DEFAULT_GRACE_S 10.0
#define DDP__LAUNCH_DEFAULT_TAIL 10
#define DDP__LAUNCH_MULTI_NODE_PORT 29500 /* torchrun's default master port */
#define DDP__LAUNCH_C10D_PORT 29400       /* torchrun's default c10d endpoint port */

/* ---- Signals (signals.c) --------------------------------------------------
 * A self-pipe: handlers for SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1 and
 * SIGUSR2 write the signal's number to a pipe that the supervision loop
 * polls, so nothing but write(2) runs in a handler. install saves the
 * previous handlers; restore puts them back and closes the pipe. */
ddp_status ddp__signals_install(void);
void ddp__signals_restore(void);
int ddp__signals_fd(void);
/* Reads the pending signal numbers (at most max) without blocking. */
int ddp__signals_take(int *signals, int max);

/* ---- Output (output.c) ----------------------------------------------------
 * A worker's stdout or stderr arrives through a pipe; complete lines are
 * copied to the console (unless filtered or redirected) and to its log file,
 * and the last lines of both streams are kept for the failure summary. */
typedef struct ddp__tail {
  char **lines;     /* ring of `cap` ddp_alloc'd lines (NULL = empty slot) */
  int32_t cap;
  int32_t next;     /* slot the next line goes to */
  int64_t total;    /* lines seen */
} ddp__tail;

/* Where the workers' output is shown: ddprun's stdout or stderr, written so
 * that supervision never waits on it (a console that stops reading -- a full
 * pipe, a stopped pager, a terminal on Ctrl-S -- must not stop ddprun from
 * tearing a failed job down or from handling a signal). A pipe, FIFO or
 * terminal is written through a non-blocking reopen of /proc/self/fd/N (its
 * own open file description: the shell's stays blocking), a socket with
 * MSG_DONTWAIT, a regular file or block device plainly (those never wait on
 * a reader); when the reopen fails, poll(2) with a zero timeout guards
 * writes of at most PIPE_BUF bytes. */
typedef struct ddp__stream ddp__stream;
typedef struct ddp__console {
  int fd;             /* -1: not shown, or the console went away */
  int owned;          /* fd is our reopen: close it */
  int kind;           /* how fd is written (output.c) */
  ddp__stream *busy;  /* the stream whose line is half written: the others wait */
} ddp__console;

/* Per stream, what the console has not taken yet: up to
 * DDP__CONSOLE_BUFFER bytes of whole lines; when a new line does not fit
 * the oldest lines are dropped, and the console gets one line "[ddprun: N
 * bytes of rank R's output dropped: the console is not reading]" in their
 * place. Log files get every line, written as before. */
#define DDP__CONSOLE_BUFFER (64 * 1024)

struct ddp__stream {
  int fd;           /* read end of the pipe; -1 when closed */
  ddp__console *console; /* NULL when not shown */
  int log_fd;       /* log file, or -1 */
  int32_t rank;     /* for the drop notice */
  size_t partial_len;
  char partial[2048]; /* a line not yet complete (longer lines are cut) */
  char *pend;       /* DDP__CONSOLE_BUFFER bytes, allocated on first use */
  size_t pend_len;  /* bytes waiting */
  size_t pend_sent; /* of them, bytes of the first line already written */
  uint64_t dropped; /* bytes dropped, not yet announced */
  char notice[160];
  size_t notice_len, notice_sent; /* a notice being written */
};

void ddp__console_open(ddp__console *c, int fd);
void ddp__console_close(ddp__console *c);
/* Writes what the stream has waiting as far as the console takes it now;
 * returns 1 while something is still waiting. */
int ddp__stream_flush(ddp__stream *stream);
/* Gives up on what is waiting (announcing it as dropped, if the console
 * takes the notice now) and frees the buffer. */
void ddp__stream_discard(ddp__stream *stream);
/* Writes buf to fd (ddprun's own messages, such as the failure summary)
 * while the console takes it, giving up after stall_s without progress. */
void ddp__console_write_bounded(int fd, const char *buf, size_t len, double stall_s);

ddp_status ddp__tail_init(ddp__tail *tail, int32_t cap);
void ddp__tail_free(ddp__tail *tail);
/* Reads what is available on stream->fd; closes it at end of file. */
void ddp__stream_pump(ddp__stream *stream, ddp__tail *tail);
/* Emits a partial last line (at exit) and closes the fds. */
void ddp__stream_finish(ddp__stream *stream, ddp__tail *tail);

/* Parses a --redirects/--tee value ("3", "0:1,1:2") for local_rank: 0 none,
 * 1 stdout, 2 stderr, 3 both. */
ddp_status ddp__std_spec_for(const char *option, const char *spec, int32_t local_rank, int *out);
/* Whether local_rank's output reaches the console under --local-ranks-filter
 * (a rank set, rank_set.c: "0,2", "0-3" or "all"; NULL or "": every rank). */
ddp_status ddp__filter_allows(const char *spec, int32_t local_rank, int *out);

/* ---- Timelines (trace_merge.c) ------------------------------------------------ */
/* Merges every DIR/rank<N>.json (the trainer's timelines) into
 * DIR/trace.json, a process per rank, times shifted onto the earliest
 * rank's start by each file's CLOCK_REALTIME origin; *ranks: the files
 * merged. Errors name the file and line. */
ddp_status ddp__trace_merge(const char *dir, int *ranks);

/* ---- The worker environment (worker_env.c) --------------------------------- */
typedef struct ddp__world {
  int32_t world_size;
  int32_t rank_offset;      /* global rank of this node's local rank 0 */
  int32_t nproc;            /* workers on this node */
  int32_t nnodes;
  int32_t node_rank;
  char master_addr[DDP_LAUNCH_HOST_BYTES];
  int32_t master_port;
  char store_addr[DDP_LAUNCH_HOST_BYTES + 8]; /* DDP_STORE_ADDR */
  char run_id[DDP_LAUNCH_ID_BYTES];
  int32_t max_restarts;
  int32_t omp_threads;      /* > 0: every worker's OMP_NUM_THREADS (--threads); 0: torchrun's rule */
  const char *trace_dir;    /* --trace: DDP_TRACE_FILE=DIR/rank<N>.json; NULL: none */
  /* DDP_DEBUG_DIR for the workers' flight dumps: the user's, else this
   * run's directory under $TMPDIR (ddp__flight_debug_dir); "": not set. */
  char debug_dir[DDP_LAUNCH_PATH_BYTES];
  /* Elastic jobs: TORCHELASTIC_RESTART_COUNT is the failures of the job so
   * far (the rounds that scale events opened do not count, torchrun's
   * rule), not the attempt's number. */
  int32_t elastic;
  int32_t restarts;
  /* TORCHELASTIC_ERROR_FILE=<error_dir>/attempt_<n>/<local rank>/error.json,
   * where a worker that fails writes its error record (torchrun's @record);
   * the summary reports it. "": not set (ddp_spawn). */
  char error_dir[DDP_LAUNCH_PATH_BYTES];
} ddp__world;

/* The launcher's environment contract, the one list of the variables it
 * owns: torchrun's (RANK, WORLD_SIZE, LOCAL_*, GROUP_*, ROLE_*, MASTER_*,
 * TORCHELASTIC_*) and ddp's (DDP_STORE_ADDR, DDP_STORE_PREFIX,
 * DDP_TRACE_FILE). Whether entry ("NAME=value") is one of them. */
bool ddp__launch_env_owned(const char *entry);
/* A job's environment: `base` (such as environ) without the variables the
 * launcher owns and without those `add` sets, then add[0..n_add) ("NAME=value"
 * each). Everything that starts workers or jobs of its own (ddprun, ddp_spawn,
 * ddp-hpo's cmd: objective) builds their environment here, so none inherits
 * an outer rank's identity, store or trace file. One ddp_alloc'd block
 * (NULL-terminated table and strings): free with ddp_free. */
ddp_status ddp__launch_env(char *const *base, char *const *add, size_t n_add, char ***out);

/* A NULL-terminated "NAME=VALUE" table: `base` (such as environ) without the
 * variables the launcher owns, then torchrun's variables for this worker,
 * DDP_STORE_ADDR and DDP_STORE_PREFIX (per attempt), DDP_DEBUG_DIR (when
 * world->debug_dir is set). OMP_NUM_THREADS is
 * world->omp_threads when that is set (replacing base's); else 1 when base
 * lacks it and nproc > 1, as torchrun does. One ddp_alloc'd
 * block: free with ddp_free. */
ddp_status ddp__worker_env(char *const *base, const ddp__world *world, int32_t local_rank,
                           int32_t attempt, char ***out);
/* The worker's TORCHELASTIC_ERROR_FILE in attempt `attempt`, "" when
 * world->error_dir is "". */
void ddp__error_file_path(const ddp__world *world, int32_t attempt, int32_t local_rank, char *buf, size_t bytes);
/* What a worker's error record (torchrun's error file: {"message":
 * {"message": "...", "extraInfo": {"timestamp": "..."}}} or {"message":
 * "..."}) says, as "<message> (recorded at <UTC time>)" in buf; "" when the
 * file is absent. A file that is not such a record is described as such
 * ("not an error record: ... at offset N"). */
void ddp__error_record_read(const char *path, char *buf, size_t bytes);

/* ---- The supervised group of workers (workers.c) --------------------------- */
typedef struct ddp__worker_spec {
  char **envp;            /* owned by the caller until start returns */
  char **argv;            /* exec: program and arguments; NULL with fn */
  ddp_spawn_fn fn;        /* spawn: run fn(rank, arg) instead of exec */
  void *arg;
  int32_t show[2];        /* stdout, stderr: 1 to copy to the console */
  const cpu_set_t *cpus;  /* bind the child here before exec or fn; NULL: where it inherits */
  char log_path[2][DDP_LAUNCH_PATH_BYTES]; /* "" : no log file */
  char error_path[DDP_LAUNCH_PATH_BYTES];  /* its TORCHELASTIC_ERROR_FILE; "": none */
} ddp__worker_spec;

typedef enum ddp__worker_state {
  DDP__WORKER_IDLE = 0,
  DDP__WORKER_RUNNING = 1,
  DDP__WORKER_EXITED = 2,
} ddp__worker_state;

typedef struct ddp__worker {
  int32_t local_rank;
  int32_t rank;
  pid_t pid;
  ddp__worker_state state;
  int status;             /* waitpid status once exited */
  int failed;             /* 1: it failed on its own (before the group was stopped) */
  int let_go;             /* 1: it failed, but --may-fail let the others go on */
  int64_t exit_wall_ms;   /* CLOCK_REALTIME of the exit, ms */
  double exit_s;          /* monotonic */
  ddp__stream out, err;
  ddp__tail tail;         /* both streams, interleaved as read */
  char error_path[DDP_LAUNCH_PATH_BYTES]; /* its TORCHELASTIC_ERROR_FILE; "": none */
} ddp__worker;

typedef enum ddp__event {
  DDP__EVENT_DONE = 0,     /* every worker exited 0 */
  DDP__EVENT_FAILED = 1,   /* a worker failed: group.first_failure */
  DDP__EVENT_SIGNAL = 2,   /* SIGINT/SIGTERM/SIGHUP arrived: group.stop_signal */
  DDP__EVENT_TIMEOUT = 3,  /* the deadline passed */
  DDP__EVENT_EXTERNAL = 4, /* the poll hook asked to stop (another node failed) */
  DDP__EVENT_ERROR = 5,    /* the poll hook failed (the store is gone) */
  DDP__EVENT_STORE = 6,    /* the store server process hosted here died */
} ddp__event;

/* ---- The store server's process (store_proc.c) -----------------------------
 * The job's store is served by a child of the supervisor, forked before any
 * worker while the supervisor is single-threaded; the supervisor keeps no
 * copy of the server's fds (workers forked later inherit none), watches the
 * child like a worker (SIGCHLD, reap) and stops it last. */
typedef struct ddp__store_proc {
  pid_t pid;    /* 0: none hosted here */
  int exited;   /* 1 once reaped */
  int status;   /* waitpid status once exited; -1 when lost */
  uint16_t port; /* as bound */
  char address[96];  /* "HOST:PORT" as bound (DDP_NET_ADDR_BYTES) */
} ddp__store_proc;

/* Binds a store server on bind_addr:port (0: a free port) in this process,
 * then forks the child that serves it: its own process group, named
 * "ddp-store", SIGKILLed when the supervisor dies (PR_SET_PDEATHSIG),
 * SIGTERM ends it. The caller must be single-threaded. Bind errors as
 * ddp_store_server_create's (DDP_ERR_ADDRINUSE ...). */
ddp_status ddp__store_proc_start(const char *bind_addr, uint16_t port, ddp__store_proc *proc);
/* Reaps it if it has exited (WNOHANG); 1 once it is gone. */
int ddp__store_proc_exited(ddp__store_proc *proc);
/* "the store server process (pid 4711, 127.0.0.1:41234) killed by signal 9
 * (SIGKILL)" (or "exited with code 1", "is running"). */
void ddp__store_proc_describe(const ddp__store_proc *proc, char *buf, size_t bytes);
/* SIGTERM, up to 2 s, SIGKILL, reaped (at most 5 s more). Accepts one that
 * is gone or was never started. */
void ddp__store_proc_stop(ddp__store_proc *proc);
/* Threads of this process (/proc/self/status), -1 when unknown. */
int32_t ddp__thread_count(void);

/* ---- Orphans (orphans.c) ---------------------------------------------------
 * What a worker started outside its process group (setsid, a daemon's double
 * fork) survives the kill of that group. While a group runs the supervisor
 * is a child subreaper, so such a process becomes its child once orphaned;
 * when the group ends, every child the supervisor did not have before is
 * SIGKILLed and reaped, generation after generation. */
#define DDP__ORPHANS_MAX_KEEP 256
typedef struct ddp__orphans {
  int adopting;      /* 1: subreaper set and children listed */
  int was_subreaper; /* restored by release */
  int n_preexisting;
  pid_t preexisting[DDP__ORPHANS_MAX_KEEP]; /* children before the group */
  int n_killed;
  pid_t killed[DDP__ORPHANS_MAX_KEEP];
} ddp__orphans;

/* Becomes a child subreaper and lists the children there are now; without
 * prctl's support or /proc nothing is adopted (kill then does nothing). */
void ddp__orphans_adopt(ddp__orphans *orphans);
/* Whether a child is the caller's own (a worker, the store, the reaper):
 * never taken for an orphan. */
typedef int ddp__orphans_is_own(pid_t pid, void *ctx);
/* SIGKILLs and reaps every child neither listed at adopt nor is_own(pid,
 * ctx), and what they forked, for up to 5 s; returns how many were alive,
 * with the first few as "pid 4711 (sleep), ..." in names. */
int ddp__orphans_kill(ddp__orphans *orphans, ddp__orphans_is_own *is_own, void *ctx, char *names,
                      size_t bytes);
/* Reaps adopted children that have exited (zombies), leaving those
 * is_own(pid, ctx) claims and those listed at adopt to their owners; returns
 * how many. Called in every round of supervision while the group runs, with
 * child_exited 1 when the round took a SIGCHLD: then every exited orphan
 * there is now is reaped, even behind an exited child that is not its to
 * take; otherwise up to 64, stopping at the first such child. */
int ddp__orphans_reap_exited(ddp__orphans *orphans, ddp__orphans_is_own *is_own, void *ctx, int child_exited);
/* Stops being a subreaper unless the process was one before adopt. */
void ddp__orphans_release(ddp__orphans *orphans);

typedef struct ddp__worker_group {
  int32_t n;
  ddp__worker *workers;
  ddp__console console[2]; /* ddprun's stdout and stderr */
  int32_t first_failure;   /* index of the first failed worker, -1 */
  int32_t num_failures;    /* failures before the stop */
  const char *may_fail;    /* --may-fail's rank set (ddp__job's); NULL: none */
  int32_t num_let_go;      /* failures that --may-fail let pass */
  int stop_signal;         /* signal that made the group stop, 0 */
  int stopping;            /* 1 once stop has begun: later exits are not failures */
  double monitor_interval_s;
  int64_t start_wall_ms;
  /* Called at most every monitor_interval_s while running: > 0 stops the
   * group (DDP__EVENT_EXTERNAL), < 0 is an error (DDP__EVENT_ERROR). */
  int (*poll_hook)(void *ctx);
  void *poll_ctx;
  /* The store server process hosted on this node, or NULL: reaped with the
   * workers (first, in each batch: a worker failing because the store went
   * away is its consequence) and its death ends the group
   * (DDP__EVENT_STORE). */
  ddp__store_proc *store;
  int store_died;
  /* The reaper: a process of its own that outlives a SIGKILLed supervisor
   * just long enough to SIGKILL the process groups of the workers it was
   * told about (what they forked: PDEATHSIG kills only the workers). -1 /
   * 0 when it could not be started. */
  int reaper_fd; /* write end of its pipe */
  pid_t reaper_pid;
  ddp__orphans orphans; /* what left the workers' process groups */
  /* The flight recorder's verdict, gathered before the stop (flight_gather.c;
   * ddp_alloc'd, freed with the group), printed in the summary. */
  char *flight_verdict;
} ddp__worker_group;

/* Forks the n workers of `specs` (rank = rank_offset + index). Each worker is
 * its own process group, dies with SIGKILL when the supervisor dies
 * (PR_SET_PDEATHSIG, checked against the race with getppid), has its stdout
 * and stderr on pipes, and default signal dispositions; what a worker forks
 * itself is SIGKILLed by the group's reaper process if the supervisor dies.
 * On failure the workers already started are killed and reaped. */
ddp_status ddp__worker_group_start(ddp__worker_group *group, int32_t n, int32_t rank_offset,
                                   const ddp__worker_spec *specs, int32_t tail_lines);
/* Supervises until an event (see ddp__event), relaying output and forwarding
 * SIGUSR1/SIGUSR2 (and the stopping signals, before returning SIGNAL).
 * deadline_s: monotonic seconds, <= 0 for none. */
ddp__event ddp__worker_group_monitor(ddp__worker_group *group, double deadline_s);
/* Stops every worker still running: `sig` (0: SIGTERM) to each worker's
 * process group, up to grace_s for them to exit (no longer than while some
 * of them are not stopped: a stopped worker acts on nothing but SIGKILL),
 * then SIGKILL; reaps them (waiting at most 5 s more for the kernel) and
 * drains their output. */
void ddp__worker_group_stop(ddp__worker_group *group, int sig, double grace_s);
void ddp__worker_group_free(ddp__worker_group *group);
/* What /proc/<pid>/stat says of a process: 'R', 'S', 'D', 'T' (stopped),
 * 't' (traced), 'Z' (exited, not reaped), ...; 0 when it is gone. */
char ddp__proc_state(pid_t pid);
/* The peer rank a worker's last output says died, in the comm layer's
 * wording ("rank 3 (host) died ..."), or -1: such a worker failed as a
 * consequence, and is not named first when a cause exited in the same reap
 * batch (docs/launch.md, "Which failure is first"). */
int32_t ddp__worker_blamed_rank(const ddp__worker *w);

/* ---- Failure summary (summary.c) ------------------------------------------- */
/* "exited with code 3" / "killed by signal 9 (SIGKILL)". */
void ddp__describe_status(int status, char *buf, size_t bytes);
/* "SIGKILL" (or "SIG<n>"). */
const char *ddp__signal_name(int sig, char *buf, size_t bytes);
/* Writes the failure summary of a stopped group to `f` (see docs/launch.md):
 * `headline` says what happens next ("restarting: attempt 2 of 3"). */
void ddp__summary_print(FILE *f, const char *tool, const ddp__worker_group *group, const char *host,
                        int32_t attempt, const char *headline);
/* One line naming the first failure, for errors and the store:
 * "rank 3 (local rank 3, pid 4711) on host h: killed by signal 9 (SIGKILL)". */
void ddp__summary_first(const ddp__worker_group *group, const char *host, char *buf, size_t bytes);

/* ---- Slurm (slurm.c) ------------------------------------------------------- */
/* The value of `name` in a "NAME=VALUE" table, or NULL (empty counts as unset). */
const char *ddp__envp_get(char *const *envp, const char *name);

/* ---- Node agent (agent.c) -------------------------------------------------- */
typedef struct ddp__agent {
  ddp__store_proc server;   /* the store's process, when hosted here (pid > 0) */
  ddp_store *store;         /* agent keys, prefixed "ddprun/<run id>/"; NULL on one node */
  ddp__world world;
  char host[DDP_LAUNCH_HOST_BYTES];
  char store_prefix[DDP_LAUNCH_ID_BYTES + 16];
  double rdzv_timeout_s;
  double monitor_interval_s;
  int32_t attempt;          /* the attempt being polled */
  int32_t read_outcome;     /* 1 once this node read an attempt's outcome */
  char remote_failure[512]; /* another node's first failure, when it stopped us */
  /* Liveness of the other nodes while waiting for them: each agent add()s to
   * node/<r>/beat at every poll; a node whose count stays still for
   * silence_limit_s is declared gone (its ddprun died or hangs). */
  int64_t *beats;           /* last count seen per node */
  double *beat_seen_s;      /* when it last changed (monotonic) */
  double silence_limit_s;
  /* Elastic jobs (--nnodes MIN:MAX; elastic.c): the bounds, torchrun's
   * timeouts, and what this node knows of the current round (its number
   * is `attempt`, this node's slot world.node_rank, its size world.nnodes). */
  int32_t elastic_min;      /* 0: not elastic */
  int32_t elastic_max;
  double last_call_s;
  int scale_event;          /* 1: the poll stopped the workers for a node that arrived */
  int stop_signal;          /* a SIGINT/SIGTERM/SIGHUP that ended a wait of the rendezvous, 0 */
  double next_beat_check_s; /* monotonic: when the poll next reads the others' beats */
  char (*node_hosts)[64];   /* per slot of the round: the host it named */
  char node_addr[DDP_LAUNCH_HOST_BYTES]; /* --master-addr: this node's address for MASTER_ADDR when it is slot 0 */
  /* Elastic: a store watch on the running round's keys (its failure, the
   * next round's arrivals, its ended count, its rescaled mark, the other
   * nodes' beats), so that nothing polls the store while workers run; what
   * it reported so far. */
  ddp_store_watcher *round_watch;
  int watch_failed;         /* attempt/<k>/failed exists */
  int watch_arrived;        /* round/<k+1>/arrivals exists */
  int watch_rescaled;       /* round/<k>/rescaled exists */
  int64_t watch_ended;      /* round/<k>/ended */
} ddp__agent;

/* Hosts the store (one node: on a port of its own on 127.0.0.1; several: at
 * the rendezvous endpoint) or joins it, agrees on node ranks and the world,
 * and fills agent->world. */
ddp_status ddp__agent_open(const ddp_launch_config *cfg, ddp__agent *agent);
/* The group's poll hook: beats, and > 0 when another node declared `attempt`
 * failed; < 0 when the store is gone. */
int ddp__agent_poll(void *agent);
/* Declares `attempt` failed with `failure` now (several nodes; the first
 * declaration stands), before this node stops its workers: the other nodes
 * stop theirs at their next poll, asking them to dump their flight
 * recorders while this node waits for the dumps. */
void ddp__agent_announce_failure(ddp__agent *agent, int32_t attempt, const char *failure);
/* Ends an attempt on this node: publishes this node's failure (when
 * `failure` is non-NULL), waits for every node to end it (monitoring the
 * store; deadline_s as in monitor), and says whether any node failed. */
ddp_status ddp__agent_end_attempt(ddp__agent *agent, int32_t attempt, const char *failure,
                                  double deadline_s, int *any_failed);
/* Waits (bounded) until every node has read the outcome, then stops the
 * store when hosted here. Accepts a zeroed agent. */
void ddp__agent_close(ddp__agent *agent);

/* ---- Elastic rounds (elastic.c) --------------------------------------------
 * --nnodes MIN:MAX with c10d: the nodes meet in numbered rounds; round k
 * closes at MAX nodes, or at >= MIN once last_call_s passed without another
 * arrival; a node arriving after the close waits for round k+1, whose first
 * arrival makes the running nodes stop their workers (a scale event). */
/* Joins round `round` or a later one (the first still open), waits for it
 * to close (below MIN: at most --rdzv-timeout, then an error saying so),
 * and fills agent->world (node rank = slot, the round's nodes and world
 * size, MASTER_*, the restart count) and agent->attempt. */
ddp_status ddp__elastic_join(ddp__agent *agent, int32_t round, double deadline_s);
/* The group's poll hook in an elastic job: beats; > 0 when the round
 * failed on another node, a node of the round went silent (announced as the
 * round's failure), or a node arrived for the next round while this one has
 * fewer than MAX (agent->scale_event = 1); < 0 when the store is gone. */
int ddp__elastic_poll(void *agent);
/* After this node's workers of round `round` all succeeded: waits for the
 * round's other nodes. *outcome: 0 the job is done, 1 the round failed
 * elsewhere (agent->remote_failure), 2 a scale event re-forms the group. */
ddp_status ddp__elastic_finish(ddp__agent *agent, int32_t round, double deadline_s, int *outcome);
/* Whether a node of round `round` stopped its workers for a scale event:
 * a worker failing meanwhile lost a peer to it (not a failure). */
int ddp__elastic_rescaling(ddp__agent *agent, int32_t round);
/* Tells the round's other nodes this node's workers are gone (failed, or
 * stopped for a scale event) so none waits for them. */
void ddp__elastic_leave(ddp__agent *agent, int32_t round, int rescaled);
/* Ends the job for every node waiting in round `round` (no restarts left, a
 * stop): they return from join with `reason`. */
void ddp__elastic_abort(ddp__agent *agent, int32_t round, const char *reason);

/* ---- The flight recorder (flight_gather.c) ----------------------------------
 * Called before the group is stopped (a worker failed, the job timed out,
 * another node failed): SIGUSR1 to each running worker that catches it (a
 * ddp program that records), then up to 3 s for their dumps to reach the
 * job's store (fresh ones: the per-rank dump count went up), the worker to
 * exit or be found stopped; with `judge`, also for the other nodes' ranks,
 * and then every rank's dump is read (the store; a local worker's file when
 * the store lacks it) and judged (comm/flight/flight.h). Returns the verdict, a
 * heading line then the findings (ddp_alloc'd; the caller frees), or NULL
 * when there is nothing to say: not judging, or no worker records. */
char *ddp__flight_gather(ddp__worker_group *group, const ddp__agent *agent, int32_t attempt, int judge);
/* Writes the verdict as "<tool>: <heading>" and "<tool>:   <finding>" lines. */
void ddp__flight_print(FILE *f, const char *tool, const char *text);

/* ---- Attempts and restarts (supervise.c) ------------------------------------ */
/* ---- Sets of ranks (rank_set.c): "all" or "0,3-5" --------------------------- */
/* DDP_OK when spec is such a set; else an error naming option and spec. */
ddp_status ddp__rank_set_check(const char *option, const char *spec);
/* 1 when rank is in the set (checked before; NULL is the empty set). */
int ddp__rank_set_contains(const char *spec, int32_t rank);

typedef struct ddp__job {
  const char *tool;            /* "ddprun" or "ddp_spawn", for messages */
  const char *may_fail;        /* --may-fail: ranks whose failure stops nothing; NULL: none */
  ddp__agent *agent;           /* set by ddp__job_launch */
  int32_t max_restarts;
  int32_t tail_lines;
  int32_t quiet;               /* no summary */
  double grace_s;
  double monitor_interval_s;
  double deadline_s;           /* monotonic; <= 0: none */
  /* Fills the world->nproc specs of attempt `attempt`; free_specs releases
   * what it allocated (also after a failed make_specs). */
  ddp_status (*make_specs)(void *ctx, const ddp__world *world, int32_t attempt,
                           ddp__worker_spec *specs);
  void (*free_specs)(void *ctx, const ddp__world *world, ddp__worker_spec *specs);
  void *ctx;
  /* Where the workers run: decided by ddp__job_launch from cfg (--bind,
   * --threads) before the first attempt; every attempt binds the same way. */
  ddp__placement placement;
  int32_t report_bindings;     /* each worker's CPUs on stderr as it starts */
  /* Where the workers' TORCHELASTIC_ERROR_FILEs go: NULL none; "" a folder
   * "errors" in the run's DDP_DEBUG_DIR; else this folder (ddprun: the log
   * directory's run folder, as torchrun). */
  const char *error_dir;
  char *error_dir_out;         /* out, when set: the folder chosen for them ("" none) */
  size_t error_dir_out_bytes;
  char failure[640];           /* out: the job's first failure, "" when none */
} ddp__job;

/* Runs attempts until one succeeds, restarts are used up, a stopping signal
 * arrives or the deadline passes. *exit_code: 0 success, 1 failure or
 * timeout, 128+signal when stopped by a signal. *event: how the last attempt
 * ended. Returns an error when the job could not be run (start, store). The
 * caller installs the signal pipe first. */
ddp_status ddp__job_run(ddp__job *job, int *exit_code, ddp__event *event);
/* The same for an elastic job: rounds until the job ends (elastic_job.c). */
ddp_status ddp__job_run_elastic(ddp__job *job, int *exit_code, ddp__event *event);
/* The pieces of an attempt that ddp__job_run and ddp__job_run_elastic share
 * (supervise.c). Starts attempt `attempt`'s workers into *g (zeroed here);
 * on failure *g holds nothing to stop. */
ddp_status ddp__job_start_group(ddp__job *job, int32_t attempt, ddp__worker_spec *specs, ddp__worker_group *g);
/* Stops the group after `ev` and writes this node's failure line (""
 * when it has none: done, or another node's failure); STOP_MARK-prefixed
 * when no restart may follow. */
void ddp__job_stop(ddp__job *job, ddp__worker_group *g, int32_t attempt, ddp__event ev, char *failure,
                   size_t bytes);
#define DDP__STOP_MARK "stop: "
/* The failure summary on stderr, without waiting on a console that stopped reading. */
void ddp__job_print_summary(const char *tool, const ddp__worker_group *g, const char *host, int32_t attempt,
                            const char *headline);

/* The whole of a job on this node, for ddprun and ddp_spawn alike: opens the
 * node agent for cfg (store, node rendezvous), decides where the workers run
 * (cfg->bind, saying once on stderr when it leaves them unbound), installs the signal pipe once
 * the nodes have met (before, Ctrl-C keeps its default action and ends a
 * node rendezvous at once), runs the attempts, closes the agent and restores
 * the signal handlers. job->deadline_s counts from the call. */
ddp_status ddp__job_launch(const ddp_launch_config *cfg, ddp__job *job, double timeout_s,
                           int *exit_code, ddp__event *event);

/* A free TCP port on this host (bound and released: another process may take
 * it before the worker does, as with torchrun). */
ddp_status ddp__free_port(const char *bind_addr, int32_t *port);

/* The store prefix of attempt `attempt`'s workers. */
void ddp__attempt_prefix(const char *run_id, int32_t attempt, char *buf, size_t bytes);

/* ---- Flight recorder dumps (flight_read.c) ---------------------------------
 * Reading the dumps (the JSON that src/comm/flight_dump.c writes;
 * docs/comm.md, "Flight recorder") back into the model of comm/flight/flight.h, for
 * ddprun's verdict and `ddp-debug flight`. With io's JSON parser: every
 * field checked for its kind and range before use. */

/* Parses text[0..len) into *dump (free with ddp__flight_dump_free). `what`
 * names the source in errors ("/tmp/ddp-flight-rank2.json", "rank 2's dump
 * in the store"). DDP_ERR_FORMAT naming the field (and the offset for JSON
 * errors) when it is not a dump of this format and version; *dump is then
 * empty. */
ddp_status ddp__flight_parse(const char *text, size_t len, const char *what, ddp__flight_dump *dump);

/* Reads and parses the file at path (at most 1 GiB). */
ddp_status ddp__flight_read_file(const char *path, ddp__flight_dump *dump);

#ifdef __cplusplus
}
#endif
#endif /* DDP_LAUNCH_INTERNAL_H */
