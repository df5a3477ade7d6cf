/* Devices (include/ddp/tensor.h, "Devices"): names, existence, placement of
 * ranks, the device-neutral door to device memory (device_internal.h),
 * pinned memory, asynchronous copies and staging, and CUDA graphs (the
 * public side of src/tensor/cuda/graph.c).
 * The one place outside src/tensor/cuda/ that knows whether this build has
 * the CUDA backend: every other file compiles the same in every build. */
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "tensor/device_internal.h"
#ifdef DDP_HAVE_CUDA
#include "tensor/cuda/runtime.h"
#endif

bool ddp_cuda_built(void) {
#ifdef DDP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int ddp_cuda_device_count(void) {
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_device_count();
#else
  return 0;
#endif
}

static atomic_bool tf32_allowed;

ddp_status ddp_cuda_allow_tf32(bool allow) {
#ifndef DDP_HAVE_CUDA
  if (allow)
    return ddp_error(DDP_ERR_UNSUPPORTED, "allow_tf32: this build has no CUDA backend (TF32 is "
                     "a GPU tensor-core mode)");
#endif
  atomic_store(&tf32_allowed, allow);
  return DDP_OK;
}

bool ddp_cuda_tf32_allowed(void) { return atomic_load(&tf32_allowed); }

const char *ddp_cuda_unavailable_reason(void) {
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_unavailable_reason();
#else
  return "this build has no CUDA backend";
#endif
}

ddp_status ddp_device_pci_address(ddp_device device, char *buf, size_t bytes) {
  if (bytes) buf[0] = '\0';
  if (device.type != DDP_DEVICE_CUDA)
    return ddp_error(DDP_ERR_UNSUPPORTED, "device PCI address: %s is not a GPU",
                     device.type == DDP_DEVICE_CPU ? "cpu" : "the device");
#ifdef DDP_HAVE_CUDA
  int n = ddp__cuda_device_count();
  if (n == 0)
    return ddp_error(DDP_ERR_UNSUPPORTED, "cuda:%d: no PCI address: %s", (int)device.index,
                     ddp__cuda_unavailable_reason());
  if (device.index < 0 || device.index >= n)
    return ddp_error(DDP_ERR_INVALID, "cuda:%d: no such device (this process has %d)", (int)device.index, n);
  char raw[64];
  DDP_TRY(ddp__cuda_pci_bus_id(device.index, raw, (int)sizeof raw));
  return ddp_pci_address_normalize(raw, buf, bytes);
#else
  return ddp_error(DDP_ERR_UNSUPPORTED, "cuda:%d: no PCI address: this build has no CUDA backend",
                   (int)device.index);
#endif
}

ddp_status ddp_pci_address_normalize(const char *raw, char *buf, size_t bytes) {
  /* CUDA writes "0000:3B:00.0", NVML "00000000:3B:00.0"; sysfs
   * "0000:3b:00.0". The domain keeps its last 4 digits when the ones
   * before are zeros. */
  const char *colon = raw ? strchr(raw, ':') : NULL;
  size_t dlen = colon ? (size_t)(colon - raw) : 0;
  bool ok = colon && dlen >= 4 && strlen(colon) == 8; /* ":BB:DD.F" */
  for (size_t i = 0; ok && i + 4 < dlen; i++) ok = raw[i] == '0';
  char out[16];
  size_t k = 0;
  for (const char *p = ok ? raw + dlen - 4 : raw; ok && *p && k + 1 < sizeof out; p++) {
    char c = *p >= 'A' && *p <= 'F' ? (char)(*p - 'A' + 'a') : *p;
    bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    size_t at = k; /* "dddd:bb:dd.f": separators at 4, 7, 10 */
    ok = at == 4 || at == 7 ? c == ':' : at == 10 ? c == '.' : hex;
    out[k++] = c;
  }
  if (!ok || k != 12)
    return ddp_error(DDP_ERR_INVALID, "PCI address \"%.40s\": expected domain:bus:device.function "
                     "such as 0000:3b:00.0", raw ? raw : "(null)");
  out[k] = '\0';
  if (bytes < k + 1) return ddp_error(DDP_ERR_INVALID, "PCI address: buffer of %zu bytes", bytes);
  memcpy(buf, out, k + 1);
  return DDP_OK;
}

/* ---- Names ---------------------------------------------------------------- */

/* A decimal ordinal as torch.device reads one: digits only, no sign, no
 * leading zero, within int32. */
static bool parse_ordinal(const char *s, int32_t *out) {
  if (!*s || (s[0] == '0' && s[1])) return false;
  int64_t v = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9') return false;
    v = v * 10 + (*s - '0');
    if (v > INT32_MAX) return false;
  }
  *out = (int32_t)v;
  return true;
}

ddp_status ddp_device_parse(const char *text, ddp_device *out) {
  if (!text) return ddp_error(DDP_ERR_INVALID, "device: no text to parse (NULL)");
  if (!strcmp(text, "cpu")) {
    *out = DDP_CPU;
    return DDP_OK;
  }
  if (!strcmp(text, "cuda")) {
    *out = DDP_CUDA(0);
    return DDP_OK;
  }
  int32_t index;
  if (!strncmp(text, "cuda:", 5) && parse_ordinal(text + 5, &index)) {
    *out = DDP_CUDA(index);
    return DDP_OK;
  }
  return ddp_error(DDP_ERR_INVALID, "device \"%s\": expected cpu, cuda or cuda:N", text);
}

const char *ddp_device_str(ddp_device device, char *buf, size_t bytes) {
  switch (device.type) {
  case DDP_DEVICE_CPU: snprintf(buf, bytes, "cpu"); break;
  case DDP_DEVICE_CUDA: snprintf(buf, bytes, "cuda:%d", (int)device.index); break;
  default: snprintf(buf, bytes, "device-type-%d:%d", (int)device.type, (int)device.index); break;
  }
  return buf;
}

ddp_status ddp_device_check(ddp_device device) {
  char name[DDP_DEVICE_STR_BYTES];
  ddp_device_str(device, name, sizeof name);
  switch (device.type) {
  case DDP_DEVICE_CPU:
    if (device.index != 0)
      return ddp_error(DDP_ERR_INVALID, "cpu:%d: no such device (the CPU is index 0)",
                       (int)device.index);
    return DDP_OK;
  case DDP_DEVICE_CUDA: {
    int n = ddp_cuda_device_count();
    if (!ddp_cuda_built() || n == 0)
      return ddp_error(DDP_ERR_UNSUPPORTED, "%s: CUDA is unavailable: %s", name,
                       ddp_cuda_unavailable_reason());
    if ((device.index < 0 || device.index >= n) && n == 1)
      return ddp_error(DDP_ERR_INVALID, "%s: no such device (this process sees cuda:0 only)",
                       name);
    if (device.index < 0 || device.index >= n)
      return ddp_error(DDP_ERR_INVALID,
                       "%s: no such device (this process sees cuda:0 to cuda:%d)", name, n - 1);
    return DDP_OK;
  }
  default:
    return ddp_error(DDP_ERR_INVALID, "%s: unknown device type %d", name, (int)device.type);
  }
}

ddp_device ddp_pointer_device(const void *ptr) {
#ifdef DDP_HAVE_CUDA
  /* The count is found once; without a device the runtime is never asked
   * (a CPU job of a CUDA build pays nothing per call). */
  if (ptr && ddp_cuda_device_count() > 0) {
    int dev = ddp__cuda_pointer_device(ptr);
    if (dev >= 0) return DDP_CUDA(dev);
  }
#else
  (void)ptr;
#endif
  return DDP_CPU;
}

ddp_status ddp_device_synchronize(ddp_device device) {
  DDP_TRY(ddp_device_check(device));
  if (device.type == DDP_DEVICE_CPU) return DDP_OK;
#ifdef DDP_HAVE_CUDA
  DDP_TRY(ddp__cuda_set_device(device.index));
  return ddp__cuda_synchronize();
#else
  return ddp_error(DDP_ERR_INTERNAL, "device: synchronize reached a backend this build lacks");
#endif
}

/* ---- Placement ------------------------------------------------------------ */

ddp_status ddp__device_placement(int local_rank, int local_world, int device_count, int *index,
                                 bool *shared) {
  if (device_count < 1)
    return ddp_error(DDP_ERR_INVALID, "device placement: %d CUDA devices", device_count);
  if (local_world < 1 || local_rank < 0 || local_rank >= local_world)
    return ddp_error(DDP_ERR_INVALID,
                     "device placement: local rank %d is not one of %d local ranks", local_rank,
                     local_world);
  *index = local_rank % device_count;
  *shared = local_world > device_count;
  return DDP_OK;
}

ddp_status ddp_default_cuda_device(int local_rank, int local_world, ddp_device *out) {
  int n = ddp_cuda_device_count();
  if (n == 0)
    return ddp_error(DDP_ERR_UNSUPPORTED, "default CUDA device of local rank %d: %s",
                     local_rank, ddp_cuda_unavailable_reason());
  int index;
  bool shared;
  DDP_TRY(ddp__device_placement(local_rank, local_world, n, &index, &shared));
  static atomic_flag warned = ATOMIC_FLAG_INIT;
  if (shared && !atomic_flag_test_and_set(&warned))
    fprintf(stderr, "ddp: %d local ranks share %d CUDA devices\n", local_world, n);
  *out = DDP_CUDA(index);
  return DDP_OK;
}

/* ---- Memory --------------------------------------------------------------- */

ddp_status ddp__device_calloc(ddp_device device, size_t bytes, void **out) {
  *out = NULL;
  char name[DDP_DEVICE_STR_BYTES];
  ddp_device_str(device, name, sizeof name);
  if (device.type == DDP_DEVICE_CPU) {
    *out = ddp_calloc(bytes ? bytes : 1, 1);
    return *out ? DDP_OK : ddp_error(DDP_ERR_NOMEM, "cpu: cannot allocate %zu bytes", bytes);
  }
#ifdef DDP_HAVE_CUDA
  if (device.type == DDP_DEVICE_CUDA) {
    DDP_TRY(ddp__cuda_set_device(device.index));
    void *p = ddp__cuda_malloc(bytes);
    if (!p) return DDP_ERR_NOMEM; /* the cache's message names the device */
    ddp_status st = ddp__cuda_check(cudaMemsetAsync(p, 0, bytes, ddp__cuda_stream()),
                                    "zeroing new memory");
    if (st != DDP_OK) {
      ddp__cuda_free(p);
      return st;
    }
    *out = p;
    return DDP_OK;
  }
#endif
  return ddp_error(DDP_ERR_UNSUPPORTED, "%s: this build has no backend for it", name);
}

void ddp__device_free(ddp_device device, void *ptr) {
  if (!ptr) return;
  if (device.type == DDP_DEVICE_CPU) {
    ddp_free(ptr);
    return;
  }
#ifdef DDP_HAVE_CUDA
  if (device.type == DDP_DEVICE_CUDA) ddp__cuda_free(ptr);
#endif
}

ddp_status ddp__device_copy(ddp_device dst_device, void *dst, ddp_device src_device,
                            const void *src, size_t bytes) {
  bool dst_cpu = dst_device.type == DDP_DEVICE_CPU, src_cpu = src_device.type == DDP_DEVICE_CPU;
  if (dst_cpu && src_cpu) {
    if (bytes && dst != src) memmove(dst, src, bytes);
    return DDP_OK;
  }
#ifdef DDP_HAVE_CUDA
  bool dst_cuda = dst_device.type == DDP_DEVICE_CUDA, src_cuda = src_device.type == DDP_DEVICE_CUDA;
  if (dst_cuda && src_cpu) {
    DDP_TRY(ddp__cuda_set_device(dst_device.index));
    return ddp__cuda_copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  if (dst_cpu && src_cuda) {
    DDP_TRY(ddp__cuda_set_device(src_device.index));
    return ddp__cuda_copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  if (dst_cuda && src_cuda) {
    if (dst_device.index == src_device.index) {
      DDP_TRY(ddp__cuda_set_device(dst_device.index));
      return ddp__cuda_copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
    }
    return ddp__cuda_copy_peer(dst, dst_device.index, src, src_device.index, bytes);
  }
#endif
  char a[DDP_DEVICE_STR_BYTES], b[DDP_DEVICE_STR_BYTES];
  return ddp_error(DDP_ERR_UNSUPPORTED, "copy from %s to %s: this build has no backend for it",
                   ddp_device_str(src_device, a, sizeof a), ddp_device_str(dst_device, b, sizeof b));
}

/* ---- Pinned memory, asynchronous copies, staging ------------------------- */

/* DDP_OK when `device` is a GPU this build can use; else why not, naming
 * `what`. Leaves the device current. */
static ddp_status need_gpu(ddp_device device, const char *what) {
  char name[DDP_DEVICE_STR_BYTES];
  if (device.type != DDP_DEVICE_CUDA)
    return ddp_error(DDP_ERR_UNSUPPORTED, "%s: %s is not a GPU", what,
                     ddp_device_str(device, name, sizeof name));
  ddp_status s = ddp_device_check(device);
  if (s != DDP_OK) return ddp_error_wrap(s, "%s", what);
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_set_device(device.index);
#else
  return ddp_error(DDP_ERR_INTERNAL, "%s reached a backend this build lacks", what);
#endif
}

ddp_status ddp_pinned_alloc(ddp_device device, size_t bytes, void **out) {
  *out = NULL;
  DDP_TRY(need_gpu(device, "pinned memory"));
#ifdef DDP_HAVE_CUDA
  *out = ddp__cuda_malloc_host(bytes);
  if (*out) return DDP_OK;
  /* Refused in a capture (it may wait), else the host is out of it. */
  return ddp_error_wrap(ddp__cuda_capturing() >= 0 ? DDP_ERR_STATE : DDP_ERR_NOMEM,
                        "pinned memory");
#else
  (void)bytes;
  return DDP_ERR_INTERNAL;
#endif
}

void ddp_pinned_free(void *ptr) {
#ifdef DDP_HAVE_CUDA
  ddp__cuda_free_host(ptr);
#else
  (void)ptr; /* nothing was ever allocated */
#endif
}

ddp_status ddp_device_copy_async(ddp_device dst_device, void *dst, ddp_device src_device,
                                 const void *src, size_t bytes) {
  bool dst_gpu = dst_device.type == DDP_DEVICE_CUDA, src_gpu = src_device.type == DDP_DEVICE_CUDA;
  ddp_device gpu = dst_gpu ? dst_device : src_device;
  char a[DDP_DEVICE_STR_BYTES], b[DDP_DEVICE_STR_BYTES];
  if (!dst_gpu && !src_gpu)
    return ddp_error(DDP_ERR_UNSUPPORTED, "asynchronous copy from %s to %s: no GPU in it",
                     ddp_device_str(src_device, a, sizeof a), ddp_device_str(dst_device, b, sizeof b));
  if (dst_gpu && src_gpu && dst_device.index != src_device.index)
    return ddp_error(DDP_ERR_UNSUPPORTED,
                     "asynchronous copy from %s to %s: between GPUs use ddp_tensor_copy",
                     ddp_device_str(src_device, a, sizeof a), ddp_device_str(dst_device, b, sizeof b));
  if ((!dst_gpu && dst_device.type != DDP_DEVICE_CPU) ||
      (!src_gpu && src_device.type != DDP_DEVICE_CPU))
    return ddp_error(DDP_ERR_INVALID, "asynchronous copy from %s to %s: unknown device",
                     ddp_device_str(src_device, a, sizeof a), ddp_device_str(dst_device, b, sizeof b));
  DDP_TRY(need_gpu(gpu, "asynchronous copy"));
#ifdef DDP_HAVE_CUDA
  enum cudaMemcpyKind kind = dst_gpu && src_gpu ? cudaMemcpyDeviceToDevice
                             : dst_gpu          ? cudaMemcpyHostToDevice
                                                : cudaMemcpyDeviceToHost;
  return ddp__cuda_copy_async(dst, src, bytes, kind);
#else
  (void)dst, (void)src, (void)bytes;
  return DDP_ERR_INTERNAL;
#endif
}

struct ddp_device_stage {
  ddp_device device;
#ifdef DDP_HAVE_CUDA
  ddp__cuda_stage *cuda; /* NULL on the CPU */
#endif
};

ddp_status ddp_device_stage_create(ddp_device device, ddp_device_stage **out) {
  *out = NULL;
  if (device.type != DDP_DEVICE_CPU) DDP_TRY(need_gpu(device, "staging"));
  ddp_device_stage *stage = ddp_calloc(1, sizeof *stage);
  if (!stage) return ddp_error(DDP_ERR_NOMEM, "staging: out of memory");
  stage->device = device;
#ifdef DDP_HAVE_CUDA
  if (device.type == DDP_DEVICE_CUDA) {
    ddp_status s = ddp__cuda_stage_create(&stage->cuda);
    if (s != DDP_OK) {
      ddp_free(stage);
      return s;
    }
  }
#endif
  *out = stage;
  return DDP_OK;
}

ddp_status ddp_device_stage_upload(ddp_device_stage *stage, int n, void *const *dst,
                                   const void *const *src, const size_t *bytes) {
  if (!stage || n < 0 || (n > 0 && (!dst || !src || !bytes)))
    return ddp_error(DDP_ERR_INVALID, "staging: a NULL stage or buffer list, or n = %d", n);
#ifdef DDP_HAVE_CUDA
  if (stage->cuda) return ddp__cuda_stage_upload(stage->cuda, n, dst, src, bytes);
#endif
  for (int i = 0; i < n; i++)
    if (bytes[i] && dst[i] != src[i]) memmove(dst[i], src[i], bytes[i]);
  return DDP_OK;
}

void ddp_device_stage_destroy(ddp_device_stage *stage) {
  if (!stage) return;
#ifdef DDP_HAVE_CUDA
  ddp__cuda_stage_destroy(stage->cuda);
#endif
  ddp_free(stage);
}

/* ---- CUDA graphs ----------------------------------------------------------- */

ddp_status ddp_cuda_graph_begin(ddp_device device) {
  DDP_TRY(need_gpu(device, "CUDA graph capture"));
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_graph_begin(device.index);
#else
  return DDP_ERR_INTERNAL;
#endif
}

ddp_status ddp_cuda_graph_end(ddp_device device, ddp_cuda_graph **out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_cuda_graph_end: out is NULL");
  *out = NULL;
  DDP_TRY(need_gpu(device, "CUDA graph capture"));
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_graph_end(device.index, out);
#else
  return DDP_ERR_INTERNAL;
#endif
}

ddp_status ddp_cuda_graph_replay(ddp_cuda_graph *graph) {
#ifdef DDP_HAVE_CUDA
  return ddp__cuda_graph_replay(graph);
#else
  (void)graph; /* no graph can have been made */
  return ddp_error(DDP_ERR_UNSUPPORTED, "CUDA graph replay: this build has no CUDA backend");
#endif
}

void ddp_cuda_graph_destroy(ddp_cuda_graph *graph) {
#ifdef DDP_HAVE_CUDA
  ddp__cuda_graph_destroy(graph);
#else
  (void)graph;
#endif
}
