/* Where the workers run: the plan that gives each worker CPUs of its own when
 * this process may use enough of them, and the decision around it (--bind,
 * Slurm, the CPUs sched_getaffinity allows). Why binding is the default: on a
 * machine whose cores the ranks just fill, the scheduler now and then stacks
 * two spinning ranks on one core, and every collective then waits for time
 * slices (docs/launch.md, "Where the workers run"). */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"

#define SYSFS_CPU_ROOT "/sys/devices/system/cpu"

/* ---- CPU lists --------------------------------------------------------------- */

static int parse_cpu(const char **p, long *out) {
  if (**p < '0' || **p > '9') return 0;
  char *end;
  errno = 0;
  long x = strtol(*p, &end, 10);
  if (errno || x < 0 || x >= DDP__MAX_CPUS) return 0;
  *p = end;
  *out = x;
  return 1;
}

ddp_status ddp__cpulist_parse(const char *text, cpu_set_t *set) {
  CPU_ZERO(set);
  const char *p = text;
  int any = 0;
  for (;;) {
    long lo, hi;
    if (!parse_cpu(&p, &lo)) break;
    hi = lo;
    if (*p == '-') {
      p++;
      if (!parse_cpu(&p, &hi) || hi < lo) break;
    }
    for (long c = lo; c <= hi; c++) CPU_SET((int)c, set);
    any = 1;
    if (*p == ',') {
      p++;
      continue;
    }
    if (*p == '\n') p++;
    if (*p == '\0') return DDP_OK;
    break;
  }
  CPU_ZERO(set);
  return ddp_error(DDP_ERR_INVALID, "CPU list \"%.64s\": expected CPU numbers below %d and ranges "
                   "such as 0-3,8%s", text, DDP__MAX_CPUS, any ? "" : " (it is empty)");
}

void ddp__cpulist_format(const cpu_set_t *set, char *buf, size_t bytes) {
  if (bytes == 0) return;
  buf[0] = '\0';
  size_t len = 0;
  for (int c = 0; c < DDP__MAX_CPUS; c++) {
    if (!CPU_ISSET(c, set)) continue;
    int last = c;
    while (last + 1 < DDP__MAX_CPUS && CPU_ISSET(last + 1, set)) last++;
    int n = last == c ? snprintf(buf + len, bytes - len, "%s%d", len ? "," : "", c)
                      : snprintf(buf + len, bytes - len, "%s%d-%d", len ? "," : "", c, last);
    if (n < 0 || (size_t)n >= bytes - len) { /* cut: end on a whole item */
      buf[len] = '\0';
      return;
    }
    len += (size_t)n;
    c = last;
  }
}

/* ---- Topology ---------------------------------------------------------------- */

int ddp__read_small_file(const char *path, char *buf, size_t bytes) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n;
  do n = read(fd, buf, bytes - 1);
  while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  return 1;
}

void ddp__topology_read(const char *root, const cpu_set_t *allowed, ddp__topology *topo) {
  if (!root) root = SYSFS_CPU_ROOT;
  topo->n = 0;
  for (int c = 0; c < DDP__MAX_CPUS; c++) {
    if (!CPU_ISSET(c, allowed)) continue;
    ddp__cpu_topo *t = &topo->cpus[topo->n++];
    t->cpu = c;
    t->core = c;
    t->package = 0;
    char path[512], text[1024];
    cpu_set_t siblings;
    /* core_cpus_list since Linux 5.7, thread_siblings_list before. */
    snprintf(path, sizeof path, "%s/cpu%d/topology/core_cpus_list", root, c);
    int ok = ddp__read_small_file(path, text, sizeof text);
    if (!ok) {
      snprintf(path, sizeof path, "%s/cpu%d/topology/thread_siblings_list", root, c);
      ok = ddp__read_small_file(path, text, sizeof text);
    }
    if (ok && ddp__cpulist_parse(text, &siblings) == DDP_OK && CPU_ISSET(c, &siblings))
      for (int s = 0; s < c; s++)
        if (CPU_ISSET(s, &siblings)) {
          t->core = s;
          break;
        }
    snprintf(path, sizeof path, "%s/cpu%d/topology/physical_package_id", root, c);
    if (ddp__read_small_file(path, text, sizeof text)) {
      char *end;
      long pkg = strtol(text, &end, 10);
      if (end != text && pkg >= 0 && pkg < (1L << 30)) t->package = (int32_t)pkg;
    }
  }
}

/* ---- The plan -----------------------------------------------------------------
 * CPUs are ordered by (package, core, CPU) and grouped into units: a core
 * (its SMT siblings together), a hardware thread, or a package. Workers are
 * given out to the packages by D'Hondt's rule over their units (so 2 workers
 * on 2 packages of 8 cores take one package each, 3 take 2 + 1), a block of
 * consecutive local ranks per package, and within a package the k-th of its
 * n workers takes units [k u / n, (k+1) u / n): all of them, evenly. */

typedef struct plan_units {
  int32_t n_cpus;
  int32_t *order;      /* [n_cpus] topo indexes by (package, core, cpu) */
  int32_t n_units;
  int32_t *unit_start; /* [n_units + 1] into order */
  int32_t n_pkgs;
  int32_t *pkg_unit;   /* [n_pkgs + 1]: first unit of each package */
} plan_units;

static int cmp_cpu(const ddp__cpu_topo *a, const ddp__cpu_topo *b) {
  if (a->package != b->package) return a->package < b->package ? -1 : 1;
  if (a->core != b->core) return a->core < b->core ? -1 : 1;
  return (a->cpu > b->cpu) - (a->cpu < b->cpu);
}

static void sort_order(const ddp__topology *topo, int32_t *order) {
  /* Insertion sort: CPUs come nearly sorted already, and qsort has no
   * context pointer for the topology. */
  for (int32_t i = 0; i < topo->n; i++) order[i] = i;
  for (int32_t i = 1; i < topo->n; i++) {
    int32_t x = order[i], j = i;
    while (j > 0 && cmp_cpu(&topo->cpus[order[j - 1]], &topo->cpus[x]) > 0) {
      order[j] = order[j - 1];
      j--;
    }
    order[j] = x;
  }
}

/* Groups the ordered CPUs into units of `kind` (0 core, 1 hardware thread,
 * 2 package) and the units into packages. */
static ddp_status units_make(const ddp__topology *topo, int kind, plan_units *u) {
  memset(u, 0, sizeof *u);
  int32_t n = topo->n;
  u->n_cpus = n;
  u->order = ddp_calloc((size_t)n + 1, sizeof *u->order);
  u->unit_start = ddp_calloc((size_t)n + 1, sizeof *u->unit_start);
  u->pkg_unit = ddp_calloc((size_t)n + 1, sizeof *u->pkg_unit);
  if (!u->order || !u->unit_start || !u->pkg_unit) return ddp_error(DDP_ERR_NOMEM, "placement: out of memory");
  sort_order(topo, u->order);
  for (int32_t i = 0; i < n; i++) {
    const ddp__cpu_topo *t = &topo->cpus[u->order[i]], *prev = i ? &topo->cpus[u->order[i - 1]] : NULL;
    int new_pkg = !prev || prev->package != t->package;
    int new_unit = new_pkg || kind == 1 || (kind == 0 && prev->core != t->core);
    if (new_pkg) u->pkg_unit[u->n_pkgs++] = u->n_units;
    if (new_unit) u->unit_start[u->n_units++] = i;
  }
  u->unit_start[u->n_units] = n;
  u->pkg_unit[u->n_pkgs] = u->n_units;
  return DDP_OK;
}

static void units_free(plan_units *u) {
  ddp_free(u->order);
  ddp_free(u->unit_start);
  ddp_free(u->pkg_unit);
  memset(u, 0, sizeof *u);
}

/* Workers per package by D'Hondt over the packages' units, each package
 * holding at most units / need workers (need 0: no limit). Returns 0 when
 * some worker fits nowhere. */
static int share_packages(const plan_units *u, int32_t workers, int32_t need, int32_t *per_pkg) {
  for (int32_t p = 0; p < u->n_pkgs; p++) per_pkg[p] = 0;
  for (int32_t w = 0; w < workers; w++) {
    int32_t best = -1;
    for (int32_t p = 0; p < u->n_pkgs; p++) {
      int64_t units = u->pkg_unit[p + 1] - u->pkg_unit[p];
      if (need > 0 && (int64_t)(per_pkg[p] + 1) * need > units) continue;
      /* units_p / (n_p + 1) > units_best / (n_best + 1), strictly: ties go to the lower package */
      if (best < 0 || units * (per_pkg[best] + 1) >
                          (int64_t)(u->pkg_unit[best + 1] - u->pkg_unit[best]) * (per_pkg[p] + 1))
        best = p;
    }
    if (best < 0) return 0;
    per_pkg[best]++;
  }
  return 1;
}

/* Gives worker w the CPUs of units [first, last). */
static void take_units(const ddp__topology *topo, const plan_units *u, int32_t first, int32_t last, cpu_set_t *set) {
  CPU_ZERO(set);
  for (int32_t k = u->unit_start[first]; k < u->unit_start[last]; k++) CPU_SET(topo->cpus[u->order[k]].cpu, set);
}

/* Spreads the workers as the header says. `how`: SPREAD_PACKAGES, every
 * worker takes its whole package (the units are packages); SPREAD_FLAT, the
 * packages are ignored (one block of units), for when no package split
 * fits; else per package. */
enum { SPREAD_PER_PACKAGE, SPREAD_PACKAGES, SPREAD_FLAT };
static void spread(const ddp__topology *topo, const plan_units *u, int32_t workers, const int32_t *per_pkg, int how,
                   cpu_set_t *cpus) {
  if (how == SPREAD_PACKAGES) {
    int32_t w = 0;
    for (int32_t p = 0; p < u->n_pkgs; p++)
      for (int32_t k = 0; k < per_pkg[p]; k++, w++) take_units(topo, u, p, p + 1, &cpus[w]);
    return;
  }
  if (how == SPREAD_FLAT) {
    int64_t units = u->n_units;
    for (int32_t k = 0; k < workers; k++)
      take_units(topo, u, (int32_t)(k * units / workers), (int32_t)((k + 1) * units / workers), &cpus[k]);
    return;
  }
  int32_t w = 0;
  for (int32_t p = 0; p < u->n_pkgs; p++) {
    int64_t first = u->pkg_unit[p], units = u->pkg_unit[p + 1] - first, n = per_pkg[p];
    for (int64_t k = 0; k < n; k++, w++)
      take_units(topo, u, (int32_t)(first + k * units / n), (int32_t)(first + (k + 1) * units / n), &cpus[w]);
  }
}

static void set_unbound(ddp__placement *out, int note, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_unbound(ddp__placement *out, int note, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(out->why, sizeof out->why, fmt, ap);
  va_end(ap);
  out->bound = 0;
  out->note = note;
  out->unit = NULL;
}

ddp_status ddp__placement_plan(const ddp__topology *topo, ddp_launch_bind mode, int32_t workers, int32_t threads,
                               ddp__placement *out) {
  memset(out, 0, sizeof *out);
  if (workers < 1 || threads < 1)
    return ddp_error(DDP_ERR_INVALID, "placement: %d workers of %d threads", (int)workers, (int)threads);
  out->workers = workers;
  out->threads = threads;
  CPU_ZERO(&out->allowed);
  for (int32_t i = 0; i < topo->n; i++) CPU_SET(topo->cpus[i].cpu, &out->allowed);
  out->topo = ddp_alloc(sizeof *topo);
  if (!out->topo) return ddp_error(DDP_ERR_NOMEM, "placement: out of memory");
  memcpy(out->topo, topo, sizeof *topo);
  char list[256];
  ddp__cpulist_format(&out->allowed, list, sizeof list);
  if (mode == DDP_LAUNCH_BIND_NONE) {
    set_unbound(out, 0, "--bind none");
    return DDP_OK;
  }
  int64_t need = (int64_t)workers * threads;
  plan_units cores, hwthreads, pkgs;
  memset(&hwthreads, 0, sizeof hwthreads);
  memset(&pkgs, 0, sizeof pkgs);
  ddp_status st = units_make(topo, 0, &cores);
  if (st == DDP_OK) st = units_make(topo, 1, &hwthreads);
  if (st == DDP_OK) st = units_make(topo, 2, &pkgs);
  int32_t *per_pkg = st == DDP_OK ? ddp_calloc((size_t)cores.n_pkgs + 1, sizeof *per_pkg) : NULL;
  if (st == DDP_OK && !per_pkg) st = ddp_error(DDP_ERR_NOMEM, "placement: out of memory");
  const plan_units *u = NULL;
  int how = SPREAD_PER_PACKAGE;
  if (st != DDP_OK) goto done;
  if (mode == DDP_LAUNCH_BIND_SOCKET) {
    /* Every CPU of a package; workers share packages by design. */
    u = &pkgs;
    share_packages(&hwthreads, workers, 0, per_pkg); /* D'Hondt over each package's CPUs */
    out->unit = "package";
  } else if (mode == DDP_LAUNCH_BIND_HWTHREAD ? topo->n >= need : cores.n_units >= need) {
    u = mode == DDP_LAUNCH_BIND_HWTHREAD ? &hwthreads : &cores;
    out->unit = mode == DDP_LAUNCH_BIND_HWTHREAD ? "hardware thread" : "core";
  } else if (topo->n >= need) {
    u = &hwthreads; /* cores too few, CPUs enough: SMT siblings go to different workers */
    out->unit = "hardware thread";
  } else if (mode == DDP_LAUNCH_BIND_AUTO) {
    set_unbound(out, 1, "%d workers x %d thread%s need %lld CPUs, this process may use %d",
                (int)workers, (int)threads, threads == 1 ? "" : "s", (long long)need, (int)topo->n);
    goto done;
  } else {
    st = ddp_error(DDP_ERR_INVALID, "--bind %s: %d workers x %d thread%s need %lld CPUs, but this process may "
                   "use %d (%s); use --bind none (or auto) to leave their placement to the scheduler",
                   ddp__bind_name(mode), (int)workers, (int)threads, threads == 1 ? "" : "s", (long long)need,
                   (int)topo->n, list);
    goto done;
  }
  if (u == &pkgs) how = SPREAD_PACKAGES;
  else if (!share_packages(u, workers, threads, per_pkg)) how = SPREAD_FLAT;
  out->cpus = ddp_calloc((size_t)workers, sizeof *out->cpus);
  if (!out->cpus) {
    st = ddp_error(DDP_ERR_NOMEM, "placement: out of memory for %d CPU sets", (int)workers);
    goto done;
  }
  spread(topo, u, workers, per_pkg, how, out->cpus);
  out->bound = 1;
  out->why[0] = '\0';
done:
  ddp_free(per_pkg);
  units_free(&cores);
  units_free(&hwthreads);
  units_free(&pkgs);
  if (st != DDP_OK) ddp__placement_free(out);
  return st;
}

/* ---- The decision ---------------------------------------------------------------- */

static int32_t threads_from_env(char *const *envp) {
  const char *v = ddp__envp_get(envp, "OMP_NUM_THREADS");
  if (!v) return 1;
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10); /* "4" (OpenMP's nested list "4,2": its first level) */
  if (errno || end == v || (*end && *end != ',') || x < 1 || x > DDP__MAX_CPUS) return 1;
  return (int32_t)x;
}

ddp_status ddp__placement_decide(ddp_launch_bind mode, int32_t workers, int32_t threads, char *const *envp,
                                 ddp__placement *out) {
  memset(out, 0, sizeof *out);
  if (threads <= 0) threads = threads_from_env(envp);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  int have_mask = sched_getaffinity(0, sizeof allowed, &allowed) == 0;
  const char *step = ddp__envp_get(envp, "SLURM_STEP_ID"), *cpu_bind = ddp__envp_get(envp, "SLURM_CPU_BIND");
  if (mode == DDP_LAUNCH_BIND_NONE || (mode == DDP_LAUNCH_BIND_AUTO && (step || cpu_bind)) || !have_mask) {
    out->workers = workers;
    out->threads = threads;
    out->allowed = allowed;
    if (!have_mask && mode != DDP_LAUNCH_BIND_AUTO && mode != DDP_LAUNCH_BIND_NONE)
      return ddp_error(DDP_ERR_SYS, "--bind %s: sched_getaffinity: %s", ddp__bind_name(mode), strerror(errno));
    if (mode == DDP_LAUNCH_BIND_NONE)
      set_unbound(out, 0, "--bind none");
    else if (have_mask)
      set_unbound(out, 0, "under srun: Slurm's binding (%s=%s)", step ? "SLURM_STEP_ID" : "SLURM_CPU_BIND",
                  step ? step : cpu_bind);
    else
      set_unbound(out, 1, "cannot read this process's CPUs (sched_getaffinity: %s)", strerror(errno));
    return DDP_OK;
  }
  ddp__topology *topo = ddp_alloc(sizeof *topo);
  if (!topo) return ddp_error(DDP_ERR_NOMEM, "placement: out of memory");
  ddp__topology_read(NULL, &allowed, topo);
  ddp_status st = ddp__placement_plan(topo, mode, workers, threads, out);
  ddp_free(topo);
  return st;
}

void ddp__placement_free(ddp__placement *p) {
  if (!p) return;
  ddp_free(p->cpus);
  ddp_free(p->topo);
  p->cpus = NULL;
  p->topo = NULL;
  p->bound = 0;
}

/* ---- Saying it ----------------------------------------------------------------- */

int ddp__placement_note(const ddp__placement *p, const char *tool, FILE *f) {
  static atomic_int noted;
  if (!p->note || atomic_exchange(&noted, 1)) return 0;
  char list[256];
  ddp__cpulist_format(&p->allowed, list, sizeof list);
  fprintf(f, "%s: note: %s (CPUs %s): leaving their placement to the scheduler\n", tool,
          p->why, list[0] ? list : "unknown");
  fflush(f);
  return 1;
}

void ddp__placement_describe(const ddp__placement *p, int32_t worker, char *buf, size_t bytes) {
  char list[256];
  if (!p->bound || !p->cpus || worker < 0 || worker >= p->workers) {
    ddp__cpulist_format(&p->allowed, list, sizeof list);
    snprintf(buf, bytes, "not bound (%s): may run on CPUs %s", p->why[0] ? p->why : "no plan", list);
    return;
  }
  const cpu_set_t *set = &p->cpus[worker];
  ddp__cpulist_format(set, list, sizeof list);
  /* Its cores and packages, from the topology the plan used. */
  int32_t cores = 0, pkgs = 0, pkg = -1;
  for (int32_t i = 0; p->topo && i < p->topo->n; i++) {
    const ddp__cpu_topo *t = &p->topo->cpus[i];
    if (!CPU_ISSET(t->cpu, set)) continue;
    int core_seen = 0, pkg_seen = 0; /* siblings need not be adjacent in CPU order */
    for (int32_t j = 0; j < i; j++) {
      const ddp__cpu_topo *o = &p->topo->cpus[j];
      if (!CPU_ISSET(o->cpu, set)) continue;
      core_seen |= o->core == t->core && o->package == t->package;
      pkg_seen |= o->package == t->package;
    }
    cores += !core_seen;
    pkgs += !pkg_seen;
    if (pkg < 0) pkg = t->package;
  }
  int n = CPU_COUNT(set);
  if (pkgs == 1)
    snprintf(buf, bytes, "bound to CPU%s %s (%d core%s of package %d)", n == 1 ? "" : "s", list, (int)cores,
             cores == 1 ? "" : "s", (int)pkg);
  else
    snprintf(buf, bytes, "bound to CPU%s %s (%d core%s, %d packages)", n == 1 ? "" : "s", list, (int)cores,
             cores == 1 ? "" : "s", (int)pkgs);
}

int ddp__placement_apply(const ddp__placement *p, int32_t worker) {
  if (!p || !p->bound || !p->cpus || worker < 0 || worker >= p->workers) return 0;
  return sched_setaffinity(0, sizeof p->cpus[worker], &p->cpus[worker]) == 0 ? 0 : errno;
}

/* ---- Names ----------------------------------------------------------------------- */

ddp_status ddp__bind_parse(const char *option, const char *value, ddp_launch_bind *out) {
  char v[32];
  size_t n = strcspn(value, ":"); /* mpirun's qualifiers (core:overload-allowed) */
  if (n == 0 || n >= sizeof v) goto bad;
  memcpy(v, value, n);
  v[n] = '\0';
  static const struct {
    const char *name;
    ddp_launch_bind mode;
  } names[] = {
      {"auto", DDP_LAUNCH_BIND_AUTO},         {"none", DDP_LAUNCH_BIND_NONE},
      {"core", DDP_LAUNCH_BIND_CORE},         {"cores", DDP_LAUNCH_BIND_CORE},
      {"exclusive", DDP_LAUNCH_BIND_CORE},    {"socket", DDP_LAUNCH_BIND_SOCKET},
      {"package", DDP_LAUNCH_BIND_SOCKET},    {"numa", DDP_LAUNCH_BIND_SOCKET},
      {"node", DDP_LAUNCH_BIND_SOCKET},       {"hwthread", DDP_LAUNCH_BIND_HWTHREAD},
      {"hwthreads", DDP_LAUNCH_BIND_HWTHREAD},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(v, names[i].name) == 0) {
      *out = names[i].mode;
      return DDP_OK;
    }
  if (strcmp(v, "core-complex") == 0 || strcmp(v, "l3cache") == 0 || strcmp(v, "l2cache") == 0 ||
      strcmp(v, "l1cache") == 0)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s %s: binding to cache domains is not supported; use core, socket "
                     "or none", option, value);
bad:
  return ddp_error(DDP_ERR_INVALID, "%s %s: expected none, core, socket, hwthread or auto (mpirun's --bind-to "
                   "and torchrun's --numa-binding spellings: package, numa, node, exclusive)", option, value);
}

const char *ddp__bind_name(ddp_launch_bind mode) {
  switch (mode) {
    case DDP_LAUNCH_BIND_AUTO: return "auto";
    case DDP_LAUNCH_BIND_NONE: return "none";
    case DDP_LAUNCH_BIND_CORE: return "core";
    case DDP_LAUNCH_BIND_SOCKET: return "socket";
    case DDP_LAUNCH_BIND_HWTHREAD: return "hwthread";
  }
  return "?";
}
