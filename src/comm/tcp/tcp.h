/* Internals of the tcp backend shared by its files: the backend object, the
 * pairs (one socket per peer, connected by tcp/pairs.c), the frame format
 * and the transfer engine that moves several framed messages at once
 * (tcp/engine.c), and the collective algorithms built on it
 * (tcp/algorithms.c). Not installed. */
#ifndef DDP__COMM_TCP_H
#define DDP__COMM_TCP_H

#include <poll.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/backend.h"
#include "net/net.h"

/* Every message on a pair is a frame: a 16-byte header, then `bytes` bytes.
 * Collectives send COLL frames (matched by order, since every rank runs the
 * same collectives in the same order); send/recv send P2P frames (matched in
 * order per tag; others wait in the pair's unexpected queue). BYE (bytes =
 * the pair's session id) is the last frame a rank sends: on destroy, so a
 * peer can tell a clean exit from a crash when the connection closes, or at
 * once when an op fails, with tag = 1 + the rank it blames (0: none; bit 31
 * set when that rank left cleanly rather than died), so the ranks still
 * waiting learn which rank failed even when their own connection to it has
 * not closed yet (its FIN may sit behind unread data). */
#define DDP__TCP_MAGIC 0x44505400u /* "\0TPD": low byte is the kind */
enum { DDP__TCP_COLL = 1, DDP__TCP_P2P = 2, DDP__TCP_BYE = 3 };

typedef struct ddp__tcp_header {
  uint32_t magic_kind; /* DDP__TCP_MAGIC | kind */
  uint32_t tag;        /* P2P: the user's tag */
  uint64_t bytes;      /* payload bytes (BYE: the session id) */
} ddp__tcp_header;

/* A P2P message that arrived before its recv was posted. */
typedef struct ddp__tcp_msg {
  struct ddp__tcp_msg *next;
  uint32_t tag;
  size_t bytes;
  unsigned char *data; /* ddp_alloc'd (NULL when bytes == 0) */
} ddp__tcp_msg;

typedef struct ddp__tcp_pair {
  int fd;                          /* -1 for self */
  int rank;                        /* the peer */
  char addr[DDP_NET_ADDR_BYTES];   /* "10.99.0.2:41234", its published address */
  const char *host;                /* cfg->host_names[rank] or NULL */
  uint64_t session;                /* agreed in the handshake; BYE carries it */
  /* Receive side: a header being read, then a payload owned by an op or by
   * the unexpected queue. */
  unsigned char hdr_buf[sizeof(ddp__tcp_header)];
  size_t hdr_got;
  bool have_hdr;                   /* hdr is complete, its payload not yet taken */
  ddp__tcp_header hdr;
  ddp__tcp_msg *draining;          /* unexpected P2P payload being read */
  size_t drain_got;
  ddp__tcp_msg *unexp_head, *unexp_tail;
  bool peer_left;                  /* its stream ended with BYE: a clean exit */
  bool bye_seen;                   /* closed after BYE, frames before it still unread */
  int left_cause;                  /* the BYE's cause: the rank it blamed, or -1 */
  bool cause_left;                 /* ... which had left cleanly (not died) */
  bool send_open;                  /* a frame is partly sent (nothing may cut in) */
  bool bye_sent;
} ddp__tcp_pair;

/* One framed transfer posted to the engine. Transfers towards one peer in one
 * direction run in the order posted. */
typedef struct ddp__tcp_xfer {
  int peer;
  bool is_send;
  uint32_t kind, tag;
  /* send: the payload; recv: its destination (COPY) or the reduction's
   * destination (REDUCE, where received bytes go through the scratch piece
   * buffer and are reduced into dst as they arrive). */
  const void *src;
  void *dst;
  size_t bytes;
  bool reduce;
  ddp_dtype dtype;
  ddp_reduce_op op;
  int after;      /* index of a transfer (same run) that must finish first, or -1 */
  /* progress */
  size_t done;
  size_t reduced;
  unsigned char tail[8]; /* REDUCE: bytes of a partly received element */
  bool started; /* send: header out; recv: header matched */
  bool mapped;  /* peer translated through the backend's view (ddp__tcp_run) */
  unsigned char hdr[sizeof(ddp__tcp_header)];
  size_t hdr_sent;
  bool finished;
} ddp__tcp_xfer;

typedef struct ddp__tcp_backend {
  ddp__backend base;
  int rank, size;
  /* What the collectives (tcp/algorithms.c) run over: the whole group
   * (vrank = rank, vsize = size, view = NULL), or, set by the hierarchical
   * backend for one op, a subset of its ranks (one per host): view[i] is the
   * group rank of member i and vrank this rank's index. The engine maps
   * transfers' peers through the view; messages name group ranks. */
  int vrank, vsize;
  const int *view;
  /* Bytes written to and read from the sockets (frames: headers and
   * payloads), for ddp_process_group_counters. Written by the op's thread
   * only; read from any thread. */
  _Atomic uint64_t bytes_sent, bytes_received;
  ddp__tcp_pair *pairs;    /* size entries; pairs[rank] is self */
  int wake_fd;             /* eventfd: abort writes it */
  atomic_bool aborted;
  struct pollfd *pfds;     /* size + 1, reused by every wait */
  int *pfd_owner;          /* pair of each pollfd (-1: the wake fd); size + 1
                            * entries, then the engine's act_send[size] and
                            * act_recv[size] */
  unsigned char *piece;    /* scratch for reduce-on-arrival, piece_bytes */
  size_t piece_bytes;
  unsigned char *scratch;  /* whole-message scratch, grown on demand */
  size_t scratch_bytes;
  ddp__tcp_xfer *xfers;    /* room for xfer_cap transfers, grown on demand */
  int xfer_cap;
  /* Sticky failure: once a pair failed, every later op fails the same way. */
  ddp_status failed;
  bool failed_left;        /* the failure is a peer that left cleanly (a weaker blame) */
  int failed_peer;         /* the rank the failure blames, or -1 */
  char failed_msg[512];
  char local_addr[DDP_NET_ADDR_BYTES];
  /* The point-to-point lane's own backend (a second mesh; NULL for the lane
   * itself and for a group of one). Touched by the lane thread only, but
   * for its wake_fd and counters. */
  struct ddp__tcp_backend *lane;
} ddp__tcp_backend;

/* Size of the pieces in which received data is reduced (and the segment of
 * pipelined chains). */
#define DDP__TCP_PIECE_BYTES (256u * 1024u)

/* The hierarchical backend's hooks (src/comm/hier/hier.c). */
/* Runs the collectives over the members view[0..n) (group ranks, one of them
 * this rank) until ddp__tcp_view_clear. */
void ddp__tcp_view_set(ddp__tcp_backend *b, int n, const int *view);
void ddp__tcp_view_clear(ddp__tcp_backend *b);
/* Records a failure found outside this backend (by the shared-memory part
 * of the group) as the sticky error, blaming group rank `blame` (-1: none),
 * and says BYE to every peer with that cause, so ranks waiting on this one
 * over TCP fail at once naming it. The message is the calling thread's last
 * error. */
void ddp__tcp_fail_external(ddp__tcp_backend *b, ddp_status st, int blame);

/* ---- tcp/pairs.c ---------------------------------------------------------- */

/* Listens, publishes this rank's address in cfg->store, connects the full
 * mesh (lower rank connects to higher; handshake checks the ranks, the group
 * size and the listener's nonce), until cfg->timeout_ns. With
 * cfg->skip_colocated, pairs on one host (equal cfg->host_of) stay
 * unconnected (fd -1): the hierarchical backend moves their bytes through
 * shared memory. */
ddp_status ddp__tcp_connect_mesh(ddp__tcp_backend *b, const ddp__backend_config *cfg);

/* ---- tcp/engine.c --------------------------------------------------------- */

/* Sends BYE on every pair (best effort), drains and closes the sockets. */
void ddp__tcp_close_pairs(ddp__tcp_backend *b);

/* Runs the n transfers to completion, overlapping them all; fails on the
 * deadline, abort, or any peer closing (whether or not it is one of the
 * transfers' peers). */
ddp_status ddp__tcp_run(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x, int n);

/* Fills a transfer (x is zeroed first). */
void ddp__tcp_post_send(ddp__tcp_xfer *x, int peer, const void *src, size_t bytes);
void ddp__tcp_post_recv(ddp__tcp_xfer *x, int peer, void *dst, size_t bytes);
void ddp__tcp_post_recv_reduce(ddp__tcp_xfer *x, int peer, void *dst, size_t bytes,
                               ddp_dtype dtype, ddp_reduce_op op);

/* One step of a transfer on its non-blocking socket: IO_READY
 * (x->finished), IO_BLOCKED, or IO_ERROR with the
 * backend's sticky failure recorded (the last error names the peer). */
enum { IO_BLOCKED = 0, IO_READY = 1, IO_ERROR = -1 };
int ddp__tcp_progress_send(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x);
/* Reads the pair's next frame header if it has arrived (p->have_hdr; a BYE
 * sets p->peer_left instead): IO_READY, IO_BLOCKED or IO_ERROR. */
int ddp__tcp_read_header(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_pair *p);
int ddp__tcp_progress_recv(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__tcp_xfer *x);

/* ---- tcp/lane.c: the point-to-point lane (backend.h) ----------------------
 * On a mesh of its own (b->lane, connected with the group's), so the lane's
 * frames never interleave with a collective's on one socket. */
ddp_status ddp__tcp_p2p_progress(ddp__backend *b, const ddp__op_ctx *ctx,
                                 ddp__p2p_req *const *reqs, int n, int64_t wait_ns, int *culprit);
void ddp__tcp_p2p_wake(ddp__backend *b);

/* Point to point (tcp/tcp.c's send/recv use these). */
ddp_status ddp__tcp_send_p2p(ddp__tcp_backend *b, const ddp__op_ctx *ctx, const void *buf,
                             size_t bytes, int dst);
ddp_status ddp__tcp_recv_p2p(ddp__tcp_backend *b, const ddp__op_ctx *ctx, void *buf,
                             size_t bytes, int src);

/* A scratch buffer of at least `bytes` (grown once, kept). NULL + error. */
void *ddp__tcp_scratch(ddp__tcp_backend *b, size_t bytes);
/* The backend's transfer array with room for n (grown once, kept). */
ddp__tcp_xfer *ddp__tcp_xfers(ddp__tcp_backend *b, int n);

/* ---- tcp/algorithms.c ----------------------------------------------------- */

ddp_status ddp__tcp_allreduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, ddp_reduce_op op);
ddp_status ddp__tcp_broadcast(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                              ddp_dtype dtype, int root);
ddp_status ddp__tcp_reduce(ddp__backend *be, const ddp__op_ctx *ctx, void *buf, size_t count,
                           ddp_dtype dtype, ddp_reduce_op op, int root);
ddp_status ddp__tcp_allgather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                              void *recv, size_t count, ddp_dtype dtype);
ddp_status ddp__tcp_gather(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                           void *recv, size_t count, ddp_dtype dtype, int root);
ddp_status ddp__tcp_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                            void *recv, size_t count, ddp_dtype dtype, int root);
ddp_status ddp__tcp_reduce_scatter(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                                   void *recv, size_t count, ddp_dtype dtype, ddp_reduce_op op);
ddp_status ddp__tcp_all_to_all(ddp__backend *be, const ddp__op_ctx *ctx, const void *send,
                               void *recv, size_t count, ddp_dtype dtype);
ddp_status ddp__tcp_barrier(ddp__backend *be, const ddp__op_ctx *ctx);

/* The progress scans' "active transfer per (peer, direction)" arrays (the
 * collectives' engine and the point-to-point lane): act_send[size] and
 * act_recv[size] after pfd_owner, each set to -1 (none active yet). */
static inline void ddp__tcp_active_reset(ddp__tcp_backend *b, int **act_send, int **act_recv) {
  *act_send = b->pfd_owner + b->size + 1;
  *act_recv = *act_send + b->size;
  for (int r = 0; r < b->size; r++) (*act_send)[r] = (*act_recv)[r] = -1;
}

#endif /* DDP__COMM_TCP_H */
