/* CUDA graphs (include/ddp/tensor.h, docs/cuda.md "CUDA graphs"): a
 * capture of the work one thread queues on a device's compute stream, its
 * instantiation and replays, and what keeps a replay correct: each graph's
 * private pool of the blocks its work writes, and the refusal of whatever
 * would wait for the device during a capture. The runtime (runtime.c)
 * asks here on every allocation, free and synchronizing call whether this
 * thread is capturing (ddp__cuda_capturing). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/cuda/runtime.h"

/* A block of a pool: its address and size class (kept here, so the pool
 * never asks the cache while holding its lock). */
typedef struct pool_block {
  void *ptr;
  size_t size;
} pool_block;

/* The blocks one graph's work uses beyond what its caller keeps alive:
 * `owned`, those allocated or freed during its capture; `free_list`, those
 * of them that are free now, which only this pool's own capture hands out
 * again. A block may belong to several pools (freed during a second
 * capture after the first graph's): it is then on the free list of each
 * while it is free, on none while in use, and goes back to the cache only
 * when the last pool owning it is released. free_list's capacity is kept
 * at least owned's count, so a free never needs memory. */
typedef struct pool {
  pool_block *owned;
  size_t n_owned, cap_owned;
  pool_block *free_list;
  size_t n_free, cap_free;
  struct pool *next; /* the device's live pools */
} pool;

struct ddp_cuda_graph {
  int device;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  pool *pool;
};

/* Per device: its live pools (every graph's, and the capture's), the
 * capture under way and its first failure. Guarded by `lock`, which is
 * never held across a call into the cache or CUDA. */
typedef struct device_graphs {
  pthread_mutex_t lock;
  pool *pools;
  pool *capture; /* the pool of the capture under way, or NULL */
  ddp_status error;
  char error_msg[512];
} device_graphs;

/* cudaFree calls the cache asked for during a capture, done at its end. */
typedef struct deferred_free {
  int device;
  void *ptr;
} deferred_free;

static pthread_once_t state_once = PTHREAD_ONCE_INIT;
static device_graphs *graphs; /* ddp__cuda_device_count() of them, never freed */
static int n_graph_devices;
/* Live pools on any device: frees skip the lookup while there are none. */
static atomic_int live_pools;
static pthread_mutex_t deferred_lock = PTHREAD_MUTEX_INITIALIZER;
static deferred_free *deferred;
static size_t n_deferred, cap_deferred;

/* The device this thread captures on, or -1. */
static _Thread_local int capturing_on = -1;

static void state_init(void) {
  int n = ddp__cuda_device_count();
  if (n <= 0) return;
  graphs = ddp_calloc((size_t)n, sizeof *graphs);
  if (!graphs) return;
  for (int i = 0; i < n; i++) pthread_mutex_init(&graphs[i].lock, NULL);
  n_graph_devices = n;
}

/* The device's state, or NULL (error set) when it cannot be had. */
static device_graphs *graphs_of(int device) {
  pthread_once(&state_once, state_init);
  if (device < 0 || device >= n_graph_devices) {
    ddp_error(n_graph_devices ? DDP_ERR_INVALID : DDP_ERR_NOMEM,
              "cuda:%d: no CUDA graph state for this device", device);
    return NULL;
  }
  return &graphs[device];
}

int ddp__cuda_capturing(void) { return capturing_on; }

/* ---- The capture's first failure ------------------------------------------- */

static void note_locked(device_graphs *g, ddp_status status) {
  if (g->error != DDP_OK) return;
  g->error = status;
  snprintf(g->error_msg, sizeof g->error_msg, "%s", ddp_last_error());
}

void ddp__cuda_capture_note(ddp_status status) {
  if (status == DDP_OK || capturing_on < 0) return;
  device_graphs *g = &graphs[capturing_on]; /* made by begin */
  pthread_mutex_lock(&g->lock);
  note_locked(g, status);
  pthread_mutex_unlock(&g->lock);
}

ddp_status ddp__cuda_capture_refuse(const char *what, const char *why) {
  ddp_status st = ddp_error(DDP_ERR_STATE, "cuda:%d: %s during a CUDA graph capture: %s",
                            capturing_on, what, why);
  ddp__cuda_capture_note(st);
  return st;
}

/* ---- Pools ------------------------------------------------------------------ */

static bool grow(pool_block **array, size_t *cap, size_t need) {
  if (need <= *cap) return true;
  size_t fresh = *cap ? 2 * *cap : 32;
  while (fresh < need) fresh *= 2;
  pool_block *p = ddp_realloc(*array, *cap * sizeof *p, fresh * sizeof *p);
  if (!p) return false;
  *array = p;
  *cap = fresh;
  return true;
}

static ptrdiff_t find(const pool_block *array, size_t n, const void *ptr) {
  for (size_t i = 0; i < n; i++)
    if (array[i].ptr == ptr) return (ptrdiff_t)i;
  return -1;
}

/* Makes ptr one of p's blocks (no-op when it is); false when out of host
 * memory. Keeps free_list able to hold every owned block. */
static bool own_locked(pool *p, void *ptr, size_t size) {
  if (find(p->owned, p->n_owned, ptr) >= 0) return true;
  if (!grow(&p->owned, &p->cap_owned, p->n_owned + 1) ||
      !grow(&p->free_list, &p->cap_free, p->n_owned + 1))
    return false;
  p->owned[p->n_owned++] = (pool_block){ptr, size};
  return true;
}

/* Puts a block p owns, free now, on p's free list. */
static void free_locked(pool *p, void *ptr) {
  ptrdiff_t at = find(p->owned, p->n_owned, ptr);
  DDP_ASSERT(at >= 0 && p->n_free < p->cap_free && find(p->free_list, p->n_free, ptr) < 0);
  p->free_list[p->n_free++] = p->owned[at];
}

/* Takes ptr off p's free list, when it is there. */
static void unfree_locked(pool *p, const void *ptr) {
  ptrdiff_t at = find(p->free_list, p->n_free, ptr);
  if (at >= 0) p->free_list[at] = p->free_list[--p->n_free];
}

/* Whether a live pool other than `except` owns ptr. */
static bool owned_elsewhere_locked(const device_graphs *g, const pool *except, const void *ptr) {
  for (const pool *q = g->pools; q; q = q->next)
    if (q != except && find(q->owned, q->n_owned, ptr) >= 0) return true;
  return false;
}

/* Unlinks p from its device, gives its free blocks back to the cache (its
 * graph is gone: no replay will write them; one still running is ahead of
 * any later user on the stream) and frees it. Blocks still held by their
 * users return to the cache when those free them. */
static void pool_release(int device, pool *p) {
  if (!p) return;
  device_graphs *g = &graphs[device];
  pthread_mutex_lock(&g->lock);
  for (pool **at = &g->pools; *at; at = &(*at)->next)
    if (*at == p) {
      *at = p->next;
      break;
    }
  /* Free blocks another live graph still writes stay with it (on its
   * free list already); the rest go back. */
  size_t n_back = 0;
  for (size_t i = 0; i < p->n_free; i++)
    if (!owned_elsewhere_locked(g, p, p->free_list[i].ptr)) p->free_list[n_back++] = p->free_list[i];
  pthread_mutex_unlock(&g->lock);
  atomic_fetch_sub(&live_pools, 1);
  ddp__block_cache *cache = ddp__cuda_cache(device);
  int prev = ddp__cuda_current_device();
  if (prev != device) cudaSetDevice(device); /* for a deferred error's device */
  for (size_t i = 0; cache && i < n_back; i++)
    ddp__cuda_defer(ddp__block_cache_free(cache, p->free_list[i].ptr));
  if (prev != device) cudaSetDevice(prev);
  ddp_free(p->owned);
  ddp_free(p->free_list);
  ddp_free(p);
}

void *ddp__cuda_capture_alloc(ddp__block_cache *cache, size_t bytes) {
  device_graphs *g = &graphs[capturing_on];
  const size_t want = ddp__block_round(bytes);
  /* The smallest free block of the pool that fits within the cache's
   * waste bound: eager work would reuse these, freed earlier in the step. */
  pthread_mutex_lock(&g->lock);
  pool *p = g->capture;
  ptrdiff_t best = -1;
  for (size_t i = 0; want && i < p->n_free; i++) {
    size_t size = p->free_list[i].size;
    if (size >= want && size - want <= want / DDP__BLOCK_WASTE_DIV &&
        (best < 0 || size < p->free_list[best].size))
      best = (ptrdiff_t)i;
  }
  if (best >= 0) {
    void *ptr = p->free_list[best].ptr;
    /* In use again: free on no pool's list (another graph's release must
     * not give it back to the cache while this capture's user holds it). */
    for (pool *q = g->pools; q; q = q->next) unfree_locked(q, ptr);
    pthread_mutex_unlock(&g->lock);
    return ptr;
  }
  pthread_mutex_unlock(&g->lock);
  /* A hit, or a miss the backend refuses (no cudaMalloc in a capture). */
  void *ptr = ddp__block_cache_alloc(cache, bytes);
  if (!ptr) {
    ddp__cuda_capture_note(DDP_ERR_NOMEM);
    return NULL;
  }
  size_t size = ddp__block_cache_size(cache, ptr);
  pthread_mutex_lock(&g->lock);
  bool owned = own_locked(p, ptr, size);
  pthread_mutex_unlock(&g->lock);
  if (!owned) {
    (void)ddp__block_cache_free(cache, ptr);
    ddp__cuda_capture_note(ddp_error(DDP_ERR_NOMEM, "cuda:%d: no host memory to record a block of "
                                                    "a CUDA graph's pool",
                                     capturing_on));
    return NULL;
  }
  return ptr;
}

bool ddp__cuda_pool_take(int device, ddp__block_cache *cache, void *ptr) {
  if (atomic_load(&live_pools) == 0 || device < 0 || device >= n_graph_devices) return false;
  device_graphs *g = &graphs[device];
  const bool mine = capturing_on == device;
  /* Its size, should the capture adopt it (outside the lock: the cache
   * takes its own). */
  size_t size = mine ? ddp__block_cache_size(cache, ptr) : 0;
  pthread_mutex_lock(&g->lock);
  /* Freed during this thread's capture: the captured work may have used
   * it before this point, so every replay will. */
  if (mine && g->capture && !own_locked(g->capture, ptr, size))
    note_locked(g, ddp_error(DDP_ERR_NOMEM, "cuda:%d: no host memory to record a block of a "
                                            "CUDA graph's pool",
                             device));
  bool owned = false, twice = false;
  for (pool *p = g->pools; p; p = p->next) {
    if (find(p->owned, p->n_owned, ptr) < 0) continue;
    owned = true;
    if (find(p->free_list, p->n_free, ptr) >= 0) twice = true;
    else free_locked(p, ptr);
  }
  pthread_mutex_unlock(&g->lock);
  /* As the cache does: the device's pending error, the block unchanged. */
  if (twice)
    ddp__cuda_defer(ddp_error(DDP_ERR_STATE, "cuda:%d: ddp__cuda_free: %p freed twice (a block of "
                                             "a CUDA graph's pool)",
                              device, ptr));
  return owned;
}

void ddp__cuda_capture_defer_free(int device, void *ptr) {
  pthread_mutex_lock(&deferred_lock);
  if (n_deferred == cap_deferred) {
    size_t cap = cap_deferred ? 2 * cap_deferred : 64;
    deferred_free *d = ddp_realloc(deferred, n_deferred * sizeof *d, cap * sizeof *d);
    if (!d) { /* the block is lost to the driver until the process ends */
      pthread_mutex_unlock(&deferred_lock);
      return;
    }
    deferred = d;
    cap_deferred = cap;
  }
  deferred[n_deferred++] = (deferred_free){device, ptr};
  pthread_mutex_unlock(&deferred_lock);
}

/* The cudaFree calls kept during the capture, now that it is over. */
static void run_deferred_frees(void) {
  pthread_mutex_lock(&deferred_lock);
  int prev = ddp__cuda_current_device();
  for (size_t i = 0; i < n_deferred; i++) {
    cudaSetDevice(deferred[i].device);
    ddp__cuda_defer(ddp__cuda_check(cudaFree(deferred[i].ptr), "cudaFree (after a capture)"));
  }
  n_deferred = 0;
  cudaSetDevice(prev);
  pthread_mutex_unlock(&deferred_lock);
}

/* ---- Capture, replay -------------------------------------------------------- */

ddp_status ddp__cuda_graph_begin(int device) {
  if (capturing_on >= 0)
    return ddp_error(DDP_ERR_STATE,
                     "cuda:%d: ddp_cuda_graph_begin: this thread captures on cuda:%d already "
                     "(end that capture first)",
                     device, capturing_on);
  DDP_TRY(ddp__cuda_set_device(device));
  cudaStream_t stream = ddp__cuda_stream();
  if (!stream) return ddp__cuda_synchronize(); /* says why the device cannot be used */
  device_graphs *g = graphs_of(device);
  if (!g) return DDP_ERR_NOMEM;
  pool *p = ddp_calloc(1, sizeof *p);
  if (!p) return ddp_error(DDP_ERR_NOMEM, "cuda:%d: CUDA graph capture: out of host memory", device);
  pthread_mutex_lock(&g->lock);
  if (g->capture) {
    pthread_mutex_unlock(&g->lock);
    ddp_free(p);
    return ddp_error(DDP_ERR_STATE, "cuda:%d: ddp_cuda_graph_begin: another thread captures on "
                                    "this device's stream",
                     device);
  }
  g->capture = p;
  g->error = DDP_OK;
  g->error_msg[0] = '\0';
  p->next = g->pools;
  g->pools = p;
  pthread_mutex_unlock(&g->lock);
  atomic_fetch_add(&live_pools, 1);
  /* Thread-local mode: only this thread's calls that could wait are
   * illegal (the runtime refuses them first); other threads carry on. */
  ddp_status st = ddp__cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                                  "beginning a CUDA graph capture");
  if (st != DDP_OK) {
    pthread_mutex_lock(&g->lock);
    g->capture = NULL;
    pthread_mutex_unlock(&g->lock);
    pool_release(device, p);
    return st;
  }
  capturing_on = device;
  return DDP_OK;
}

ddp_status ddp__cuda_graph_end(int device, ddp_cuda_graph **out) {
  *out = NULL;
  if (capturing_on != device)
    return ddp_error(DDP_ERR_STATE,
                     "cuda:%d: ddp_cuda_graph_end: this thread is not capturing on this device "
                     "(ddp_cuda_graph_begin first)",
                     device);
  DDP_TRY(ddp__cuda_set_device(device));
  device_graphs *g = &graphs[device];
  cudaGraph_t graph = NULL;
  cudaError_t ended = cudaStreamEndCapture(ddp__cuda_stream(), &graph);
  capturing_on = -1;
  pthread_mutex_lock(&g->lock);
  pool *p = g->capture;
  g->capture = NULL;
  ddp_status failed = g->error;
  char msg[sizeof g->error_msg];
  memcpy(msg, g->error_msg, sizeof msg);
  pthread_mutex_unlock(&g->lock);
  run_deferred_frees();

  ddp_status st = DDP_OK;
  if (failed != DDP_OK) {
    st = ddp_error(failed, "cuda:%d: the CUDA graph capture failed: %s", device, msg);
  } else if (ended != cudaSuccess) {
    /* Something in the captured work was illegal in a capture without
     * passing through the runtime (a call CUDA refused by itself). */
    st = ddp__cuda_check(ended, "ending the CUDA graph capture (something captured could not be)");
  }
  cudaGraphExec_t exec = NULL;
  if (st == DDP_OK)
    st = ddp__cuda_check(cudaGraphInstantiate(&exec, graph, 0), "instantiating the CUDA graph");
  /* The first replay would upload the graph; do it now, off the timed path. */
  if (st == DDP_OK)
    st = ddp__cuda_check(cudaGraphUpload(exec, ddp__cuda_stream()), "uploading the CUDA graph");
  ddp_cuda_graph *made = NULL;
  if (st == DDP_OK) {
    made = ddp_calloc(1, sizeof *made);
    if (!made) st = ddp_error(DDP_ERR_NOMEM, "cuda:%d: CUDA graph: out of host memory", device);
  }
  if (st != DDP_OK) {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    /* Launches into the failed capture left errors in this thread's last
     * error: they belong to this failure, not to the next synchronize. */
    (void)cudaGetLastError();
    pool_release(device, p);
    return st;
  }
  *made = (ddp_cuda_graph){device, graph, exec, p};
  *out = made;
  return DDP_OK;
}

ddp_status ddp__cuda_graph_replay(ddp_cuda_graph *graph) {
  if (!graph) return ddp_error(DDP_ERR_INVALID, "ddp_cuda_graph_replay: graph is NULL");
  if (capturing_on >= 0)
    return ddp__cuda_capture_refuse("replaying a CUDA graph", "replay after ddp_cuda_graph_end");
  DDP_TRY(ddp__cuda_set_device(graph->device));
  return ddp__cuda_check(cudaGraphLaunch(graph->exec, ddp__cuda_stream()),
                         "replaying a CUDA graph");
}

void ddp__cuda_graph_destroy(ddp_cuda_graph *graph) {
  if (!graph) return;
  int prev = ddp__cuda_current_device();
  cudaSetDevice(graph->device);
  /* A replay in flight is freed when it completes (cudaGraphExecDestroy). */
  ddp__cuda_defer(ddp__cuda_check(cudaGraphExecDestroy(graph->exec), "destroying a CUDA graph"));
  ddp__cuda_defer(ddp__cuda_check(cudaGraphDestroy(graph->graph), "destroying a CUDA graph"));
  cudaSetDevice(prev);
  pool_release(graph->device, graph->pool);
  ddp_free(graph);
}
