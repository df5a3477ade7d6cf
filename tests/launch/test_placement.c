/* Where the workers run (src/launch/placement.c): CPU lists both ways, the
 * topology read from a sysfs tree made here (SMT siblings, packages, a CPU
 * without files), the plan on machines described by hand (this VM's 2 cores,
 * a 2-vCPU VM whose vCPUs are SMT siblings, 2 packages x 4 cores x 2 threads,
 * a cpuset that leaves one package 6 cores and the other 2), the rule "too
 * few CPUs: leave them unbound and say so once", the --bind spellings, and
 * ddp_spawn's workers running where the plan says. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "ddp/ddp.h"
#include "launch/launch_internal.h"

/* ---- Helpers ------------------------------------------------------------------- */

static ddp__topology topo; /* 12 KiB: not on the stack */

static void topo_clear(void) { topo.n = 0; }
static void topo_add(int cpu, int core, int package) {
  topo.cpus[topo.n++] = (ddp__cpu_topo){.cpu = cpu, .core = core, .package = package};
}
/* packages x cores x threads, numbered as Linux numbers Intel's: the first
 * thread of every core first (cpu = pkg * cores + core), then the second
 * threads (+ packages * cores). Ascending by CPU, as topology_read gives. */
static void topo_machine(int packages, int cores, int threads) {
  topo_clear();
  int per_thread = packages * cores;
  for (int t = 0; t < threads; t++)
    for (int p = 0; p < packages; p++)
      for (int c = 0; c < cores; c++) {
        int cpu = t * per_thread + p * cores + c;
        topo_add(cpu, p * cores + c, p); /* core: its first thread's CPU */
      }
}

static cpu_set_t set_of(const char *list) {
  cpu_set_t s;
  assert_int_equal(ddp__cpulist_parse(list, &s), DDP_OK);
  return s;
}

static void assert_set(const cpu_set_t *got, const char *want) {
  char buf[256];
  ddp__cpulist_format(got, buf, sizeof buf);
  if (strcmp(buf, want) != 0) fail_msg("CPU set %s, expected %s", buf, want);
}

/* Every bound plan: sets pairwise disjoint, each at least `threads` CPUs of
 * the topology. */
static void assert_disjoint(const ddp__placement *p) {
  assert_true(p->bound);
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int32_t w = 0; w < p->workers; w++) {
    cpu_set_t both;
    CPU_AND(&both, &all, &p->cpus[w]);
    if (CPU_COUNT(&both) != 0) fail_msg("worker %d shares CPUs with an earlier one", (int)w);
    if (CPU_COUNT(&p->cpus[w]) < p->threads) fail_msg("worker %d has %d CPUs", (int)w, CPU_COUNT(&p->cpus[w]));
    CPU_OR(&all, &all, &p->cpus[w]);
  }
  cpu_set_t outside;
  CPU_XOR(&outside, &all, &p->allowed);
  CPU_AND(&outside, &outside, &all);
  assert_int_equal(CPU_COUNT(&outside), 0);
}

static void plan(ddp_launch_bind mode, int workers, int threads, ddp__placement *p) {
  assert_int_equal(ddp__placement_plan(&topo, mode, workers, threads, p), DDP_OK);
}

/* ---- CPU lists ------------------------------------------------------------------- */

static void test_cpulist(void **state) {
  (void)state;
  cpu_set_t s = set_of("0-3,8,10-11\n");
  assert_int_equal(CPU_COUNT(&s), 7);
  assert_true(CPU_ISSET(0, &s) && CPU_ISSET(3, &s) && CPU_ISSET(8, &s) && CPU_ISSET(11, &s));
  assert_false(CPU_ISSET(4, &s) || CPU_ISSET(9, &s));
  assert_set(&s, "0-3,8,10-11");
  s = set_of("5");
  assert_set(&s, "5");
  s = set_of("1023");
  assert_set(&s, "1023");
  s = set_of("0,2,4,5,6");
  assert_set(&s, "0,2,4-6");
  const char *bad[] = {"", "\n", "3-1", "a", "0-", "1,,2", "0,", "1024", "-1", "0-3 ", "2:4"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cpu_set_t junk;
    if (ddp__cpulist_parse(bad[i], &junk) != DDP_ERR_INVALID) fail_msg("\"%s\" was accepted", bad[i]);
    assert_int_equal(CPU_COUNT(&junk), 0);
    assert_non_null(strstr(ddp_last_error(), "CPU list"));
  }
  /* Formatting cut short ends on a whole item. */
  s = set_of("0-3,8,10-11");
  char small[8];
  ddp__cpulist_format(&s, small, sizeof small);
  assert_string_equal(small, "0-3,8");
  CPU_ZERO(&s);
  ddp__cpulist_format(&s, small, sizeof small);
  assert_string_equal(small, "");
}

/* ---- Topology from sysfs --------------------------------------------------------- */

static void write_file(const char *dir, int cpu, const char *name, const char *text) {
  char path[512];
  snprintf(path, sizeof path, "%s/cpu%d/topology", dir, cpu);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "mkdir -p %s", path);
  assert_int_equal(system(cmd), 0);
  snprintf(path, sizeof path, "%s/cpu%d/topology/%s", dir, cpu, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void test_topology_read(void **state) {
  (void)state;
  char dir[] = "/tmp/ddp-test-topology-XXXXXX";
  assert_non_null(mkdtemp(dir));
  /* 2 packages x 2 cores x 2 threads, Intel's numbering (siblings c and c+4);
   * cpu 6 has only thread_siblings_list (an older kernel), cpu 7 no files. */
  const char *siblings[] = {"0,4", "1,5", "2,6", "3,7", "0,4", "1,5", "2,6", "3,7"};
  const char *package[] = {"0", "0", "1", "1", "0", "0", "1", "1"};
  for (int c = 0; c < 7; c++) {
    write_file(dir, c, c == 6 ? "thread_siblings_list" : "core_cpus_list", siblings[c]);
    write_file(dir, c, "physical_package_id", package[c]);
  }
  cpu_set_t allowed = set_of("0-7,9");
  ddp__topology_read(dir, &allowed, &topo);
  assert_int_equal(topo.n, 9);
  const int core[] = {0, 1, 2, 3, 0, 1, 2, 7, 9}, pkg[] = {0, 0, 1, 1, 0, 0, 1, 0, 0};
  for (int i = 0; i < 9; i++) {
    assert_int_equal(topo.cpus[i].cpu, i < 8 ? i : 9);
    if (topo.cpus[i].core != core[i] || topo.cpus[i].package != pkg[i])
      fail_msg("cpu %d: core %d package %d, expected core %d package %d", (int)topo.cpus[i].cpu,
               (int)topo.cpus[i].core, (int)topo.cpus[i].package, core[i], pkg[i]);
  }
  /* A cpuset of one thread per core: only those CPUs, each its own core. */
  allowed = set_of("0-3");
  ddp__topology_read(dir, &allowed, &topo);
  assert_int_equal(topo.n, 4);
  ddp__placement p;
  plan(DDP_LAUNCH_BIND_AUTO, 2, 1, &p);
  assert_set(&p.cpus[0], "0-1"); /* package 0's two cores */
  assert_set(&p.cpus[1], "2-3");
  ddp__placement_free(&p);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* ---- CPUs near a GPU ------------------------------------------------------------- */

static void write_pci(const char *dir, const char *address, const char *name, const char *text) {
  char path[512], cmd[600];
  snprintf(path, sizeof path, "%s/%s", dir, address);
  snprintf(cmd, sizeof cmd, "mkdir -p %s", path);
  assert_int_equal(system(cmd), 0);
  snprintf(path, sizeof path, "%s/%s/%s", dir, address, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void expect_why(const ddp__near_plan *p, const char *substring) {
  if (!strstr(p->why, substring)) fail_msg("why \"%s\" does not contain \"%s\"", p->why, substring);
}

/* A machine described in a folder: 2 NUMA nodes of 8 CPUs (0-7 and 8-15,
 * SMT siblings +16 on each: 0-7,16-23 and 8-15,24-31), GPU 0 on node 0,
 * GPU 1 on node 1, a GPU on a machine without NUMA (numa_node -1, every
 * CPU local), and a device whose folder says nothing. */
static void test_near_gpu(void **state) {
  (void)state;
  char dir[] = "/tmp/ddp-test-pci-XXXXXX";
  assert_non_null(mkdtemp(dir));
  write_pci(dir, "0000:1b:00.0", "numa_node", "0\n");
  write_pci(dir, "0000:1b:00.0", "local_cpulist", "0-7,16-23\n");
  write_pci(dir, "0000:9b:00.0", "numa_node", "1\n");
  write_pci(dir, "0000:9b:00.0", "local_cpulist", "8-15,24-31\n");
  write_pci(dir, "0000:05:00.0", "numa_node", "-1\n");
  write_pci(dir, "0000:05:00.0", "local_cpulist", "0-31\n");
  write_pci(dir, "0000:07:00.0", "local_cpulist", "garbage\n");
  ddp__near_plan p;
  /* Unbound (every CPU): the GPU's node, its SMT siblings included. */
  cpu_set_t all = set_of("0-31");
  ddp__near_plan_make(dir, "0000:9b:00.0", &all, &p);
  assert_true(p.bind);
  assert_int_equal(p.node, 1);
  assert_set(&p.cpus, "8-15,24-31");
  expect_why(&p, "bound to CPUs 8-15,24-31: those of its CPUs 0-31 near GPU 0000:9b:00.0 (NUMA node 1");
  /* The launcher gave it cores straddling the nodes: the near ones stay. */
  cpu_set_t straddle = set_of("6-9");
  ddp__near_plan_make(dir, "0000:9b:00.0", &straddle, &p);
  assert_true(p.bind);
  assert_set(&p.cpus, "8-9");
  /* Its cores are all near already: nothing to do. */
  cpu_set_t share = set_of("2-3,18-19");
  ddp__near_plan_make(dir, "0000:1b:00.0", &share, &p);
  assert_false(p.bind);
  assert_int_equal(p.node, 0);
  expect_why(&p, "are all near GPU 0000:1b:00.0 (NUMA node 0");
  /* Its cores are all far: every CPU of the GPU's node. */
  ddp__near_plan_make(dir, "0000:1b:00.0", &straddle, &p);
  assert_true(p.bind);
  assert_set(&p.cpus, "6-7");
  cpu_set_t far = set_of("8-11");
  ddp__near_plan_make(dir, "0000:1b:00.0", &far, &p);
  assert_true(p.bind);
  assert_set(&p.cpus, "0-7,16-23");
  expect_why(&p, "none of its CPUs 8-11 is");
  /* No NUMA: every CPU is near; nothing changes. */
  ddp__near_plan_make(dir, "0000:05:00.0", &far, &p);
  assert_false(p.bind);
  assert_int_equal(p.node, -1);
  expect_why(&p, "no NUMA node");
  /* The machine does not say, or says nonsense: nothing changes. */
  ddp__near_plan_make(dir, "0000:aa:00.0", &all, &p);
  assert_false(p.bind);
  expect_why(&p, "the machine does not say which CPUs are near GPU 0000:aa:00.0");
  ddp__near_plan_make(dir, "0000:07:00.0", &all, &p);
  assert_false(p.bind);
  expect_why(&p, "does not hold a CPU list");
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  assert_int_equal(system(cmd), 0);
}

/* The PCI address as CUDA and NVML write it, in sysfs's spelling; the
 * public call off, and on a machine without the GPU (nothing changes). */
static void test_near_gpu_api(void **state) {
  (void)state;
  char out[32];
  assert_int_equal(ddp_pci_address_normalize("0000:3B:00.0", out, sizeof out), DDP_OK);
  assert_string_equal(out, "0000:3b:00.0");
  assert_int_equal(ddp_pci_address_normalize("00000000:AF:1F.7", out, sizeof out), DDP_OK);
  assert_string_equal(out, "0000:af:1f.7");
  assert_int_equal(ddp_pci_address_normalize("10000000:AF:1F.7", out, sizeof out), DDP_ERR_INVALID);
  assert_int_equal(ddp_pci_address_normalize("0000:3B:00", out, sizeof out), DDP_ERR_INVALID);
  assert_int_equal(ddp_pci_address_normalize("0000:3G:00.0", out, sizeof out), DDP_ERR_INVALID);
  assert_int_equal(ddp_pci_address_normalize("", out, sizeof out), DDP_ERR_INVALID);
  assert_int_equal(ddp_device_pci_address(DDP_CPU, out, sizeof out), DDP_ERR_UNSUPPORTED);
  cpu_set_t before, after;
  assert_int_equal(sched_getaffinity(0, sizeof before, &before), 0);
  char report[400];
  setenv("DDP_GPU_AFFINITY", "off", 1);
  assert_int_equal(ddp_bind_near_gpu(0, report, sizeof report), DDP_OK);
  assert_non_null(strstr(report, "off (DDP_GPU_AFFINITY=off)"));
  setenv("DDP_GPU_AFFINITY", "sometimes", 1);
  assert_int_equal(ddp_bind_near_gpu(0, report, sizeof report), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "DDP_GPU_AFFINITY=\"sometimes\""));
  unsetenv("DDP_GPU_AFFINITY");
  if (ddp_cuda_device_count() == 0) {
    /* No GPU: left as it is, saying why. */
    assert_int_equal(ddp_bind_near_gpu(0, report, sizeof report), DDP_OK);
    assert_non_null(strstr(report, "left as they are"));
    assert_int_equal(sched_getaffinity(0, sizeof after, &after), 0);
    assert_true(CPU_EQUAL(&before, &after));
  }
}

/* ---- The plan ---------------------------------------------------------------------- */

/* This VM: 2 cores, one package, no SMT. */
static void test_plan_two_cores(void **state) {
  (void)state;
  ddp__placement p;
  topo_machine(1, 2, 1);
  plan(DDP_LAUNCH_BIND_AUTO, 2, 1, &p);
  assert_disjoint(&p);
  assert_string_equal(p.unit, "core");
  assert_set(&p.cpus[0], "0");
  assert_set(&p.cpus[1], "1");
  char line[256];
  ddp__placement_describe(&p, 1, line, sizeof line);
  assert_string_equal(line, "bound to CPU 1 (1 core of package 0)");
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_AUTO, 1, 1, &p); /* one worker: every core */
  assert_set(&p.cpus[0], "0-1");
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_AUTO, 1, 2, &p);
  assert_set(&p.cpus[0], "0-1");
  ddp__placement_free(&p);
  /* Too few CPUs: AUTO leaves them, with the note's reason. */
  plan(DDP_LAUNCH_BIND_AUTO, 3, 1, &p);
  assert_false(p.bound);
  assert_null(p.cpus);
  assert_true(p.note);
  assert_string_equal(p.why, "3 workers x 1 thread need 3 CPUs, this process may use 2");
  ddp__placement_describe(&p, 0, line, sizeof line);
  assert_string_equal(line, "not bound (3 workers x 1 thread need 3 CPUs, this process may use 2): may run on CPUs 0-1");
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_AUTO, 2, 2, &p); /* threads count: 2 x 2 > 2 */
  assert_false(p.bound);
  assert_true(p.note);
  ddp__placement_free(&p);
  /* CORE and HWTHREAD refuse; NONE never binds and says nothing. */
  assert_int_equal(ddp__placement_plan(&topo, DDP_LAUNCH_BIND_CORE, 3, 1, &p), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "--bind core: 3 workers x 1 thread need 3 CPUs"));
  assert_null(p.cpus);
  assert_int_equal(ddp__placement_plan(&topo, DDP_LAUNCH_BIND_HWTHREAD, 2, 2, &p), DDP_ERR_INVALID);
  plan(DDP_LAUNCH_BIND_NONE, 2, 1, &p);
  assert_false(p.bound);
  assert_false(p.note);
  ddp__placement_free(&p);
}

/* A 2-vCPU VM whose vCPUs are one core's two threads: cores are too few for
 * 2 workers, CPUs are not, so each gets a thread; one worker gets the core. */
static void test_plan_smt_pair(void **state) {
  (void)state;
  ddp__placement p;
  topo_machine(1, 1, 2);
  plan(DDP_LAUNCH_BIND_AUTO, 2, 1, &p);
  assert_disjoint(&p);
  assert_string_equal(p.unit, "hardware thread");
  assert_set(&p.cpus[0], "0");
  assert_set(&p.cpus[1], "1");
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_CORE, 1, 1, &p);
  assert_string_equal(p.unit, "core");
  assert_set(&p.cpus[0], "0-1");
  ddp__placement_free(&p);
}

/* 2 packages x 4 cores x 2 threads (16 CPUs; core c's siblings c and c+8). */
static void test_plan_two_packages(void **state) {
  (void)state;
  ddp__placement p;
  topo_machine(2, 4, 2);
  /* 2 workers: a package each, SMT siblings with their core. */
  plan(DDP_LAUNCH_BIND_AUTO, 2, 1, &p);
  assert_disjoint(&p);
  assert_set(&p.cpus[0], "0-3,8-11");
  assert_set(&p.cpus[1], "4-7,12-15");
  char line[256];
  ddp__placement_describe(&p, 1, line, sizeof line);
  assert_string_equal(line, "bound to CPUs 4-7,12-15 (4 cores of package 1)");
  ddp__placement_free(&p);
  /* 3: two on package 0 (2 cores each), one on package 1 (all 4). */
  plan(DDP_LAUNCH_BIND_AUTO, 3, 1, &p);
  assert_disjoint(&p);
  assert_set(&p.cpus[0], "0-1,8-9");
  assert_set(&p.cpus[1], "2-3,10-11");
  assert_set(&p.cpus[2], "4-7,12-15");
  ddp__placement_free(&p);
  /* 8: a core each (both threads), local ranks 0-3 on package 0. */
  plan(DDP_LAUNCH_BIND_AUTO, 8, 1, &p);
  assert_disjoint(&p);
  assert_string_equal(p.unit, "core");
  for (int w = 0; w < 8; w++) {
    char want[16];
    snprintf(want, sizeof want, "%d,%d", w, w + 8);
    assert_set(&p.cpus[w], want);
  }
  ddp__placement_free(&p);
  /* 4 workers x 2 threads: 2 cores each, within a package. */
  plan(DDP_LAUNCH_BIND_AUTO, 4, 2, &p);
  assert_disjoint(&p);
  assert_set(&p.cpus[0], "0-1,8-9");
  assert_set(&p.cpus[3], "6-7,14-15");
  ddp__placement_free(&p);
  /* 12 workers: 8 cores are too few, 16 threads are not; 6 per package, no
   * worker across packages. */
  plan(DDP_LAUNCH_BIND_AUTO, 12, 1, &p);
  assert_disjoint(&p);
  assert_string_equal(p.unit, "hardware thread");
  for (int w = 0; w < 12; w++) {
    cpu_set_t pkg0 = set_of("0-3,8-11"), in0;
    CPU_AND(&in0, &pkg0, &p.cpus[w]);
    assert_int_equal(CPU_COUNT(&in0) == CPU_COUNT(&p.cpus[w]), w < 6);
  }
  ddp__placement_free(&p);
  /* 17: too few; every worker unbound. */
  plan(DDP_LAUNCH_BIND_AUTO, 17, 1, &p);
  assert_false(p.bound);
  assert_true(p.note);
  ddp__placement_free(&p);
  /* HWTHREAD: siblings count apart, so 2 workers x 4 threads fit in 8 CPUs of a package. */
  plan(DDP_LAUNCH_BIND_HWTHREAD, 16, 1, &p);
  assert_disjoint(&p);
  ddp__placement_free(&p);
  /* SOCKET: whole packages, shared; 3 workers 2 + 1. */
  plan(DDP_LAUNCH_BIND_SOCKET, 3, 1, &p);
  assert_true(p.bound);
  assert_set(&p.cpus[0], "0-3,8-11");
  assert_set(&p.cpus[1], "0-3,8-11");
  assert_set(&p.cpus[2], "4-7,12-15");
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_SOCKET, 40, 1, &p); /* never too few */
  assert_true(p.bound);
  ddp__placement_free(&p);
}

/* A cpuset that leaves package 0 six cores and package 1 two: 4 workers go
 * 3 + 1 (D'Hondt), 2 cores each; and packages of one core each with
 * 1 worker x 2 threads: no package holds it, so the cores are shared out
 * across packages. */
static void test_plan_uneven(void **state) {
  (void)state;
  ddp__placement p;
  topo_clear();
  for (int c = 0; c < 6; c++) topo_add(c, c, 0);
  for (int c = 8; c < 10; c++) topo_add(c, c, 1);
  plan(DDP_LAUNCH_BIND_AUTO, 4, 1, &p);
  assert_disjoint(&p);
  assert_set(&p.cpus[0], "0-1");
  assert_set(&p.cpus[1], "2-3");
  assert_set(&p.cpus[2], "4-5");
  assert_set(&p.cpus[3], "8-9");
  ddp__placement_free(&p);
  topo_clear();
  topo_add(0, 0, 0);
  topo_add(1, 1, 1);
  plan(DDP_LAUNCH_BIND_AUTO, 1, 2, &p);
  assert_set(&p.cpus[0], "0-1");
  char line[256];
  ddp__placement_describe(&p, 0, line, sizeof line);
  assert_string_equal(line, "bound to CPUs 0-1 (2 cores, 2 packages)");
  ddp__placement_free(&p);
}

/* ---- The decision and the note ------------------------------------------------------- */

static void test_decide(void **state) {
  (void)state;
  cpu_set_t mine;
  assert_int_equal(sched_getaffinity(0, sizeof mine, &mine), 0);
  int cpus = CPU_COUNT(&mine);
  ddp__placement p;
  /* Under srun AUTO leaves Slurm's binding, without a note; CORE still binds. */
  char *slurm[] = {"SLURM_STEP_ID=0", NULL};
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, 1, 1, slurm, &p), DDP_OK);
  assert_false(p.bound);
  assert_false(p.note);
  assert_non_null(strstr(p.why, "Slurm"));
  ddp__placement_free(&p);
  char *cpu_bind[] = {"SLURM_CPU_BIND=quiet,mask_cpu:0x3", NULL};
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, 1, 1, cpu_bind, &p), DDP_OK);
  assert_false(p.bound);
  ddp__placement_free(&p);
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_CORE, 1, 1, slurm, &p), DDP_OK);
  assert_true(p.bound);
  ddp__placement_free(&p);
  /* Threads from OMP_NUM_THREADS when not given: cpus workers of 1 thread
   * fit, of 2 threads do not. */
  char *none[] = {NULL};
  char *omp2[] = {"OMP_NUM_THREADS=2", NULL};
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, cpus, 0, none, &p), DDP_OK);
  assert_true(p.bound);
  assert_int_equal(p.threads, 1);
  ddp__placement_free(&p);
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, cpus, 0, omp2, &p), DDP_OK);
  assert_int_equal(p.threads, 2);
  assert_false(p.bound);
  assert_true(p.note);
  ddp__placement_free(&p);
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, cpus, 1, omp2, &p), DDP_OK); /* given wins */
  assert_true(p.bound);
  ddp__placement_free(&p);
  char *bad_omp[] = {"OMP_NUM_THREADS=lots", NULL};
  assert_int_equal(ddp__placement_decide(DDP_LAUNCH_BIND_AUTO, 1, 0, bad_omp, &p), DDP_OK);
  assert_int_equal(p.threads, 1);
  ddp__placement_free(&p);
  ddp__placement_free(&p); /* twice is fine */
}

/* The note is written once per process however many launches find too few CPUs. */
static void test_note_once(void **state) {
  (void)state;
  ddp__placement p;
  topo_machine(1, 2, 1);
  plan(DDP_LAUNCH_BIND_AUTO, 2, 1, &p);
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  assert_int_equal(ddp__placement_note(&p, "tool", f), 0); /* bound: nothing to say */
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_AUTO, 5, 1, &p);
  assert_int_equal(ddp__placement_note(&p, "tool", f), 1);
  assert_int_equal(ddp__placement_note(&p, "tool", f), 0);
  ddp__placement_free(&p);
  plan(DDP_LAUNCH_BIND_AUTO, 4, 1, &p);
  assert_int_equal(ddp__placement_note(&p, "tool", f), 0);
  ddp__placement_free(&p);
  fclose(f);
  assert_string_equal(text, "tool: note: 5 workers x 1 thread need 5 CPUs, this process may use 2 (CPUs 0-1): "
                            "leaving their placement to the scheduler\n");
  free(text);
}

/* ---- Spellings -------------------------------------------------------------------------- */

static void test_bind_spellings(void **state) {
  (void)state;
  struct {
    const char *text;
    ddp_launch_bind mode;
  } ok[] = {{"auto", DDP_LAUNCH_BIND_AUTO},     {"none", DDP_LAUNCH_BIND_NONE},
            {"core", DDP_LAUNCH_BIND_CORE},     {"core:overload-allowed", DDP_LAUNCH_BIND_CORE},
            {"exclusive", DDP_LAUNCH_BIND_CORE}, {"socket", DDP_LAUNCH_BIND_SOCKET},
            {"package", DDP_LAUNCH_BIND_SOCKET}, {"numa", DDP_LAUNCH_BIND_SOCKET},
            {"node", DDP_LAUNCH_BIND_SOCKET},    {"hwthread", DDP_LAUNCH_BIND_HWTHREAD}};
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    ddp_launch_bind m = DDP_LAUNCH_BIND_NONE + 10;
    assert_int_equal(ddp__bind_parse("--bind", ok[i].text, &m), DDP_OK);
    assert_int_equal(m, ok[i].mode);
  }
  ddp_launch_bind m;
  assert_int_equal(ddp__bind_parse("--numa-binding", "core-complex", &m), DDP_ERR_UNSUPPORTED);
  assert_non_null(strstr(ddp_last_error(), "--numa-binding core-complex"));
  assert_int_equal(ddp__bind_parse("--bind", "cpu", &m), DDP_ERR_INVALID);
  assert_int_equal(ddp__bind_parse("--bind", "", &m), DDP_ERR_INVALID);
  /* ddprun's options: every spelling lands in cfg->bind; --report-bindings, --threads. */
  const char *argv_sets[][6] = {
      {"ddprun", "--bind", "none", "prog", NULL},
      {"ddprun", "--bind-to", "socket", "prog", NULL},
      {"ddprun", "--bind_to=core", "prog", NULL},
      {"ddprun", "--numa-binding=exclusive", "prog", NULL},
      {"ddprun", "--report-bindings", "--threads", "3", "prog", NULL},
  };
  const int want[] = {DDP_LAUNCH_BIND_NONE, DDP_LAUNCH_BIND_SOCKET, DDP_LAUNCH_BIND_CORE, DDP_LAUNCH_BIND_CORE,
                      DDP_LAUNCH_BIND_AUTO};
  for (int k = 0; k < 5; k++) {
    ddp_launch_config cfg = ddp_launch_defaults();
    int argc = 0;
    while (argv_sets[k][argc]) argc++;
    assert_int_equal(ddp_launch_parse_args(argc, (char *const *)argv_sets[k], &cfg), DDP_OK);
    assert_int_equal(cfg.bind, want[k]);
    assert_string_equal(cfg.program, "prog");
    if (k == 4) {
      assert_int_equal(cfg.report_bindings, 1);
      assert_int_equal(cfg.threads_per_worker, 3);
    }
  }
  ddp_launch_config cfg = ddp_launch_defaults();
  char *bad[] = {"ddprun", "--bind", "tile", "prog", NULL};
  assert_int_equal(ddp_launch_parse_args(4, bad, &cfg), DDP_ERR_INVALID);
  char *bad_threads[] = {"ddprun", "--threads", "0", "prog", NULL};
  assert_int_equal(ddp_launch_parse_args(4, bad_threads, &cfg), DDP_ERR_INVALID);
}

/* ---- ddp_spawn's workers run where the plan says ------------------------------------------ */

typedef struct spawn_check {
  ddp__placement plan;  /* what the parent expects, decided as ddp_spawn decides */
} spawn_check;

static int where_worker(int rank, void *arg) {
  const spawn_check *c = arg;
  cpu_set_t now;
  if (sched_getaffinity(0, sizeof now, &now) != 0) return 2;
  const cpu_set_t *want = c->plan.bound ? &c->plan.cpus[rank] : &c->plan.allowed;
  if (!CPU_EQUAL(&now, want)) {
    char a[128], b[128];
    ddp__cpulist_format(&now, a, sizeof a);
    ddp__cpulist_format(want, b, sizeof b);
    fprintf(stderr, "rank %d runs on CPUs %s, expected %s\n", rank, a, b);
    return 3;
  }
  return 0;
}

static void test_spawn_binds(void **state) {
  (void)state;
  extern char **environ;
  cpu_set_t mine;
  assert_int_equal(sched_getaffinity(0, sizeof mine, &mine), 0);
  if (CPU_COUNT(&mine) < 2) {
    print_message("SKIP: this process may use %d CPU: two workers cannot have a core each\n", CPU_COUNT(&mine));
    skip();
  }
  if (ddp__envp_get(environ, "SLURM_STEP_ID") || ddp__envp_get(environ, "SLURM_CPU_BIND")) {
    print_message("SKIP: under srun, where AUTO leaves Slurm's binding\n");
    skip();
  }
  spawn_check c;
  ddp_spawn_options o;
  for (int mode = DDP_LAUNCH_BIND_AUTO; mode <= DDP_LAUNCH_BIND_NONE; mode++) {
    assert_int_equal(ddp__placement_decide((ddp_launch_bind)mode, 2, 1, environ, &c.plan), DDP_OK);
    assert_int_equal(c.plan.bound, mode == DDP_LAUNCH_BIND_AUTO);
    if (c.plan.bound) {
      cpu_set_t both;
      CPU_AND(&both, &c.plan.cpus[0], &c.plan.cpus[1]);
      assert_int_equal(CPU_COUNT(&both), 0);
    }
    o = ddp_spawn_defaults();
    o.timeout_s = 30;
    o.bind = mode;
    o.threads_per_worker = 1;
    assert_int_equal(ddp_spawn(2, where_worker, &c, &o), DDP_OK);
    ddp__placement_free(&c.plan);
  }
  /* The caller itself stays where it was. */
  cpu_set_t after;
  assert_int_equal(sched_getaffinity(0, sizeof after, &after), 0);
  assert_true(CPU_EQUAL(&after, &mine));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cpulist),           cmocka_unit_test(test_topology_read),
      cmocka_unit_test(test_plan_two_cores),    cmocka_unit_test(test_plan_smt_pair),
      cmocka_unit_test(test_plan_two_packages), cmocka_unit_test(test_plan_uneven),
      cmocka_unit_test(test_decide),            cmocka_unit_test(test_note_once),
      cmocka_unit_test(test_bind_spellings),    cmocka_unit_test(test_spawn_binds),
      cmocka_unit_test(test_near_gpu),          cmocka_unit_test(test_near_gpu_api),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
