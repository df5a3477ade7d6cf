/* The flight recorder's ring: allocation, N from the environment, and the
 * consistent copy a dump takes while the group goes on recording. The hot
 * path (ddp__flight_new/start/end) is inline in flight.h. */
#include <stdio.h>
#include <string.h>

#include "comm/flight/flight.h"

const char *ddp__flight_state_name(int32_t state) {
  switch (state) {
    case DDP__FLIGHT_SCHEDULED: return "scheduled";
    case DDP__FLIGHT_STARTED: return "started";
    case DDP__FLIGHT_COMPLETED: return "completed";
    case DDP__FLIGHT_FAILED: return "failed";
    case DDP__FLIGHT_ENQUEUED: return "enqueued";
    default: return "unknown";
  }
}

int32_t ddp__flight_state_of(const char *name) {
  for (int32_t s = DDP__FLIGHT_SCHEDULED; s <= DDP__FLIGHT_ENQUEUED; s++)
    if (strcmp(name, ddp__flight_state_name(s)) == 0) return s;
  return 0;
}

uint64_t ddp__flight_capacity_from_env(void) {
  int64_t n = DDP__FLIGHT_DEFAULT_SIZE;
  if (ddp_env_int("DDP_FLIGHT_RECORDER_SIZE", DDP__FLIGHT_DEFAULT_SIZE, &n) != DDP_OK || n < 0) {
    DDP_WARN("DDP_FLIGHT_RECORDER_SIZE=\"%s\" is not a count of operations; using %d",
             ddp_env_str("DDP_FLIGHT_RECORDER_SIZE", ""), DDP__FLIGHT_DEFAULT_SIZE);
    ddp_clear_error();
    return DDP__FLIGHT_DEFAULT_SIZE;
  }
  if (n > DDP__FLIGHT_MAX_SIZE) {
    DDP_WARN("DDP_FLIGHT_RECORDER_SIZE=%lld is more than %d; using %d", (long long)n, DDP__FLIGHT_MAX_SIZE,
             DDP__FLIGHT_MAX_SIZE);
    n = DDP__FLIGHT_MAX_SIZE;
  }
  return (uint64_t)n;
}

ddp_status ddp__flight_open(uint64_t capacity, const char *name, int32_t rank, int32_t size,
                            const char *backend, ddp__flight **out) {
  *out = NULL;
  if (capacity == 0) return DDP_OK;
  /* A power of two of slots, so a record finds its slot with a mask rather
   * than a division; a dump still holds the last `capacity`. */
  uint64_t slots = 1;
  while (slots < capacity) slots <<= 1;
  ddp__flight *f = ddp_calloc(1, sizeof *f);
  ddp__flight_slot *ring = ddp_calloc((size_t)slots, sizeof *ring);
  if (!f || !ring) {
    ddp_free(f);
    ddp_free(ring);
    return ddp_error(DDP_ERR_NOMEM, "flight recorder of group %s (rank %d of %d): cannot allocate %llu records",
                     name, (int)rank, (int)size, (unsigned long long)capacity);
  }
  f->slots = ring;
  f->mask = slots - 1;
  f->capacity = capacity;
  atomic_init(&f->next_id, 0);
  ddp__bias_init(&f->claim);
  snprintf(f->name, sizeof f->name, "%s", name);
  snprintf(f->backend, sizeof f->backend, "%s", backend ? backend : "");
  f->rank = rank;
  f->size = size;
  ddp__flight_register(f);
  *out = f;
  return DDP_OK;
}

void ddp__flight_close(ddp__flight *f) {
  if (!f) return;
  ddp__flight_unregister(f);
  ddp__bias_destroy(&f->claim);
  ddp_free(f->slots);
  ddp_free(f);
}

/* Unpacks a slot's words into a record; root and peer share one word. */
static void unpack(uint64_t id, uint64_t seq, uint64_t what, uint64_t peer_tag, uint64_t count,
                   int64_t scheduled, int64_t started, int64_t ended, ddp__flight_record *r) {
  memset(r, 0, sizeof *r);
  r->id = id;
  r->seq = seq;
  r->kind = (int32_t)(what & 0xff);
  r->dtype = (int32_t)((what >> 8) & 0xff);
  r->reduce_op = (int32_t)((what >> 16) & 0xff);
  r->state = (int32_t)((what >> 24) & 0xff);
  r->status = (int32_t)(uint32_t)(what >> 32);
  int32_t who = (int32_t)(uint32_t)peer_tag;
  bool p2p = r->kind == DDP__OP_SEND || r->kind == DDP__OP_RECV;
  bool has_root = r->kind == DDP__OP_BROADCAST || r->kind == DDP__OP_REDUCE || r->kind == DDP__OP_GATHER ||
                  r->kind == DDP__OP_SCATTER;
  bool has_op = r->kind == DDP__OP_ALLREDUCE || r->kind == DDP__OP_REDUCE || r->kind == DDP__OP_REDUCE_SCATTER;
  r->root = has_root ? who : -1;
  r->peer = p2p ? who : -1;
  r->tag = p2p ? (int32_t)(uint32_t)(peer_tag >> 32) : 0;
  r->reduce_op = has_op ? r->reduce_op : -1;
  if (r->kind == DDP__OP_BARRIER) r->dtype = -1;
  r->count = count;
  r->scheduled_ns = scheduled;
  r->started_ns = started;
  r->ended_ns = ended;
}

size_t ddp__flight_snapshot(const ddp__flight *f, ddp__flight_record *out) {
  ddp__flight *ring = (ddp__flight *)f; /* atomics are read, never written */
  uint64_t next = atomic_load_explicit(&ring->next_id, memory_order_acquire);
  uint64_t first = next > f->capacity ? next - f->capacity : 0;
  size_t n = 0;
  for (uint64_t id = first; id < next; id++) {
    ddp__flight_slot *s = &ring->slots[id & f->mask];
    /* A slot being written is retried a few times (a writer takes a few
     * stores); one that holds another record by now is skipped. */
    for (int attempt = 0; attempt < 64; attempt++) {
      uint64_t v1 = atomic_load_explicit(&s->version, memory_order_acquire);
      if (v1 < 2) break; /* never written */
      if (v1 % 2 != 0) {
        if ((v1 - 1) / 8 == id) continue; /* this record, being written */
        break;
      }
      if (ddp__flight_version_id(v1) != id) break; /* another record by now */
      uint64_t seq = atomic_load_explicit(&s->seq, memory_order_relaxed);
      uint64_t what = atomic_load_explicit(&s->what, memory_order_relaxed);
      uint64_t peer_tag = atomic_load_explicit(&s->peer_tag, memory_order_relaxed);
      uint64_t count = atomic_load_explicit(&s->count, memory_order_relaxed);
      int64_t scheduled = atomic_load_explicit(&s->scheduled_ns, memory_order_relaxed);
      int64_t started = atomic_load_explicit(&s->started_ns, memory_order_relaxed);
      int64_t ended = atomic_load_explicit(&s->ended_ns, memory_order_relaxed);
      atomic_thread_fence(memory_order_acquire);
      if (atomic_load_explicit(&s->version, memory_order_relaxed) != v1) continue;
      unpack(id, seq, what, peer_tag, count, scheduled, started, ended, &out[n++]);
      break;
    }
  }
  return n;
}

void ddp__flight_dump_free(ddp__flight_dump *dump) {
  if (!dump) return;
  for (size_t g = 0; g < dump->n_groups; g++) ddp_free(dump->groups[g].records);
  ddp_free(dump->groups);
  memset(dump, 0, sizeof *dump);
}
