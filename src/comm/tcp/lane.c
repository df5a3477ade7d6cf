/* The tcp backend's point-to-point lane: every pending send and receive of
 * the group moves at once over a mesh of its own (a second socket per peer,
 * connected with the group's, so that the lane's frames never interleave
 * with a collective's running on the progress thread). Each call progresses
 * the first unfinished request of every (peer, direction), as the engine
 * does for a collective, then polls: for data where a receive waits, for
 * room where a send does, and for hang-ups elsewhere, without reading (a
 * message nobody receives yet stays in the kernel: no allocation, and the
 * sender's socket fills). */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "comm/tcp/tcp.h"

typedef struct lane_state {
  ddp__tcp_xfer x;
  bool posted;
} lane_state;
_Static_assert(sizeof(lane_state) <= sizeof(((ddp__p2p_req *)0)->state), "tcp lane state fits");

static lane_state *state_of(ddp__p2p_req *r) { return (lane_state *)(void *)r->state; }

static bool is_aborted(ddp__tcp_backend *b, const ddp__op_ctx *ctx) {
  return atomic_load(&b->aborted) || (ctx->aborted && atomic_load(ctx->aborted));
}

/* The engine's failure message, without the "<op> #<seq>: " the engine
 * puts first (the lane names the operation itself). */
static ddp_status lane_error(ddp__tcp_backend *b, const ddp__op_ctx *ctx) {
  const char *msg = b->failed_msg;
  char prefix[64];
  int len = snprintf(prefix, sizeof prefix, "%s #%llu: ", ctx->op ? ctx->op : "op",
                     (unsigned long long)ctx->seq);
  if (len > 0 && strncmp(msg, prefix, (size_t)len) == 0) msg += len;
  return ddp_error(b->failed ? b->failed : DDP_ERR_PEER, "%s", msg);
}

static bool queued_tag(const ddp__tcp_pair *p, int tag) {
  for (const ddp__tcp_msg *m = p->unexp_head; m; m = m->next)
    if (m->tag == (uint32_t)tag) return true;
  return false;
}

/* True when an earlier unfinished receive in reqs[0..i) has r's peer and
 * tag: messages of one (peer, tag) go to receives in posting order. */
static bool earlier_same(ddp__p2p_req *const *reqs, int i) {
  for (int j = 0; j < i; j++)
    if (!reqs[j]->is_send && !reqs[j]->finished && reqs[j]->peer == reqs[i]->peer &&
        reqs[j]->tag == reqs[i]->tag)
      return true;
  return false;
}

/* For each peer with receives pending and none part way, the receive its
 * next message is for, once that message is known: one already queued
 * aside, or one whose header has arrived (read once per peer and pass, so
 * that receives are matched against one view of the stream), goes to the
 * oldest receive posted for its tag. A message no pending receive wants
 * goes to the oldest receive (the engine queues it aside, which allocates;
 * a peer that left or a stream that ended is found the same way). Until a
 * header arrives no receive is active: act_recv is NEED_DATA, and the pair
 * is polled for it. */
enum { NEED_DATA = -2 };

static ddp_status pick_receives(ddp__tcp_backend *b, const ddp__op_ctx *ctx,
                                ddp__p2p_req *const *reqs, int n, int *act_recv, int *culprit) {
  int *tried = b->pfd_owner; /* (size) scratch until the poll fills it */
  for (int r = 0; r < b->size; r++) tried[r] = 0;
  for (int i = 0; i < n; i++) {
    ddp__p2p_req *r = reqs[i];
    if (r->finished || r->is_send || act_recv[r->peer] >= 0) continue;
    ddp__tcp_pair *p = &b->pairs[r->peer];
    if (!tried[r->peer]) {
      tried[r->peer] = 1;
      act_recv[r->peer] = NEED_DATA;
      if (!p->have_hdr && !p->peer_left && !p->draining &&
          ddp__tcp_read_header(b, ctx, p) == IO_ERROR) {
        *culprit = i;
        return lane_error(b, ctx);
      }
    }
    if (earlier_same(reqs, i)) continue;
    if (queued_tag(p, r->tag) || (p->have_hdr && p->hdr.tag == (uint32_t)r->tag))
      act_recv[r->peer] = i;
  }
  for (int i = 0; i < n; i++) {
    ddp__p2p_req *r = reqs[i];
    if (r->finished || r->is_send || act_recv[r->peer] != NEED_DATA) continue;
    ddp__tcp_pair *p = &b->pairs[r->peer];
    if (p->have_hdr || p->draining || p->peer_left) act_recv[r->peer] = i;
  }
  return DDP_OK;
}

/* Posts requests not yet posted and chooses, per (peer, direction), the
 * request whose turn it is: a send in posting order, a receive mid-payload,
 * else the one its tag picks (pick_receives). Fills act_send / act_recv and
 * *pending (requests not finished). */
static ddp_status lane_choose(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs,
                              int n, int *act_send, int *act_recv, int *pending, int *culprit) {
  *pending = 0;
  for (int i = 0; i < n; i++) {
    ddp__p2p_req *r = reqs[i];
    if (r->finished) continue;
    lane_state *ls = state_of(r);
    if (!ls->posted) {
      if (r->is_send)
        ddp__tcp_post_send(&ls->x, r->peer, r->buf, r->bytes);
      else
        ddp__tcp_post_recv(&ls->x, r->peer, r->buf, r->bytes);
      ls->x.kind = DDP__TCP_P2P;
      ls->x.tag = (uint32_t)r->tag;
      ls->posted = true;
    }
    if (b->pairs[r->peer].fd < 0) {
      *culprit = i;
      return ddp_error(DDP_ERR_STATE, "tcp backend: no connection to rank %d", r->peer);
    }
    ++*pending;
    if (r->is_send) {
      if (act_send[r->peer] < 0) act_send[r->peer] = i;
    } else if (ls->x.started) {
      act_recv[r->peer] = i; /* mid-payload: the pair's stream is its */
    }
  }
  return pick_receives(b, ctx, reqs, n, act_recv, culprit);
}

/* Moves each chosen request as far as its socket lets it; *moved when one
 * finished (so the next on its (peer, direction) may start). */
static ddp_status lane_move(ddp__tcp_backend *b, const ddp__op_ctx *ctx, ddp__p2p_req *const *reqs,
                            int n, const int *act_send, const int *act_recv, int *pending,
                            bool *moved, int *culprit) {
  *moved = false;
  for (int i = 0; i < n; i++) {
    ddp__p2p_req *r = reqs[i];
    if (r->finished || (r->is_send ? act_send[r->peer] : act_recv[r->peer]) != i) continue;
    lane_state *ls = state_of(r);
    int io = r->is_send ? ddp__tcp_progress_send(b, ctx, &ls->x) : ddp__tcp_progress_recv(b, ctx, &ls->x);
    if (io == IO_ERROR) {
      *culprit = i;
      return lane_error(b, ctx);
    }
    if (ls->x.finished) {
      r->finished = true;
      *moved = true;
      --*pending;
    }
  }
  return DDP_OK;
}

ddp_status ddp__tcp_p2p_progress(ddp__backend *be, const ddp__op_ctx *ctx,
                                 ddp__p2p_req *const *reqs, int n, int64_t wait_ns, int *culprit) {
  ddp__tcp_backend *b = ((ddp__tcp_backend *)be)->lane;
  *culprit = -1;
  if (!b) return ddp_error(DDP_ERR_STATE, "tcp backend: no point-to-point mesh");
  if (b->failed) return ddp_error(b->failed, "%s", b->failed_msg);
  int size = b->size;
  int *act_send = NULL, *act_recv = NULL;
  bool moved_any = false;
  for (int round = 0;; round++) {
    int pending;
    bool moved = true;
    while (moved) {
      ddp__tcp_active_reset(b, &act_send, &act_recv);
      DDP_TRY(lane_choose(b, ctx, reqs, n, act_send, act_recv, &pending, culprit));
      DDP_TRY(lane_move(b, ctx, reqs, n, act_send, act_recv, &pending, &moved, culprit));
      moved_any = moved_any || moved;
    }
    if (pending == 0 || moved_any || round > 0 || wait_ns <= 0 || is_aborted(b, ctx)) return DDP_OK;
    /* Nothing moved: wait for data, room, a hang-up or a wake. */
    int nfds = 0;
    for (int r = 0; r < size; r++) {
      ddp__tcp_pair *p = &b->pairs[r];
      if (r == b->rank || p->fd < 0) continue;
      short ev = 0;
      if (act_recv[r] >= 0 || act_recv[r] == NEED_DATA) ev |= POLLIN | POLLRDHUP;
      if (act_send[r] >= 0) ev |= POLLOUT;
      /* Others: a hang-up only, once (a peer that left stays readable). */
      if (!ev && !p->bye_seen) ev = POLLRDHUP;
      if (!ev) continue;
      b->pfds[nfds] = (struct pollfd){.fd = p->fd, .events = ev};
      b->pfd_owner[nfds++] = r;
    }
    b->pfds[nfds] = (struct pollfd){.fd = b->wake_fd, .events = POLLIN};
    b->pfd_owner[nfds++] = -1;
    int wait_ms = wait_ns >= 1000000000 ? 1000 : (int)((wait_ns + 999999) / 1000000);
    int rc = poll(b->pfds, (nfds_t)nfds, wait_ms);
    if (rc < 0 && errno != EINTR)
      return ddp_error(DDP_ERR_SYS, "tcp backend: point-to-point poll: %s", strerror(errno));
    for (int i = 0; rc > 0 && i < nfds; i++) {
      short re = b->pfds[i].revents;
      int r = b->pfd_owner[i];
      if (!re) continue;
      if (r < 0) {
        uint64_t v;
        while (read(b->wake_fd, &v, sizeof v) > 0) {
        }
        continue;
      }
      /* An idle pair hung up: stop watching it; a later request to that
       * peer reads its end (BYE: it left; none: it died) or fails to send. */
      if (act_recv[r] == -1 && act_send[r] < 0 && (re & (POLLRDHUP | POLLHUP | POLLERR)))
        b->pairs[r].bye_seen = true;
    }
  }
}

void ddp__tcp_p2p_wake(ddp__backend *be) {
  ddp__tcp_backend *b = ((ddp__tcp_backend *)be)->lane;
  uint64_t one = 1;
  if (b && b->wake_fd >= 0) (void)!write(b->wake_fd, &one, sizeof one);
}
