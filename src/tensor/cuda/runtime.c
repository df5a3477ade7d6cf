/* The CUDA runtime of the tensor layer (runtime.h): the device count found
 * once, per device a compute stream, an event ordering cross-device
 * copies, a caching allocator over cudaMalloc (tensor/block_cache.c), a
 * cuBLAS handle, the losses' target-check slot, and the pending error that
 * void functions leave for the next synchronize; pinned host memory,
 * copies and the staging of batches. A device's state is made on its
 * first use. While a thread captures a CUDA graph (graph.c), what would
 * wait for the device is refused here and memory is routed through the
 * graph's pool. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/block_cache.h"
#include "tensor/cuda/runtime.h"

/* cuBLAS's workspace (the size NVIDIA recommends for Hopper). Given
 * explicitly from our allocator so cuBLAS never calls cudaMalloc itself,
 * which a CUDA graph capture of a step would not allow. */
#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)

typedef struct cuda_dev {
  int index;
  char name[16];          /* "cuda:N", in messages */
  pthread_mutex_t lock;   /* making the state below */
  /* Guards `pending` only: an error may be deferred while `lock` is held
   * (a cudaFree failing in a flush inside cuBLAS's setup). */
  pthread_mutex_t pending_lock;
  atomic_int ready;       /* stream, event and cache made */
  atomic_int cublas_state; /* 0 not tried, 1 made, -1 failed */
  cudaStream_t stream;
  cudaEvent_t event;
  ddp__block_cache *cache;
  cublasHandle_t cublas;
  void *cublas_workspace;
  ddp_status pending;     /* DDP_OK, or an error for the next synchronize */
  char pending_msg[512];
  /* The losses' target check (runtime.h): pinned host memory mapped into
   * the device; kernels write it through target_dev, the host reads
   * target_host after a wait (under pending_lock). */
  ddp__cuda_target_error *target_host, *target_dev;
} cuda_dev;

static pthread_once_t count_once = PTHREAD_ONCE_INIT;
static int device_count;
static char unavailable[512];
static cuda_dev *devices; /* device_count of them, never freed */

/* ---- Devices -------------------------------------------------------------- */

static void count_devices(void) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    snprintf(unavailable, sizeof unavailable, "%s%s (%s)%s%s%s",
             err == cudaErrorNoDevice ? "no CUDA device: " : "", cudaGetErrorString(err),
             cudaGetErrorName(err), visible ? "; CUDA_VISIBLE_DEVICES=\"" : "",
             visible ? visible : "", visible ? "\"" : "");
    return;
  }
  if (n <= 0) {
    snprintf(unavailable, sizeof unavailable, "no CUDA device");
    return;
  }
  devices = ddp_calloc((size_t)n, sizeof *devices);
  if (!devices) {
    snprintf(unavailable, sizeof unavailable,
             "cannot allocate the state of %d CUDA devices", n);
    return;
  }
  for (int i = 0; i < n; i++) {
    devices[i].index = i;
    snprintf(devices[i].name, sizeof devices[i].name, "cuda:%d", i);
    pthread_mutex_init(&devices[i].lock, NULL);
    pthread_mutex_init(&devices[i].pending_lock, NULL);
  }
  device_count = n;
}

int ddp__cuda_device_count(void) {
  pthread_once(&count_once, count_devices);
  return device_count;
}

const char *ddp__cuda_unavailable_reason(void) {
  return ddp__cuda_device_count() > 0 ? NULL : unavailable;
}

ddp_status ddp__cuda_pci_bus_id(int device, char *buf, int bytes) {
  cudaError_t e = cudaDeviceGetPCIBusId(buf, bytes, device);
  if (e == cudaSuccess) return DDP_OK;
  (void)cudaGetLastError();
  return ddp_error(DDP_ERR_INVALID, "cuda:%d: cudaDeviceGetPCIBusId: %s", device, cudaGetErrorString(e));
}

int ddp__cuda_current_device(void) {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return d;
}

ddp_status ddp__cuda_set_device(int device) {
  int n = ddp__cuda_device_count();
  if (n == 0)
    return ddp_error(DDP_ERR_UNSUPPORTED, "cuda:%d: CUDA is unavailable: %s", device,
                     unavailable);
  if (device < 0 || device >= n) {
    if (n == 1)
      return ddp_error(DDP_ERR_INVALID,
                       "cuda:%d: no such device (this process sees cuda:0 only)", device);
    return ddp_error(DDP_ERR_INVALID,
                     "cuda:%d: no such device (this process sees cuda:0 to cuda:%d)", device,
                     n - 1);
  }
  return ddp__cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

/* The name of the current device for messages ("cuda" when unknown). */
static void current_name(char *buf, size_t bytes) {
  int d;
  if (ddp__cuda_device_count() > 0 && cudaGetDevice(&d) == cudaSuccess)
    snprintf(buf, bytes, "cuda:%d", d);
  else
    snprintf(buf, bytes, "cuda");
}

ddp_status ddp__cuda_check(cudaError_t err, const char *what) {
  if (err == cudaSuccess) return DDP_OK;
  /* Forget it in CUDA's per-thread last error: it is handled here. (A
   * sticky error, a fault in a kernel, stays with the context anyway.) */
  (void)cudaGetLastError();
  ddp_status st;
  switch (err) {
  case cudaErrorMemoryAllocation: st = DDP_ERR_NOMEM; break;
  case cudaErrorInvalidValue:
  case cudaErrorInvalidDevice:
  case cudaErrorInvalidDevicePointer:
  case cudaErrorInvalidMemcpyDirection:
  case cudaErrorInvalidResourceHandle: st = DDP_ERR_INVALID; break;
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver: st = DDP_ERR_UNSUPPORTED; break;
  default: st = DDP_ERR_IO; break;
  }
  char name[16];
  current_name(name, sizeof name);
  return ddp_error(st, "%s: %s: %s: %s", name, what, cudaGetErrorName(err),
                   cudaGetErrorString(err));
}

ddp_status ddp__cublas_check(cublasStatus_t status, const char *what) {
  if (status == CUBLAS_STATUS_SUCCESS) return DDP_OK;
  ddp_status st;
  switch (status) {
  case CUBLAS_STATUS_ALLOC_FAILED: st = DDP_ERR_NOMEM; break;
  case CUBLAS_STATUS_INVALID_VALUE: st = DDP_ERR_INVALID; break;
  case CUBLAS_STATUS_NOT_SUPPORTED:
  case CUBLAS_STATUS_ARCH_MISMATCH: st = DDP_ERR_UNSUPPORTED; break;
  default: st = DDP_ERR_IO; break;
  }
  char name[16];
  current_name(name, sizeof name);
  return ddp_error(st, "%s: %s: %s: %s", name, what, cublasGetStatusName(status),
                   cublasGetStatusString(status));
}

/* The state of the current device, or NULL (error set) when there is none. */
static cuda_dev *current_dev(void) {
  int n = ddp__cuda_device_count();
  if (n == 0) {
    ddp_error(DDP_ERR_UNSUPPORTED, "cuda: CUDA is unavailable: %s", unavailable);
    return NULL;
  }
  int d = ddp__cuda_current_device();
  if (d < 0 || d >= n) {
    ddp_error(DDP_ERR_INTERNAL, "cuda: the current device %d is not one of %d", d, n);
    return NULL;
  }
  return &devices[d];
}

static void defer_on(cuda_dev *d, ddp_status status) {
  /* During this thread's capture the error belongs to the capture, which
   * its end reports, not to a later synchronize. */
  if (ddp__cuda_capturing() == d->index) {
    ddp__cuda_capture_note(status);
    return;
  }
  pthread_mutex_lock(&d->pending_lock);
  if (d->pending == DDP_OK) {
    d->pending = status;
    snprintf(d->pending_msg, sizeof d->pending_msg, "%s", ddp_last_error());
  }
  pthread_mutex_unlock(&d->pending_lock);
}

void ddp__cuda_defer(ddp_status status) {
  if (status == DDP_OK) return;
  cuda_dev *d = current_dev();
  if (d) defer_on(d, status);
}

/* ---- The caching allocator's backend --------------------------------------- */

/* cudaMalloc/cudaFree on the block cache's device, whichever is current
 * (a flush may run from a free on another device). */
static void *block_alloc(void *ctx, size_t bytes) {
  cuda_dev *d = ctx;
  if (ddp__cuda_capturing() >= 0) {
    /* cudaMalloc would end the capture (it may synchronize). */
    ddp_error(DDP_ERR_STATE,
              "%s: cudaMalloc of %zu bytes during a CUDA graph capture: the captured work needs "
              "memory the caching allocator does not hold yet; run the same step eagerly "
              "(warm-up steps) before capturing it",
              d->name, bytes);
    return NULL;
  }
  int prev = ddp__cuda_current_device();
  if (prev != d->index && ddp__cuda_check(cudaSetDevice(d->index), "cudaSetDevice") != DDP_OK)
    return NULL;
  void *p = NULL;
  char what[64];
  snprintf(what, sizeof what, "cudaMalloc of %zu bytes", bytes);
  ddp_status st = ddp__cuda_check(cudaMalloc(&p, bytes), what);
  if (prev != d->index) cudaSetDevice(prev);
  return st == DDP_OK ? p : NULL;
}

static void block_free(void *ctx, void *ptr) {
  cuda_dev *d = ctx;
  if (ddp__cuda_capturing() >= 0) { /* cudaFree synchronizes: after the capture */
    ddp__cuda_capture_defer_free(d->index, ptr);
    return;
  }
  int prev = ddp__cuda_current_device();
  if (prev != d->index) cudaSetDevice(d->index);
  /* cudaFree waits for the device: only emptying the cache gets here. */
  ddp_status st = ddp__cuda_check(cudaFree(ptr), "cudaFree");
  if (st != DDP_OK) defer_on(d, st);
  if (prev != d->index) cudaSetDevice(prev);
}

/* Makes the device's stream, event and cache on its first use. Leaves the
 * current device as it was. */
static ddp_status dev_ready(cuda_dev *d) {
  if (atomic_load_explicit(&d->ready, memory_order_acquire)) return DDP_OK;
  pthread_mutex_lock(&d->lock);
  ddp_status st = DDP_OK;
  if (!atomic_load_explicit(&d->ready, memory_order_relaxed)) {
    int prev = ddp__cuda_current_device();
    st = ddp__cuda_check(cudaSetDevice(d->index), "cudaSetDevice");
    if (st == DDP_OK && !d->stream)
      st = ddp__cuda_check(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking),
                           "creating the compute stream");
    if (st == DDP_OK && !d->event)
      st = ddp__cuda_check(cudaEventCreateWithFlags(&d->event, cudaEventDisableTiming),
                           "creating its event");
    if (st == DDP_OK && !d->cache) {
      ddp__block_backend backend = {d->name, block_alloc, block_free, d};
      st = ddp__block_cache_create(&backend, &d->cache);
    }
    if (st == DDP_OK && !d->target_host) {
      /* Mapped, so kernels write it without a copy; portable, so any
       * context may touch it. */
      void *h = NULL, *dp = NULL;
      st = ddp__cuda_check(cudaHostAlloc(&h, sizeof(ddp__cuda_target_error),
                                         cudaHostAllocMapped | cudaHostAllocPortable),
                           "allocating the losses' target-check slot");
      if (st == DDP_OK) st = ddp__cuda_check(cudaHostGetDevicePointer(&dp, h, 0),
                                             "mapping the losses' target-check slot");
      if (st == DDP_OK) {
        d->target_host = h;
        d->target_dev = dp;
        d->target_host->sample = -1;
      } else if (h) {
        cudaFreeHost(h);
      }
    }
    if (st == DDP_OK) atomic_store_explicit(&d->ready, 1, memory_order_release);
    if (prev != d->index) cudaSetDevice(prev);
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

/* The current device, made ready; NULL with the error set. */
static cuda_dev *ready_dev(void) {
  cuda_dev *d = current_dev();
  if (d && dev_ready(d) != DDP_OK) return NULL;
  return d;
}

cudaStream_t ddp__cuda_stream(void) {
  cuda_dev *d = current_dev();
  if (!d) return NULL;
  ddp_status st = dev_ready(d);
  if (st != DDP_OK) {
    /* The kernels then run on the legacy default stream (still in order)
     * and the next synchronize reports why. */
    defer_on(d, st);
    return NULL;
  }
  return d->stream;
}

/* Creates the handle of device d (current, ready), bound to its stream:
 * float32 in FMA math (no TF32, no reduced-precision reductions), no
 * atomics (deterministic), our workspace. */
static ddp_status cublas_make(cuda_dev *d) {
  ddp_status st = ddp__cublas_check(cublasCreate(&d->cublas), "cublasCreate");
  if (st != DDP_OK) {
    d->cublas = NULL;
    return st;
  }
  d->cublas_workspace = ddp__block_cache_alloc(d->cache, CUBLAS_WORKSPACE_BYTES);
  if (!d->cublas_workspace) st = DDP_ERR_NOMEM;
  if (st == DDP_OK)
    st = ddp__cublas_check(cublasSetStream(d->cublas, d->stream), "cublasSetStream");
  /* After cublasSetStream, which resets the workspace to cuBLAS's own. */
  if (st == DDP_OK)
    st = ddp__cublas_check(
        cublasSetWorkspace(d->cublas, d->cublas_workspace, CUBLAS_WORKSPACE_BYTES),
        "cublasSetWorkspace");
  if (st == DDP_OK)
    st = ddp__cublas_check(
        cublasSetMathMode(d->cublas, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
        "cublasSetMathMode");
  if (st == DDP_OK)
    st = ddp__cublas_check(cublasSetAtomicsMode(d->cublas, CUBLAS_ATOMICS_NOT_ALLOWED),
                           "cublasSetAtomicsMode");
  if (st != DDP_OK) {
    (void)cublasDestroy(d->cublas);
    d->cublas = NULL;
    ddp__block_cache_free(d->cache, d->cublas_workspace);
    d->cublas_workspace = NULL;
  }
  return st;
}

cublasHandle_t ddp__cuda_cublas(void) {
  cuda_dev *d = ready_dev();
  if (!d) {
    ddp__cuda_defer(DDP_ERR_UNSUPPORTED);
    return NULL;
  }
  int state = atomic_load_explicit(&d->cublas_state, memory_order_acquire);
  if (state == 0) {
    pthread_mutex_lock(&d->lock);
    state = atomic_load_explicit(&d->cublas_state, memory_order_relaxed);
    ddp_status st = DDP_OK;
    if (state == 0) {
      st = cublas_make(d);
      state = st == DDP_OK ? 1 : -1;
      atomic_store_explicit(&d->cublas_state, state, memory_order_release);
    }
    pthread_mutex_unlock(&d->lock);
    /* The kernels report it at the next synchronize (once: later calls
     * find the state -1 and return NULL quietly). */
    if (st != DDP_OK) defer_on(d, st);
  }
  return state == 1 ? d->cublas : NULL;
}

/* The loss's target error the slot holds, reported and cleared; DDP_OK
 * when there is none. Called after the stream's wait: the kernels that
 * could write the slot are done. */
static ddp_status take_target_error(cuda_dev *d) {
  if (!d->target_host) return DDP_OK;
  pthread_mutex_lock(&d->pending_lock);
  ddp__cuda_target_error e = *d->target_host;
  d->target_host->sample = -1;
  pthread_mutex_unlock(&d->pending_lock);
  if (e.sample < 0) return DDP_OK;
  return ddp_error(DDP_ERR_RANGE,
                   "%s: %s: target[%lld] = %lld is out of range for %lld classes (found by the "
                   "loss on the device, reported at the next synchronize)",
                   d->name, e.op == DDP__CUDA_TARGET_CROSS_ENTROPY ? "cross_entropy" : "nll_loss",
                   (long long)e.sample, (long long)e.value, (long long)e.classes);
}

ddp_status ddp__cuda_synchronize(void) {
  if (ddp__cuda_capturing() >= 0)
    return ddp__cuda_capture_refuse("synchronize",
                                    "captured work cannot wait for the device (read results "
                                    "after ddp_cuda_graph_end and a replay)");
  cuda_dev *d = ready_dev();
  if (!d) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "synchronize");
  ddp_status pending;
  char msg[sizeof d->pending_msg];
  pthread_mutex_lock(&d->pending_lock);
  pending = d->pending;
  memcpy(msg, d->pending_msg, sizeof msg);
  d->pending = DDP_OK;
  pthread_mutex_unlock(&d->pending_lock);
  /* Wait first, so the device is idle whatever is reported. */
  ddp_status st = ddp__cuda_check(cudaStreamSynchronize(d->stream), "synchronize");
  if (pending != DDP_OK) return ddp_error(pending, "%s", msg);
  if (st != DDP_OK) return DDP_ERR_IO;
  /* A launch that failed (bad configuration, no kernel image for this GPU)
   * left its error in this thread's last error, not in the stream. */
  st = ddp__cuda_check(cudaGetLastError(), "a kernel launch before synchronize");
  if (st != DDP_OK) return DDP_ERR_IO;
  return take_target_error(d);
}

ddp__cuda_target_error *ddp__cuda_target_error_slot(void) {
  cuda_dev *d = ready_dev();
  return d ? d->target_dev : NULL;
}

/* ---- Memory --------------------------------------------------------------- */

void *ddp__cuda_malloc(size_t bytes) {
  cuda_dev *d = ready_dev();
  if (!d) return NULL;
  if (ddp__cuda_capturing() == d->index) return ddp__cuda_capture_alloc(d->cache, bytes);
  return ddp__block_cache_alloc(d->cache, bytes);
}

/* The device whose cache holds the block at ptr (the current one first). */
static cuda_dev *owner_of(const void *ptr) {
  int n = ddp__cuda_device_count(), cur = ddp__cuda_current_device();
  for (int k = 0; k < n; k++) {
    cuda_dev *d = &devices[(cur + k) % n];
    if (atomic_load_explicit(&d->ready, memory_order_acquire) &&
        ddp__block_cache_contains(d->cache, ptr))
      return d;
  }
  return NULL;
}

void ddp__cuda_free(void *ptr) {
  if (!ptr) return;
  cuda_dev *d = owner_of(ptr);
  if (!d) {
    ddp__cuda_defer(ddp_error(DDP_ERR_INVALID,
                              "ddp__cuda_free: %p is not a block from ddp__cuda_malloc", ptr));
    return;
  }
  /* A block a graph's replays write stays with the graph. */
  if (ddp__cuda_pool_take(d->index, d->cache, ptr)) return;
  ddp_status st = ddp__block_cache_free(d->cache, ptr);
  if (st != DDP_OK) defer_on(d, st);
}

ddp__block_cache *ddp__cuda_cache(int device) {
  if (device < 0 || device >= ddp__cuda_device_count()) return NULL;
  cuda_dev *d = &devices[device];
  return atomic_load_explicit(&d->ready, memory_order_acquire) ? d->cache : NULL;
}

void ddp__cuda_mem_stats_get(ddp__cuda_mem_stats *out) {
  memset(out, 0, sizeof *out);
  cuda_dev *d = ready_dev();
  if (!d) return;
  ddp__block_stats s;
  ddp__block_cache_stats(d->cache, &s);
  out->driver_allocs = s.driver_allocs;
  out->bytes_reserved = s.bytes_reserved;
  out->bytes_in_use = s.bytes_in_use;
}

static void arena_zero(void *ptr, size_t bytes) {
  ddp__cuda_defer(ddp__cuda_check(cudaMemsetAsync(ptr, 0, bytes, ddp__cuda_stream()),
                                  "arena: cudaMemsetAsync"));
}

static const ddp_arena_backing cuda_backing = {
    .name = "cuda",
    .alloc = ddp__cuda_malloc,
    .free = ddp__cuda_free,
    .zero = arena_zero,
};

const ddp_arena_backing *ddp__cuda_arena_backing(void) { return &cuda_backing; }

/* ---- Pinned host memory ----------------------------------------------------- */

/* Every live ddp__cuda_malloc_host block, so that a copy can tell pinned
 * memory from pageable without asking the driver. A handful at most
 * (staging buffers, read-back scalars): a plain array. */
typedef struct pinned_block {
  char *ptr;
  size_t bytes;
} pinned_block;
static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;
static pinned_block *pinned;
static size_t n_pinned, cap_pinned;

void *ddp__cuda_malloc_host(size_t bytes) {
  if (ddp__cuda_capturing() >= 0) {
    ddp__cuda_capture_refuse("cudaMallocHost", "it may wait for the device; allocate pinned "
                                               "memory before the capture");
    return NULL;
  }
  if (!current_dev()) return NULL;
  if (bytes == 0) bytes = 1;
  pthread_mutex_lock(&pinned_lock);
  if (n_pinned == cap_pinned) {
    size_t cap = cap_pinned ? 2 * cap_pinned : 16;
    pinned_block *grown = ddp_realloc(pinned, n_pinned * sizeof *grown, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&pinned_lock);
      ddp_error(DDP_ERR_NOMEM, "cudaMallocHost of %zu bytes: no host memory for its record", bytes);
      return NULL;
    }
    pinned = grown;
    cap_pinned = cap;
  }
  void *p = NULL;
  char what[64];
  snprintf(what, sizeof what, "cudaMallocHost of %zu bytes", bytes);
  if (ddp__cuda_check(cudaMallocHost(&p, bytes), what) == DDP_OK)
    pinned[n_pinned++] = (pinned_block){p, bytes};
  pthread_mutex_unlock(&pinned_lock);
  return p;
}

void ddp__cuda_free_host(void *ptr) {
  if (!ptr) return;
  if (ddp__cuda_capturing() >= 0) {
    ddp__cuda_capture_refuse("cudaFreeHost", "it waits for the device; free pinned memory "
                                             "after the capture (the block is kept)");
    return;
  }
  pthread_mutex_lock(&pinned_lock);
  size_t i = 0;
  while (i < n_pinned && pinned[i].ptr != ptr) i++;
  if (i < n_pinned) pinned[i] = pinned[--n_pinned];
  pthread_mutex_unlock(&pinned_lock);
  /* A pointer not found is still given to cudaFreeHost, which says why. */
  ddp__cuda_defer(ddp__cuda_check(cudaFreeHost(ptr), "cudaFreeHost"));
}

bool ddp__cuda_is_pinned(const void *ptr, size_t bytes) {
  const char *p = ptr;
  bool found = false;
  pthread_mutex_lock(&pinned_lock);
  for (size_t i = 0; i < n_pinned && !found; i++)
    found = p >= pinned[i].ptr && bytes <= pinned[i].bytes &&
            (size_t)(p - pinned[i].ptr) <= pinned[i].bytes - bytes;
  pthread_mutex_unlock(&pinned_lock);
  return found;
}

int ddp__cuda_pointer_device(const void *ptr) {
  if (!ptr) return -1;
  struct cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError(); /* an unknown pointer is an answer, not an error */
    return -1;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) return attr.device;
  return -1;
}

/* ---- Copies --------------------------------------------------------------- */

static const char *kind_name(enum cudaMemcpyKind kind) {
  switch (kind) {
  case cudaMemcpyHostToDevice: return "host to device";
  case cudaMemcpyDeviceToHost: return "device to host";
  case cudaMemcpyDeviceToDevice: return "device to device";
  case cudaMemcpyHostToHost: return "host to host";
  case cudaMemcpyDefault: return "of the kind its pointers say";
  default: return "of an unknown kind";
  }
}

ddp_status ddp__cuda_copy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
  cuda_dev *d = ready_dev();
  if (!d) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "copy");
  if (bytes == 0) return DDP_OK;
  char what[96];
  snprintf(what, sizeof what, "copy of %zu bytes %s", bytes, kind_name(kind));
  if (ddp__cuda_capturing() >= 0 && kind != cudaMemcpyDeviceToDevice &&
      (kind != cudaMemcpyHostToDevice || !ddp__cuda_is_pinned(src, bytes)))
    return ddp__cuda_capture_refuse(
        what, kind == cudaMemcpyHostToDevice
                  ? "a replay would copy from pageable memory the host has rewritten since; "
                    "copy from pinned memory (ddp_pinned_alloc) or before the capture"
                  : "it waits for the device; copy asynchronously into pinned memory "
                    "(ddp_device_copy_async) and read it after a replay's synchronize");
  DDP_TRY(ddp__cuda_check(cudaMemcpyAsync(dst, src, bytes, kind, d->stream), what));
  if (kind != cudaMemcpyDeviceToHost) return DDP_OK;
  /* The caller reads the result next. */
  ddp_status st = ddp__cuda_synchronize();
  return st == DDP_OK ? st : ddp_error_wrap(st, "%s", what);
}

ddp_status ddp__cuda_copy_async(void *dst, const void *src, size_t bytes,
                                enum cudaMemcpyKind kind) {
  cuda_dev *d = ready_dev();
  if (!d) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "asynchronous copy");
  char what[96];
  snprintf(what, sizeof what, "asynchronous copy of %zu bytes %s", bytes, kind_name(kind));
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost &&
      kind != cudaMemcpyDeviceToDevice)
    return ddp_error(DDP_ERR_INVALID, "%s: %s: host to device, device to host or device to "
                                      "device only", d->name, what);
  const void *host = kind == cudaMemcpyHostToDevice ? src
                     : kind == cudaMemcpyDeviceToHost ? dst
                                                       : NULL;
  /* Pageable memory would make the copy synchronous, or in a graph
   * replay it from memory the host has moved on from. */
  if (host && !ddp__cuda_is_pinned(host, bytes))
    return ddp_error(DDP_ERR_INVALID,
                     "%s: %s: the host memory at %p is not pinned (ddp_pinned_alloc)", d->name,
                     what, host);
  if (bytes == 0) return DDP_OK;
  return ddp__cuda_check(cudaMemcpyAsync(dst, src, bytes, kind, d->stream), what);
}

ddp_status ddp__cuda_copy_peer(void *dst, int dst_device, const void *src, int src_device,
                               size_t bytes) {
  if (ddp__cuda_capturing() >= 0)
    return ddp__cuda_capture_refuse("a copy between devices",
                                    "a graph captures one device's stream");
  DDP_TRY(ddp__cuda_set_device(src_device));
  DDP_TRY(ddp__cuda_set_device(dst_device));
  if (src_device == dst_device) return ddp__cuda_copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cuda_dev *s = &devices[src_device], *t = &devices[dst_device];
  DDP_TRY(dev_ready(s));
  DDP_TRY(dev_ready(t));
  if (bytes == 0) return DDP_OK;
  char what[96];
  snprintf(what, sizeof what, "copy of %zu bytes from cuda:%d", bytes, src_device);
  /* The copy waits for src's producers on s's stream; s's later work
   * (a reuse of the source's block) waits for the copy. */
  DDP_TRY(ddp__cuda_set_device(src_device));
  DDP_TRY(ddp__cuda_check(cudaEventRecord(s->event, s->stream), what));
  DDP_TRY(ddp__cuda_set_device(dst_device));
  DDP_TRY(ddp__cuda_check(cudaStreamWaitEvent(t->stream, s->event, 0), what));
  DDP_TRY(ddp__cuda_check(
      cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, t->stream), what));
  DDP_TRY(ddp__cuda_check(cudaEventRecord(t->event, t->stream), what));
  DDP_TRY(ddp__cuda_set_device(src_device));
  DDP_TRY(ddp__cuda_check(cudaStreamWaitEvent(s->stream, t->event, 0), what));
  return ddp__cuda_set_device(dst_device);
}

/* ---- Staging ---------------------------------------------------------------- */

#define STAGE_BUFFERS 2
#define STAGE_ALIGN ((size_t)256) /* each piece starts aligned, as cudaMalloc's blocks */

typedef struct stage_buffer {
  char *host;         /* pinned, `bytes` */
  size_t bytes;
  cudaEvent_t copied; /* recorded after the copies out of host */
  bool in_flight;     /* copied recorded and not waited for */
} stage_buffer;

struct ddp__cuda_stage {
  int device;
  stage_buffer buf[STAGE_BUFFERS];
  int next;
};

void ddp__cuda_stage_destroy(ddp__cuda_stage *stage) {
  if (!stage) return;
  int prev = ddp__cuda_current_device();
  cudaSetDevice(stage->device);
  for (int i = 0; i < STAGE_BUFFERS; i++) {
    stage_buffer *b = &stage->buf[i];
    if (b->in_flight) ddp__cuda_defer(ddp__cuda_check(cudaEventSynchronize(b->copied), "stage"));
    ddp__cuda_free_host(b->host);
    if (b->copied) cudaEventDestroy(b->copied);
  }
  cudaSetDevice(prev);
  ddp_free(stage);
}

ddp_status ddp__cuda_stage_create(ddp__cuda_stage **out) {
  *out = NULL;
  cuda_dev *d = ready_dev();
  if (!d) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "staging");
  ddp__cuda_stage *stage = ddp_calloc(1, sizeof *stage);
  if (!stage) return ddp_error(DDP_ERR_NOMEM, "%s: staging: out of host memory", d->name);
  stage->device = d->index;
  for (int i = 0; i < STAGE_BUFFERS; i++) {
    ddp_status st = ddp__cuda_check(
        cudaEventCreateWithFlags(&stage->buf[i].copied, cudaEventDisableTiming),
        "staging: creating an event");
    if (st != DDP_OK) {
      ddp__cuda_stage_destroy(stage);
      return st;
    }
  }
  *out = stage;
  return DDP_OK;
}

ddp_status ddp__cuda_stage_upload(ddp__cuda_stage *stage, int n, void *const *dst,
                                  const void *const *src, const size_t *bytes) {
  if (ddp__cuda_capturing() >= 0)
    return ddp__cuda_capture_refuse("staging an upload",
                                    "a replay would copy from a buffer the host refills; "
                                    "upload before the capture");
  DDP_TRY(ddp__cuda_set_device(stage->device));
  cuda_dev *d = ready_dev();
  if (!d) return ddp_error_wrap(DDP_ERR_UNSUPPORTED, "staging");
  size_t total = 0;
  for (int i = 0; i < n; i++) total += (bytes[i] + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
  stage_buffer *b = &stage->buf[stage->next];
  /* The device may still be copying out of this buffer (the upload before
   * last): wait for that copy, not for the whole stream. */
  if (b->in_flight) {
    DDP_TRY(ddp__cuda_check(cudaEventSynchronize(b->copied), "staging: waiting for a copy"));
    b->in_flight = false;
  }
  if (b->bytes < total) {
    ddp__cuda_free_host(b->host);
    b->bytes = 0;
    b->host = ddp__cuda_malloc_host(total);
    if (!b->host) return ddp_error_wrap(DDP_ERR_NOMEM, "staging %zu bytes", total);
    b->bytes = total;
  }
  size_t at = 0;
  ddp_status st = DDP_OK;
  for (int i = 0; i < n && st == DDP_OK; i++) {
    if (bytes[i] == 0) continue;
    memcpy(b->host + at, src[i], bytes[i]);
    char what[96];
    snprintf(what, sizeof what, "staging: copy of %zu bytes to the device", bytes[i]);
    st = ddp__cuda_check(
        cudaMemcpyAsync(dst[i], b->host + at, bytes[i], cudaMemcpyHostToDevice, d->stream), what);
    at += (bytes[i] + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
  }
  /* Also after a failure: copies queued before it still read the buffer. */
  ddp_status rec = ddp__cuda_check(cudaEventRecord(b->copied, d->stream),
                                   "staging: recording a copy");
  b->in_flight = rec == DDP_OK;
  stage->next = (stage->next + 1) % STAGE_BUFFERS;
  return st != DDP_OK ? st : rec;
}
