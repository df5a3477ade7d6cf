/* Where the workers of a launcher run (placement.c): the CPUs this process
 * may use, their topology (packages, cores, SMT siblings) from sysfs, and the
 * plan that gives each worker CPUs of its own. Shared by ddprun, ddp_spawn and
 * ddp-bench, which bind each worker in the child before it runs anything.
 * Not installed. */
#ifndef DDP_LAUNCH_PLACEMENT_H
#define DDP_LAUNCH_PLACEMENT_H

#include <sched.h>
#include <stdint.h>
#include <stdio.h>

#include "ddp/core.h"
#include "ddp/launch.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DDP__MAX_CPUS CPU_SETSIZE /* 1024: what a cpu_set_t holds */

/* Parses a kernel CPU list ("0-3,8,10-11", a trailing newline allowed) into
 * *set. DDP_ERR_INVALID names the text when it is not one (empty, a range
 * going down, a CPU at or above DDP__MAX_CPUS). */
/* Reads a small sysfs file into buf (NUL-terminated); 0 when it cannot. */
int ddp__read_small_file(const char *path, char *buf, size_t bytes);
ddp_status ddp__cpulist_parse(const char *text, cpu_set_t *set);
/* The list form of set ("0-3,8"; "" when empty), cut to fit `bytes`. */
void ddp__cpulist_format(const cpu_set_t *set, char *buf, size_t bytes);

/* The CPUs a process may use, each with its core (the lowest CPU number among
 * its SMT siblings) and package, ascending by CPU number. */
typedef struct ddp__cpu_topo {
  int32_t cpu;
  int32_t core;
  int32_t package;
} ddp__cpu_topo;

typedef struct ddp__topology {
  int32_t n;
  ddp__cpu_topo cpus[DDP__MAX_CPUS];
} ddp__topology;

/* Fills *topo with the CPUs of `allowed`, reading
 * ROOT/cpuN/topology/{core_cpus_list or thread_siblings_list,
 * physical_package_id} (root NULL: /sys/devices/system/cpu). A CPU whose
 * files cannot be read is a core of its own in package 0 (a container
 * without /sys), so a plan can always be made. */
void ddp__topology_read(const char *root, const cpu_set_t *allowed, ddp__topology *topo);

/* What a launcher does with its workers' CPUs. Caller-allocated; filled by
 * plan or decide, emptied by free. */
typedef struct ddp__placement {
  int32_t workers;
  int32_t bound;        /* 1: worker i runs on cpus[i]; 0: where it inherits */
  int32_t threads;      /* threads per worker the plan counted */
  const char *unit;     /* bound: "core", "hardware thread" or "package" */
  cpu_set_t allowed;    /* what this process may use */
  cpu_set_t *cpus;      /* [workers] when bound (ddp_alloc'd), else NULL */
  ddp__topology *topo;  /* ddp_alloc'd copy of the topology, for describe; may be NULL */
  /* Why the workers are not bound ("" when they are): for --report-bindings
   * and, with `note` 1, for the one line on stderr (AUTO found too few CPUs). */
  char why[256];
  int32_t note;
} ddp__placement;

/* Plans `workers` workers of `threads` threads each over topo (pure: no
 * system call). AUTO and CORE: consecutive cores, SMT siblings together,
 * `threads` at least per worker, the cores shared out evenly, the workers
 * spread over the packages in proportion to their cores (D'Hondt), a block
 * of consecutive local ranks per package; hardware threads instead when
 * cores are too few but CPUs are not. HWTHREAD: the same with every CPU a
 * unit. SOCKET: every CPU of one package, the workers spread over the
 * packages likewise. Too few CPUs: AUTO leaves the workers unbound with
 * `why` and note = 1; CORE and HWTHREAD fail (DDP_ERR_INVALID, naming the
 * numbers). NONE: unbound. */
ddp_status ddp__placement_plan(const ddp__topology *topo, ddp_launch_bind mode, int32_t workers, int32_t threads,
                               ddp__placement *out);

/* The launcher's decision: threads <= 0 means $OMP_NUM_THREADS from envp
 * (a positive integer), else 1; AUTO under srun (SLURM_STEP_ID or
 * SLURM_CPU_BIND in envp) leaves Slurm's binding; otherwise the plan over
 * this process's CPUs (sched_getaffinity) and sysfs topology. */
ddp_status ddp__placement_decide(ddp_launch_bind mode, int32_t workers, int32_t threads, char *const *envp,
                                 ddp__placement *out);
/* Accepts a zeroed or freed placement. */
void ddp__placement_free(ddp__placement *p);

/* Writes "TOOL: note: WHY (CPUs 0-1): leaving their placement to the
 * scheduler" to f when p->note is set and no note has been written by this
 * process yet; returns 1 when it wrote. */
int ddp__placement_note(const ddp__placement *p, const char *tool, FILE *f);
/* Worker i's CPUs for --report-bindings: "bound to CPUs 0-1 (package 0,
 * cores 0-1)" or "not bound (...): may run on CPUs 0-1". */
void ddp__placement_describe(const ddp__placement *p, int32_t worker, char *buf, size_t bytes);
/* Binds the calling thread to worker i's CPUs when p->bound (the child, before
 * exec or fn: its threads inherit them). Only a system call: async-signal-
 * safe. Returns 0 or an errno value. */
int ddp__placement_apply(const ddp__placement *p, int32_t worker);

/* ---- A GPU's nearby CPUs (gpu_affinity.c) -----------------------------------
 * A rank on a GPU runs on the CPUs of the GPU's NUMA node where the machine
 * says which they are (docs/cuda.md, "CPUs near the GPU"). */
typedef struct ddp__near_plan {
  int bind;           /* 1: set the process's CPUs to `cpus` */
  int node;           /* the GPU's NUMA node (numa_node), -1 unknown */
  cpu_set_t near;     /* its local_cpulist (empty when unread) */
  cpu_set_t cpus;     /* what to run on when bind */
  char why[400];      /* the decision in words, for the log */
} ddp__near_plan;

/* The plan for a process on CPUs `current` whose GPU is at PCI address
 * `address` ("0000:3b:00.0"), from ROOT/<address>/{local_cpulist,numa_node}
 * (root NULL: /sys/bus/pci/devices). Pure but for reading those two files,
 * so a test describes a machine in a temporary folder. The rules:
 *   - no local_cpulist (a container without sysfs, a machine that does not
 *     say), or one that parses to nothing: not bound, why says so;
 *   - every CPU of `current` near the GPU already: not bound (nothing to do);
 *   - some of them near it: bound to those (the launcher's share of cores,
 *     less the far ones);
 *   - none of them near it: bound to every CPU near the GPU (the node's,
 *     shared with the other ranks of that node: the GPU's memory traffic
 *     matters more than cores of one's own). */
void ddp__near_plan_make(const char *root, const char *address, const cpu_set_t *current,
                         ddp__near_plan *out);

/* --bind values: auto, none, core, socket, hwthread, and the spellings of
 * mpirun's --bind-to (package, numa, hwthread; a ":qualifier" is ignored) and
 * torchrun's --numa-binding (node and socket as socket, exclusive as core;
 * core-complex is refused). `option` names the flag in the error. */
ddp_status ddp__bind_parse(const char *option, const char *value, ddp_launch_bind *out);
const char *ddp__bind_name(ddp_launch_bind mode);

#ifdef __cplusplus
}
#endif
#endif /* DDP_LAUNCH_PLACEMENT_H */
