/* How the local backend writes into the shared segment where a peer will
 * read (staging and result chunks between processes).
 *
 * Writing a line that a peer's cache holds (it read the line in the last
 * op) first invalidates the peer's copy. Between cores sharing a last-level
 * cache that costs little (about 10 GB/s for a copy); between cores that do
 * not (another CCD on AMD EPYC, another socket, or a VM's vCPUs that the
 * hypervisor moved there) each line waits for a round trip across the
 * fabric and a copy falls to about 2 GB/s, while reading the peer's lines
 * still runs at 25+ GB/s. Streaming (non-temporal) stores skip the
 * invalidation round trip: about 28 GB/s in both cases, but the peer then
 * reads from memory instead of a cache, which costs more than it saves when
 * the cache is shared (measured on an EPYC Zen 4 VM whose two vCPUs switch
 * between the two placements every few seconds: docs/comm.md, "Stores
 * into the segment").
 *
 * So by default (DDP_LOCAL_STORES=auto) a large copy times its first
 * DDP__LOCAL_STORE_PROBE bytes written with ordinary stores and streams the
 * rest when they ran slower than DDP__LOCAL_STORE_SLOW_GBPS; after such a
 * probe, copies stream unprobed for DDP__LOCAL_STORE_STICKY_NS, then probe
 * again, so a run follows the machine when its placement changes.
 * Measured there, 2 processes, 1 MiB allreduce (ddp-bench): shared cache
 * 16.8 GB/s auto, 17.2 cached, 7.2 streaming; across the fabric 10.4 auto,
 * 1.8 cached, 11.1 streaming. */
#include <emmintrin.h>
#include <string.h>

#include "comm/local/local.h"

ddp_status ddp__local_stores_from_env(ddp__local_stores *out) {
  const char *v = ddp_env_str("DDP_LOCAL_STORES", "auto");
  if (strcmp(v, "auto") == 0) *out = DDP__LOCAL_STORES_AUTO;
  else if (strcmp(v, "cached") == 0) *out = DDP__LOCAL_STORES_CACHED;
  else if (strcmp(v, "streaming") == 0) *out = DDP__LOCAL_STORES_STREAMING;
  else
    return ddp_error(DDP_ERR_INVALID,
                     "DDP_LOCAL_STORES=%s: expected auto, cached or streaming", v);
  return DDP_OK;
}

bool ddp__local_store_is_slow(int64_t ns, size_t bytes) {
  /* bytes / ns is GB/s. */
  return (double)bytes < DDP__LOCAL_STORE_SLOW_GBPS * (double)ns;
}

/* The streaming copy without its closing fence. */
static void stream_bytes(void *dst, const void *src, size_t len) {
  uint8_t *d = dst;
  const uint8_t *s = src;
  size_t head = (16u - ((uintptr_t)d & 15u)) & 15u;
  if (head > len) head = len;
  memcpy(d, s, head);
  d += head, s += head, len -= head;
  /* SSE2 (every x86-64): the write-combining buffers merge four 16-byte
   * streaming stores into one full-line write, as wide stores would. */
  for (; len >= 64; len -= 64, d += 64, s += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, a);
    _mm_stream_si128((__m128i *)(d + 16), b);
    _mm_stream_si128((__m128i *)(d + 32), c);
    _mm_stream_si128((__m128i *)(d + 48), e);
  }
  memcpy(d, s, len);
}

void ddp__local_copy_streaming(void *dst, const void *src, size_t len) {
  stream_bytes(dst, src, len);
  /* Streaming stores are weakly ordered: they must be visible before the
   * flag that tells peers to read them is posted. */
  _mm_sfence();
}

bool ddp__local_shared_copy(ddp__local_backend *b, void *dst, const void *src, size_t len) {
  if (b->stores == DDP__LOCAL_STORES_CACHED || len < 2 * DDP__LOCAL_STORE_PROBE) {
    memcpy(dst, src, len);
    return false;
  }
  size_t done = 0; /* bytes already written by the probe */
  int64_t t0;
  if (b->stores == DDP__LOCAL_STORES_AUTO && (t0 = ddp_time_ns()) >= b->stream_until_ns) {
    memcpy(dst, src, DDP__LOCAL_STORE_PROBE);
    /* The stores have left the core only once the store buffer drains (it
     * holds about the whole probe): wait for that, or a slow fabric would
     * look fast. */
    _mm_mfence();
    done = DDP__LOCAL_STORE_PROBE;
    if (!ddp__local_store_is_slow(ddp_time_ns() - t0, done)) {
      memcpy((uint8_t *)dst + done, (const uint8_t *)src + done, len - done);
      return false;
    }
    /* Placements change over seconds, not microseconds: stream without
     * probing for a while (a probe on a slow fabric costs its own time). */
    b->stream_until_ns = t0 + DDP__LOCAL_STORE_STICKY_NS;
  }
  ddp__local_copy_streaming((uint8_t *)dst + done, (const uint8_t *)src + done, len - done);
  b->copies_streamed++;
  return true;
}

void ddp__local_reduce_to_shared(void *dst, const void *const *src, int size, size_t count,
                                 ddp_dtype dtype, ddp_reduce_op op, bool streaming) {
  if (!streaming) {
    ddp__local_reduce_ranks(dst, src, size, count, dtype, op);
    return;
  }
  /* Reduce a block at a time into a buffer that stays in L1, then stream it
   * out. */
  _Alignas(64) uint8_t block[4096];
  size_t esize = ddp_dtype_size(dtype), per = sizeof block / esize;
  const void *at_src[DDP__LOCAL_MAX_RANKS];
  for (size_t at = 0; at < count; at += per) {
    size_t len = count - at < per ? count - at : per;
    for (int q = 0; q < size; q++) at_src[q] = (const uint8_t *)src[q] + at * esize;
    ddp__local_reduce_ranks(block, at_src, size, len, dtype, op);
    stream_bytes((uint8_t *)dst + at * esize, block, len * esize);
  }
  _mm_sfence();
}
