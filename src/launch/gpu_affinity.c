/* A rank's CPUs near its GPU (placement.h, "A GPU's nearby CPUs"; docs/cuda.md,
 * "CPUs near the GPU"): the machine says which CPUs share a NUMA node with a
 * PCI device in /sys/bus/pci/devices/<address>/local_cpulist (numa_node:
 * which node, -1 when the machine has no NUMA information). A rank whose
 * host threads (the data loader, the optimizer, the progress and watchdog
 * threads) run on the far socket crosses the socket link for every copy to
 * and from its GPU; torchrun's --numa-binding and NVIDIA's guides bind them
 * to the GPU's node. The plan is pure but for two sysfs reads, so the tests
 * describe machines in a temporary folder. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ddp/tensor.h"
#include "launch/launch_internal.h"

#define SYSFS_PCI_ROOT "/sys/bus/pci/devices"

void ddp__near_plan_make(const char *root, const char *address, const cpu_set_t *current,
                         ddp__near_plan *out) {
  memset(out, 0, sizeof *out);
  out->node = -1;
  CPU_ZERO(&out->near);
  CPU_ZERO(&out->cpus);
  if (!root) root = SYSFS_PCI_ROOT;
  char path[512], text[4096], node_text[32];
  snprintf(path, sizeof path, "%s/%s/numa_node", root, address);
  if (ddp__read_small_file(path, node_text, sizeof node_text)) {
    char *end;
    long node = strtol(node_text, &end, 10);
    if (end != node_text && node >= 0 && node < (1L << 20)) out->node = (int)node;
  }
  snprintf(path, sizeof path, "%s/%s/local_cpulist", root, address);
  if (!ddp__read_small_file(path, text, sizeof text)) {
    snprintf(out->why, sizeof out->why, "the machine does not say which CPUs are near GPU %.32s (no %.200s)",
             address, path);
    return;
  }
  if (ddp__cpulist_parse(text, &out->near) != DDP_OK || CPU_COUNT(&out->near) == 0) {
    ddp_clear_error();
    CPU_ZERO(&out->near);
    snprintf(out->why, sizeof out->why, "%.250s does not hold a CPU list", path);
    return;
  }
  char node[32] = "no NUMA node";
  if (out->node >= 0) snprintf(node, sizeof node, "NUMA node %d", out->node);
  char near_list[128], cur_list[128], both_list[128];
  ddp__cpulist_format(&out->near, near_list, sizeof near_list);
  ddp__cpulist_format(current, cur_list, sizeof cur_list);
  cpu_set_t both;
  CPU_AND(&both, current, &out->near);
  if (CPU_EQUAL(&both, current)) {
    snprintf(out->why, sizeof out->why, "its CPUs %.80s are all near GPU %.32s (%s: %.80s); left as they are",
             cur_list, address, node, near_list);
    return;
  }
  out->bind = 1;
  if (CPU_COUNT(&both) > 0) {
    out->cpus = both;
    ddp__cpulist_format(&both, both_list, sizeof both_list);
    snprintf(out->why, sizeof out->why, "bound to CPUs %.60s: those of its CPUs %.60s near GPU %.32s (%s: %.60s)",
             both_list, cur_list, address, node, near_list);
  } else {
    out->cpus = out->near;
    snprintf(out->why, sizeof out->why, "bound to CPUs %.80s, near GPU %.32s (%s): none of its CPUs %.80s is",
             near_list, address, node, cur_list);
  }
}

/* Every thread of the process (threads started before this call keep
 * their own mask otherwise: OpenBLAS's, the store's). 0 or the first
 * errno; the calling thread first, so a refusal changes nothing. */
static int set_all_threads(const cpu_set_t *cpus) {
  if (sched_setaffinity(0, sizeof *cpus, cpus) != 0) return errno;
  DIR *d = opendir("/proc/self/task");
  if (!d) return 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    char *end;
    long tid = strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end || tid <= 0) continue;
    (void)sched_setaffinity((pid_t)tid, sizeof *cpus, cpus); /* a thread gone meanwhile: fine */
  }
  closedir(d);
  return 0;
}

ddp_status ddp_bind_near_gpu(int cuda_index, char *report, size_t bytes) {
  char local[400];
  if (!report) {
    report = local;
    bytes = sizeof local;
  }
  if (bytes) report[0] = '\0';
  const char *mode = getenv("DDP_GPU_AFFINITY");
  if (mode && (!strcmp(mode, "off") || !strcmp(mode, "0") || !strcmp(mode, "none"))) {
    snprintf(report, bytes, "CPUs near the GPU: off (DDP_GPU_AFFINITY=%s)", mode);
    return DDP_OK;
  }
  if (mode && *mode && strcmp(mode, "auto") != 0 && strcmp(mode, "1") != 0 && strcmp(mode, "on") != 0)
    return ddp_error(DDP_ERR_INVALID, "DDP_GPU_AFFINITY=\"%s\": expected auto (the default) or off", mode);
  char address[32];
  if (ddp_device_pci_address(DDP_CUDA(cuda_index), address, sizeof address) != DDP_OK) {
    snprintf(report, bytes, "CPUs near the GPU: left as they are (%s)", ddp_last_error());
    ddp_clear_error();
    return DDP_OK;
  }
  cpu_set_t current;
  CPU_ZERO(&current);
  if (sched_getaffinity(0, sizeof current, &current) != 0) {
    snprintf(report, bytes, "CPUs near the GPU: left as they are (sched_getaffinity: %s)", strerror(errno));
    return DDP_OK;
  }
  ddp__near_plan plan;
  ddp__near_plan_make(NULL, address, &current, &plan);
  if (!plan.bind) {
    snprintf(report, bytes, "cuda:%d: %s", cuda_index, plan.why);
    return DDP_OK;
  }
  int err = set_all_threads(&plan.cpus);
  if (err) {
    snprintf(report, bytes, "cuda:%d: CPUs left as they are: %s", cuda_index, strerror(err));
    return ddp_error(DDP_ERR_SYS, "cuda:%d: binding to the CPUs near the GPU (%s): sched_setaffinity: %s; set "
                     "DDP_GPU_AFFINITY=off to run where the process runs now", cuda_index, plan.why,
                     strerror(err));
  }
  snprintf(report, bytes, "cuda:%d: %s", cuda_index, plan.why);
  return DDP_OK;
}
