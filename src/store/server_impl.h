/* The inside of the store server, shared by its two halves: server.c (the
 * epoll loop, connections, buffers, lifecycle) and server_requests.c (what
 * each request does, and the waiters behind blocking get / wait /
 * multi_get). Not a public header. */
#ifndef DDP_STORE_SERVER_IMPL_H
#define DDP_STORE_SERVER_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "net/net.h"
#include "store/protocol.h"
#include "store/table.h"

/* Stop reading a client's requests while this much output waits for it. */
#define OUT_HIGH_WATER (4u * 1024u * 1024u)

typedef struct client client;
typedef struct waiter waiter;
typedef struct watch watch;

/* One watched key's link into its entry's list of watchers. */
typedef struct wlink {
  struct wlink *prev, *next;
  watch *watch;
  ddp__kv_entry *entry; /* NULL when not linked */
} wlink;

/* A watch connection's keys and its queue: the stream positions (the
 * client's sent_total when the byte was written) at which each pending
 * notification ends, oldest first, in a ring of limits.max_watch_pending. */
struct watch {
  client *c;
  uint32_t num_keys;
  wlink *links;     /* one per key */
  uint64_t seq;     /* notifications queued so far */
  uint64_t *ends;   /* the ring */
  uint32_t head, count;
};

/* One waiter's link into a key's list. */
typedef struct wnode {
  struct wnode *prev, *next;
  waiter *w;
  ddp__kv_entry *entry; /* NULL when not linked */
} wnode;

/* A blocked get / wait / multi_get. Its keys are copied (the request's bytes
 * are gone once parsed). */
struct waiter {
  client *c;
  uint8_t op;
  int queued;            /* in the server's wake queue */
  uint32_t missing;      /* linked nodes: keys absent when last checked */
  uint64_t deletes_seen; /* the server's delete count when it was linked */
  int64_t deadline_ns;   /* -1: none */
  int64_t timeout_ms;
  uint32_t num_keys;
  ddp__slice *keys;    /* into key_bytes */
  wnode *nodes;        /* one per key */
  waiter *prev, *next; /* the server's list of all waiters */
};

struct client {
  int fd;
  int authed;
  int dead;          /* closed; freed at the end of the loop pass */
  int resume;        /* in the resume list */
  int backpressured; /* stopped parsing while its output drains */
  uint32_t events;   /* epoll interest now */
  int64_t hello_deadline_ns;
  ddp__buf in, out;
  size_t out_sent; /* bytes of `out` already written */
  waiter *waiter;
  watch *watch;        /* a watch connection (it sends nothing more) */
  uint32_t watch_cap;  /* its ring's size: limits.max_watch_pending */
  int closing;         /* a dropped watch: flush the error, then close */
  int64_t closing_deadline_ns;
  uint64_t sent_total; /* bytes of `out` written to the socket, ever */
  client *prev, *next; /* all clients */
  client *flush_next;  /* in the server's flush list */
  int flush_queued;
  client *resume_next;
  char addr[DDP_NET_ADDR_BYTES];
};

struct ddp_store_server {
  int listen_fd;
  int epoll_fd;
  int wake_fd;  /* eventfd: shutdown */
  int spare_fd; /* closed to accept-and-drop when out of fds */
  uint16_t port;
  char address[DDP_NET_ADDR_BYTES];
  char token[DDP_STORE_MAX_TOKEN_BYTES + 1];
  int has_token;
  ddp_store_limits limits;
  ddp_store_limits hello_limits; /* before the handshake: frames of a hello only */
  int64_t handshake_timeout_ms;
  ddp__kv_table table;
  client *clients;
  waiter *waiters;
  int64_t next_deadline_ns; /* earliest waiter / handshake deadline, -1 none */
  uint64_t deletes;         /* keys deleted so far (see waiter_recheck) */
  waiter **wake_queue;
  size_t wake_len, wake_cap;
  client *resume_list;
  client *dead_list;
  client *flush_list; /* watchers given notifications in this request */
  int stop; /* atomic */
  int running;
  pthread_t thread;
  int has_thread;
  ddp_store_server_stats stats; /* fields updated atomically */
};

#define STAT_ADD(s, field, v) __atomic_add_fetch(&(s)->stats.field, (v), __ATOMIC_RELAXED)
#define STAT_SET(s, field, v) __atomic_store_n(&(s)->stats.field, (v), __ATOMIC_RELAXED)

/* ---- server.c ----------------------------------------------------------- */

/* Lowers the loop's next wake-up to deadline_ns if that is sooner. */
void ddp__store_server_set_deadline(ddp_store_server *s, int64_t deadline_ns);
/* Writes what the socket takes of the client's output now. Returns -1 if
 * the client was dropped (its memory stays valid until the loop pass ends). */
int ddp__store_server_flush(ddp_store_server *s, client *c);
/* Sends an error reply and drops the client (its stream can no longer be
 * trusted). */
void ddp__store_server_reject(ddp_store_server *s, client *c, uint8_t status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Queues the client to have its buffered requests served at the end of this
 * loop pass (it was blocked and no new bytes may arrive to wake it). */
void ddp__store_server_resume(ddp_store_server *s, client *c);

/* ---- server_requests.c -------------------------------------------------- */

/* Serves one parsed request of an open client: a reply into c->out, or a
 * waiter, or a rejection. */
void ddp__store_server_handle(ddp_store_server *s, client *c, const ddp__store_request *req);
/* Answers the waiters whose deadline has passed (at `now`); lowers the next
 * deadline to the earliest of the rest. */
void ddp__store_server_expire_waiters(ddp_store_server *s, int64_t now);
/* Forgets a waiter without answering it (its client is gone). */
void ddp__store_server_cancel_waiter(ddp_store_server *s, waiter *w);
/* Forgets a watch (its client is gone or dropped). */
void ddp__store_server_cancel_watch(ddp_store_server *s, watch *w);
/* The client's output was written up to c->sent_total: pops the
 * notifications that left the server. */
void ddp__store_server_watch_sent(client *c);

#endif /* DDP_STORE_SERVER_IMPL_H */
