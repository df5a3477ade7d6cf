/* Host identity: which ranks share a machine (and so shared memory and
 * loopback). The hostname alone is not enough: two containers on one machine
 * may share a name but not a network, so the network namespace joins it. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/net.h"

ddp_status ddp__net_host_id(char *out, size_t bytes) {
  const char *forced = ddp_env_str("DDP_HOST_ID", NULL);
  if (forced) {
    if (strlen(forced) >= bytes)
      return ddp_error(DDP_ERR_INVALID, "environment variable DDP_HOST_ID is longer than %zu characters",
                       bytes - 1);
    for (const char *p = forced; *p; p++)
      if (*p <= ' ' || *p == 0x7f)
        return ddp_error(DDP_ERR_INVALID,
                         "environment variable DDP_HOST_ID=\"%s\" contains whitespace or control characters",
                         forced);
    snprintf(out, bytes, "%s", forced);
    return DDP_OK;
  }
  char name[256];
  if (gethostname(name, sizeof name) != 0) snprintf(name, sizeof name, "unknown-host");
  name[sizeof name - 1] = '\0';
  for (char *p = name; *p; p++)
    if (*p <= ' ') *p = '_';
  struct stat st;
  int n;
  if (stat("/proc/self/ns/net", &st) == 0)
    n = snprintf(out, bytes, "%.200s/%llu", name, (unsigned long long)st.st_ino);
  else
    n = snprintf(out, bytes, "%.200s", name);
  DDP_ASSERT(n > 0 && (size_t)n < bytes);
  return DDP_OK;
}
