/* Loads libnccl at run time (nccl_api.h says why and where from). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "comm/nccl/nccl_api.h"
#include "ddp/comm.h"
#include "core/core_internal.h"

#ifndef DDP_NCCL_DIR
#define DDP_NCCL_DIR ""
#endif

int ddp__nccl_api_candidates(const char **out) {
  const char *env = ddp_env_str("DDP_NCCL_LIBRARY", "");
  if (env[0]) {
    out[0] = env;
    return 1;
  }
  int n = 0;
  out[n++] = "libnccl.so.2";
  if (DDP_NCCL_DIR[0]) out[n++] = DDP_NCCL_DIR "/libnccl.so.2";
  return n;
}

void ddp__nccl_version_str(int code, char *buf, size_t bytes) {
  /* NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after. */
  int major, minor, patch;
  if (code >= 10000) {
    major = code / 10000, minor = code / 100 % 100, patch = code % 100;
  } else {
    major = code / 1000, minor = code / 100 % 10, patch = code % 100;
  }
  snprintf(buf, bytes, "%d.%d.%d", major, minor, patch);
}

/* Resolves one function; false (with the name in *missing) when absent. */
static bool resolve(void *h, const char *name, void **slot, const char **missing) {
  *slot = dlsym(h, name);
  if (!*slot && !*missing) *missing = name;
  return *slot != NULL;
}

static bool resolve_all(ddp__nccl_api *a, const char **missing) {
  void *h = a->handle;
  bool ok = true;
#define R(field) ok &= resolve(h, "nccl" #field, (void **)&a->field, missing)
  R(GetVersion);
  R(GetErrorString);
  R(GetLastError);
  R(GetUniqueId);
  R(CommInitRank);
  R(CommDestroy);
  R(CommAbort);
  R(CommGetAsyncError);
  R(AllReduce);
  R(Broadcast);
  R(Reduce);
  R(AllGather);
  R(ReduceScatter);
  R(Send);
  R(Recv);
  R(GroupStart);
  R(GroupEnd);
#undef R
  return ok;
}

ddp_status ddp__nccl_api_open(const char *const *candidates, int n, ddp__nccl_api *api) {
  memset(api, 0, sizeof *api);
  char tried[1536] = "";
  size_t used = 0;
  for (int i = 0; i < n; i++) {
    /* RTLD_LOCAL: NCCL's symbols stay out of the global namespace, so a
     * PyTorch loaded into the same process keeps its own. */
    void *h = dlopen(candidates[i], RTLD_NOW | RTLD_LOCAL);
    const char *why = h ? NULL : dlerror();
    if (h) {
      api->handle = h;
      const char *missing = NULL;
      int version = 0;
      if (resolve_all(api, &missing) && api->GetVersion(&version) == ncclSuccess) {
        snprintf(api->path, sizeof api->path, "%s", candidates[i]);
        api->version = version;
        return DDP_OK;
      }
      why = missing ? "lacks a function this backend calls" : "ncclGetVersion failed";
      if (missing) {
        char m[160];
        snprintf(m, sizeof m, "lacks %s (NCCL older than 2.13?)", missing);
        used += (size_t)snprintf(tried + used, used < sizeof tried ? sizeof tried - used : 0,
                                 "%s%s: %s", used ? "; " : "", candidates[i], m);
        why = NULL;
      }
      dlclose(h);
      memset(api, 0, sizeof *api);
    }
    if (why && used < sizeof tried)
      used += (size_t)snprintf(tried + used, sizeof tried - used, "%s%s: %s", used ? "; " : "",
                               candidates[i], why);
  }
  return ddp_error(DDP_ERR_UNSUPPORTED,
                   "NCCL: no usable libnccl.so.2 (tried %s); install NCCL (PyTorch's wheel brings "
                   "one: put its nvidia/nccl/lib on LD_LIBRARY_PATH) or name the library in "
                   "DDP_NCCL_LIBRARY, or use backend \"ddp\"",
                   tried[0] ? tried : "nothing");
}

/* Loaded once and kept; a failure is not kept, so that a program (or a
 * test) that fixes DDP_NCCL_LIBRARY can try again (dlopen fails fast). */
static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static ddp__nccl_api loaded;
static bool load_done;

ddp_status ddp__nccl_api_get(const ddp__nccl_api **out) {
  *out = NULL;
  pthread_mutex_lock(&load_mu);
  ddp_status st = DDP_OK;
  if (!load_done) {
    const char *cands[3];
    int n = ddp__nccl_api_candidates(cands);
    st = ddp__nccl_api_open(cands, n, &loaded);
    if (st == DDP_OK) {
      load_done = true;
      char v[32];
      ddp__nccl_version_str(loaded.version, v, sizeof v);
      ddp_log(DDP_LOG_INFO, "NCCL %s loaded from %s", v, loaded.path);
    }
  }
  pthread_mutex_unlock(&load_mu);
  if (st == DDP_OK) *out = &loaded;
  return st;
}

ddp_status ddp_nccl_version(char *buf, size_t bytes) {
  if (buf && bytes) buf[0] = 0;
  const ddp__nccl_api *api = NULL;
  DDP_TRY(ddp__nccl_api_get(&api));
  char v[32];
  ddp__nccl_version_str(api->version, v, sizeof v);
  if (buf && bytes) snprintf(buf, bytes, "%s (%s)", v, api->path);
  return DDP_OK;
}
