/* Variable-size byte collectives (what PyTorch's object collectives build
 * on): the lengths go first, then the payloads padded to the longest and to
 * whole int64 words, through the ordinary allgather / broadcast (so they are
 * ordered, timed and checked like any collective). */
#include <string.h>

#include "comm/comm_internal.h"

#define WORD 8u

static size_t round_up_words(size_t bytes) { return (bytes + WORD - 1) / WORD * WORD; }

ddp_status ddp_allgather_bytes(ddp_process_group *pg, const void *data, size_t bytes,
                               void **out, size_t *lens) {
  if (out) *out = NULL;
  if (!pg) return ddp_error(DDP_ERR_INVALID, "allgather_bytes: process group is NULL");
  if (!out || !lens) return ddp_error(DDP_ERR_INVALID, "allgather_bytes: out or lens is NULL");
  if (!data && bytes > 0)
    return ddp_error(DDP_ERR_INVALID, "allgather_bytes: data is NULL with %zu bytes", bytes);
  if (bytes > (size_t)INT64_MAX - WORD)
    return ddp_error(DDP_ERR_INVALID, "allgather_bytes: %zu bytes is too large", bytes);
  int size = pg->size;
  int64_t *all_lens = ddp_calloc((size_t)size, sizeof *all_lens);
  if (!all_lens) return ddp_error(DDP_ERR_NOMEM, "allgather_bytes: out of memory");
  int64_t mine = (int64_t)bytes;
  ddp_status st = ddp_allgather(pg, &mine, all_lens, 1, DDP_INT64);
  size_t longest = 0, total = 0;
  for (int r = 0; st == DDP_OK && r < size; r++) {
    if (all_lens[r] < 0 || (uint64_t)all_lens[r] > (uint64_t)INT64_MAX - WORD)
      st = ddp_error(DDP_ERR_FORMAT, "allgather_bytes: rank %d announced %lld bytes", r,
                     (long long)all_lens[r]);
    else if ((size_t)all_lens[r] > longest)
      longest = (size_t)all_lens[r];
  }
  size_t padded = round_up_words(longest);
  if (st == DDP_OK && padded > 0 && (size_t)size > SIZE_MAX / padded)
    st = ddp_error(DDP_ERR_RANGE, "allgather_bytes: %d x %zu bytes does not fit in memory", size,
                   padded);
  void *send = NULL, *recv = NULL;
  if (st == DDP_OK) {
    send = ddp_calloc(padded ? padded : 1, 1);
    recv = ddp_alloc(padded * (size_t)size + 1);
    if (!send || !recv) st = ddp_error(DDP_ERR_NOMEM, "allgather_bytes: cannot allocate %d x %zu bytes",
                                       size, padded);
  }
  if (st == DDP_OK) {
    if (bytes) memcpy(send, data, bytes);
    st = ddp_allgather(pg, send, recv, padded / WORD, DDP_INT64);
  }
  if (st == DDP_OK) {
    /* Close the gaps: block r moves down to the sum of the lengths before it. */
    char *p = recv;
    for (int r = 0; r < size; r++) {
      size_t n = (size_t)all_lens[r];
      memmove(p + total, p + (size_t)r * padded, n);
      total += n;
      lens[r] = n;
    }
    p[total] = '\0';
    *out = recv;
    recv = NULL;
  }
  ddp_free(send);
  ddp_free(recv);
  ddp_free(all_lens);
  return st;
}

ddp_status ddp_broadcast_bytes(ddp_process_group *pg, void **data, size_t *bytes, int root) {
  if (!pg) return ddp_error(DDP_ERR_INVALID, "broadcast_bytes: process group is NULL");
  if (!data || !bytes) return ddp_error(DDP_ERR_INVALID, "broadcast_bytes: data or bytes is NULL");
  if (root < 0 || root >= pg->size)
    return ddp_error(DDP_ERR_INVALID, "broadcast_bytes: root %d is not a rank of the group (size %d)",
                     root, pg->size);
  bool is_root = pg->rank == root;
  if (is_root && !*data && *bytes > 0)
    return ddp_error(DDP_ERR_INVALID, "broadcast_bytes: *data is NULL with %zu bytes on the root",
                     *bytes);
  if (is_root && *bytes > (size_t)INT64_MAX - WORD)
    return ddp_error(DDP_ERR_INVALID, "broadcast_bytes: %zu bytes is too large", *bytes);
  if (!is_root) {
    *data = NULL;
    *bytes = 0;
  }
  int64_t len = is_root ? (int64_t)*bytes : 0;
  DDP_TRY(ddp_broadcast(pg, &len, 1, DDP_INT64, root));
  if (len < 0 || (uint64_t)len > (uint64_t)INT64_MAX - WORD)
    return ddp_error(DDP_ERR_FORMAT, "broadcast_bytes: root %d announced %lld bytes", root,
                     (long long)len);
  size_t padded = round_up_words((size_t)len);
  char *buf = ddp_alloc(padded + 1);
  if (!buf) return ddp_error(DDP_ERR_NOMEM, "broadcast_bytes: cannot allocate %zu bytes", padded);
  memset(buf + (size_t)len, 0, padded + 1 - (size_t)len);
  if (is_root && len) memcpy(buf, *data, (size_t)len);
  ddp_status st = ddp_broadcast(pg, buf, padded / WORD, DDP_INT64, root);
  if (st != DDP_OK || is_root) {
    ddp_free(buf);
    return st;
  }
  buf[len] = '\0';
  *data = buf;
  *bytes = (size_t)len;
  return DDP_OK;
}
