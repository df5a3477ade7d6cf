/* The node agent: where the job's store lives and how the nodes of a job find
 * each other. The store is served by a child process (store_proc.c). One
 * node: ddprun hosts the store on a free port of 127.0.0.1.
 * Several: the node that hosts the rendezvous endpoint (node 0 with static
 * ranks, the endpoint's own host with c10d) runs the store there; every node
 * claims a node rank (given, or by arrival with c10d), publishes its worker
 * count and host, and learns the world. After each attempt the nodes agree
 * whether any of them failed, so they restart (or stop) together.
 * Keys, under "ddprun/<run id>/":
 *   node/claim/<r>     add()ed by the node claiming static rank r (2: a duplicate)
 *   node/arrivals      add()ed by each c10d node: its rank is the count - 1
 *   node/<r>           "<nproc> <hostname>"
 *   node/<r>/beat      add()ed by node r at every poll: the others see it alive
 *   master             "<port> <addr>": MASTER_PORT and MASTER_ADDR, by node 0
 *   attempt/<n>/failed the first failure of attempt n, "rank 3 ... : killed by ..."
 *   attempt/<n>/ended  add()ed by each node whose workers of attempt n are gone
 *   attempt/<n>/closed set by the last node to end attempt n
 *   attempt/<n>/read   add()ed by each node once it read the outcome
 * The workers' own keys live under "ddprun/<run id>/attempt/<n>/" (their
 * DDP_STORE_PREFIX), so every attempt rendezvouses afresh. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/launch_internal.h"
#include "net/net.h"

#define CLOSE_LINGER_S 10.0
/* A node silent this long while the others wait for it is gone (bounded by
 * --rdzv-timeout, so tests can make it short). */
#define SILENCE_LIMIT_S 30.0

ddp_status ddp__free_port(const char *bind_addr, int32_t *port) {
  int fd;
  DDP_TRY(ddp__net_listen(bind_addr, 0, 1, &fd));
  *port = ddp__net_local_port(fd);
  close(fd);
  if (*port == 0) return ddp_error(DDP_ERR_SYS, "launch: cannot find a free port on %s", bind_addr);
  return DDP_OK;
}

static int is_loopback(const char *host) {
  return strcmp(host, "localhost") == 0 || strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0;
}

/* Whether `host` names this machine: binding a socket to its address works. */
static int is_local(const char *host) {
  int fd;
  if (ddp__net_listen(host, 0, 1, &fd) != DDP_OK) {
    ddp_clear_error();
    return 0;
  }
  close(fd);
  return 1;
}

/* "host", "host:port" or "[v6]:port" -> host, port (default_port when absent). */
static ddp_status split_endpoint(const char *what, const char *text, int32_t default_port, char *host,
                                 size_t bytes, int32_t *port) {
  const char *colon = strrchr(text, ':');
  const char *bracket = strchr(text, ']');
  size_t n = strlen(text);
  *port = default_port;
  if (text[0] == '[') {
    if (!bracket) return ddp_error(DDP_ERR_INVALID, "%s %s: missing ']'", what, text);
    n = (size_t)(bracket - text - 1);
    text++;
    colon = bracket[1] == ':' ? bracket + 1 : NULL;
  } else if (colon && strchr(text, ':') != colon) {
    colon = NULL; /* a bare IPv6 address */
  } else if (colon) {
    n = (size_t)(colon - text);
  }
  if (n == 0 || n >= bytes) return ddp_error(DDP_ERR_INVALID, "%s %s: bad host", what, text);
  memcpy(host, text, n);
  host[n] = '\0';
  if (colon) {
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end || p < 1 || p > 65535)
      return ddp_error(DDP_ERR_INVALID, "%s %s: the port must be 1..65535", what, colon + 1);
    *port = (int32_t)p;
  }
  return DDP_OK;
}

static ddp_status open_single(const ddp_launch_config *cfg, ddp__agent *a) {
  ddp__world *w = &a->world;
  ddp_status s = ddp__store_proc_start("127.0.0.1", 0, &a->server);
  if (s) return ddp_error_wrap(s, "ddprun cannot host its store on 127.0.0.1");
  ddp__net_format_host_port("127.0.0.1", a->server.port, w->store_addr,
                            sizeof w->store_addr);
  snprintf(w->master_addr, sizeof w->master_addr, "%s", cfg->master_addr[0] ? cfg->master_addr : "127.0.0.1");
  w->master_port = cfg->master_port;
  if (w->master_port == 0) DDP_TRY(ddp__free_port("0.0.0.0", &w->master_port));
  w->world_size = cfg->nproc_per_node;
  w->rank_offset = 0;
  w->nnodes = 1;
  w->node_rank = 0;
  return DDP_OK;
}

static ddp_status claim_rank(const ddp_launch_config *cfg, ddp__agent *a) {
  ddp__world *w = &a->world;
  int64_t count;
  if (cfg->rdzv_backend == DDP_LAUNCH_RDZV_C10D) {
    DDP_TRY(ddp_store_add(a->store, "node/arrivals", 1, &count));
    if (count > cfg->nnodes)
      return ddp_error(DDP_ERR_INVALID,
                       "rendezvous %s at %s: this is node %lld to arrive but --nnodes is %d (a node "
                       "from an earlier job with the same --rdzv-id, or one node too many?)",
                       cfg->rdzv_id, w->store_addr, (long long)count, (int)cfg->nnodes);
    w->node_rank = (int32_t)(count - 1);
    return DDP_OK;
  }
  w->node_rank = cfg->node_rank < 0 ? 0 : cfg->node_rank;
  char key[64];
  snprintf(key, sizeof key, "node/claim/%d", (int)w->node_rank);
  DDP_TRY(ddp_store_add(a->store, key, 1, &count));
  if (count > 1)
    return ddp_error(DDP_ERR_INVALID,
                     "rendezvous %s at %s: node rank %d is claimed by two nodes; give each node its "
                     "own --node-rank in 0..%d (or use --rdzv-backend c10d)",
                     cfg->rdzv_id, w->store_addr, (int)w->node_rank, (int)cfg->nnodes - 1);
  return DDP_OK;
}

/* Publishes this node, waits for all, and computes the world. */
static ddp_status learn_world(const ddp_launch_config *cfg, ddp__agent *a) {
  ddp__world *w = &a->world;
  int32_t n = cfg->nnodes;
  char mine[DDP_LAUNCH_HOST_BYTES + 32], key[64];
  snprintf(mine, sizeof mine, "%d %s", (int)cfg->nproc_per_node, a->host);
  snprintf(key, sizeof key, "node/%d", (int)w->node_rank);
  DDP_TRY(ddp_store_set(a->store, key, mine, strlen(mine)));
  char (*names)[32] = ddp_calloc((size_t)n, sizeof *names);
  const char **keys = ddp_calloc((size_t)n, sizeof *keys);
  ddp_store_value *values = ddp_calloc((size_t)n, sizeof *values);
  ddp_status s = DDP_OK;
  if (!names || !keys || !values) {
    s = ddp_error(DDP_ERR_NOMEM, "launch: out of memory for %d nodes", (int)n);
    goto out;
  }
  for (int32_t i = 0; i < n; i++) {
    snprintf(names[i], sizeof names[i], "node/%d", (int)i);
    keys[i] = names[i];
  }
  s = ddp_store_multi_get(a->store, keys, (size_t)n, (int64_t)(a->rdzv_timeout_s * 1000.0), values);
  if (s) {
    s = ddp_error_wrap(s, "rendezvous %s: node %d waited %g s for all %d nodes (is ddprun running on "
                       "every node, with the same --nnodes, --rdzv-id and endpoint?)",
                       cfg->rdzv_id, (int)w->node_rank, a->rdzv_timeout_s, (int)n);
    goto out;
  }
  w->world_size = 0;
  for (int32_t i = 0; i < n; i++) {
    int nproc = 0;
    if (sscanf(values[i].data, "%d", &nproc) != 1 || nproc < 1) {
      s = ddp_error(DDP_ERR_FORMAT, "rendezvous %s: node %d published \"%s\"", cfg->rdzv_id, (int)i,
                    (const char *)values[i].data);
      goto out;
    }
    if (i == w->node_rank) w->rank_offset = w->world_size;
    w->world_size += nproc;
  }
out:
  if (values) ddp_store_values_free(values, (size_t)n);
  ddp_free(values);
  ddp_free(keys);
  ddp_free(names);
  return s;
}

/* MASTER_ADDR / MASTER_PORT for the workers: chosen by node 0 and published. */
static ddp_status agree_master(const ddp_launch_config *cfg, ddp__agent *a, const char *endpoint_host,
                               int32_t endpoint_port) {
  ddp__world *w = &a->world;
  if (w->node_rank == 0) {
    const char *addr = cfg->master_addr[0] ? cfg->master_addr : a->server.pid > 0 ? endpoint_host : a->host;
    int32_t port = cfg->master_port;
    /* The store holds the endpoint's port; MASTER_PORT must be another one,
     * free for a PyTorch rank 0 to host its own store on. */
    if (port == 0 || port == endpoint_port) DDP_TRY(ddp__free_port("0.0.0.0", &port));
    char value[DDP_LAUNCH_HOST_BYTES + 16];
    snprintf(value, sizeof value, "%d %s", (int)port, addr);
    DDP_TRY(ddp_store_set(a->store, "master", value, strlen(value)));
  }
  void *v = NULL;
  size_t bytes = 0;
  DDP_TRY(ddp_store_get(a->store, "master", (int64_t)(a->rdzv_timeout_s * 1000.0), &v, &bytes));
  int port = 0, used = 0;
  if (sscanf(v, "%d %n", &port, &used) != 1 || used == 0 || strlen((char *)v + used) >= sizeof w->master_addr) {
    ddp_status s = ddp_error(DDP_ERR_FORMAT, "rendezvous %s: bad master \"%s\"", cfg->rdzv_id, (char *)v);
    ddp_free(v);
    return s;
  }
  w->master_port = port;
  snprintf(w->master_addr, sizeof w->master_addr, "%s", (char *)v + used);
  ddp_free(v);
  return DDP_OK;
}

static ddp_status open_multi(const ddp_launch_config *cfg, ddp__agent *a) {
  ddp__world *w = &a->world;
  char host[DDP_LAUNCH_HOST_BYTES];
  int32_t port;
  if (cfg->rdzv_endpoint[0]) {
    DDP_TRY(split_endpoint("--rdzv-endpoint", cfg->rdzv_endpoint,
                           cfg->rdzv_backend == DDP_LAUNCH_RDZV_C10D ? DDP__LAUNCH_C10D_PORT
                                                                      : DDP__LAUNCH_MULTI_NODE_PORT,
                           host, sizeof host, &port));
  } else {
    snprintf(host, sizeof host, "%s", cfg->master_addr[0] ? cfg->master_addr : "127.0.0.1");
    port = cfg->master_port ? cfg->master_port : DDP__LAUNCH_MULTI_NODE_PORT;
  }
  ddp__net_format_host_port(host, (uint16_t)port, w->store_addr, sizeof w->store_addr);
  const char *bind = is_loopback(host) ? (strchr(host, ':') ? "::1" : "127.0.0.1")
                     : strchr(host, ':')  ? "::"
                                          : "0.0.0.0";
  int host_it = cfg->rdzv_backend == DDP_LAUNCH_RDZV_STATIC ? cfg->node_rank <= 0 : is_local(host);
  if (host_it) {
    ddp_status s = ddp__store_proc_start(bind, (uint16_t)port, &a->server);
    if (s == DDP_ERR_ADDRINUSE && cfg->rdzv_backend == DDP_LAUNCH_RDZV_C10D) {
      ddp_clear_error(); /* another node of this host got there first */
    } else if (s) {
      return ddp_error_wrap(s, "node %d cannot host the job's store at %s", (int)cfg->node_rank < 0 ? 0 : (int)cfg->node_rank,
                            w->store_addr);
    }
  }
  ddp_store_options so = {0};
  so.timeout_ms = (int64_t)(a->rdzv_timeout_s * 1000.0);
  so.connect_timeout_ms = so.timeout_ms;
  ddp_store *base = NULL;
  ddp_status s = ddp_store_tcp_connect(a->server.pid > 0 ? (strcmp(bind, "::") == 0 || strcmp(bind, "::1") == 0 ? "::1" : "127.0.0.1") : host,
                                       (uint16_t)port, &so, &base);
  if (s) return ddp_error_wrap(s, "ddprun cannot reach the job's store at %s (is node 0's ddprun running?)", w->store_addr);
  char prefix[DDP_LAUNCH_ID_BYTES + 16];
  snprintf(prefix, sizeof prefix, "ddprun/%s/", cfg->rdzv_id);
  s = ddp_store_prefix(base, prefix, &a->store);
  ddp_store_destroy(base);
  if (s) return s;
  w->nnodes = cfg->nnodes;
  a->beats = ddp_calloc((size_t)cfg->nnodes, sizeof *a->beats);
  a->beat_seen_s = ddp_calloc((size_t)cfg->nnodes, sizeof *a->beat_seen_s);
  if (!a->beats || !a->beat_seen_s) return ddp_error(DDP_ERR_NOMEM, "launch: out of memory for %d nodes", (int)cfg->nnodes);
  a->silence_limit_s = cfg->rdzv_timeout_s < SILENCE_LIMIT_S ? cfg->rdzv_timeout_s : SILENCE_LIMIT_S;
  if (cfg->min_nnodes > 0) {
    /* Elastic: the nodes meet in rounds once the signal pipe is up
     * (ddp__elastic_join, from ddp__job_run_elastic); a node is dead after
     * torchrun's keep-alive limit, not the static job's 30 s. */
    a->elastic_min = cfg->min_nnodes;
    a->elastic_max = cfg->nnodes;
    a->last_call_s = cfg->last_call_timeout_s;
    a->silence_limit_s = cfg->keep_alive_s;
    snprintf(a->node_addr, sizeof a->node_addr, "%s", cfg->master_addr);
    a->node_hosts = ddp_calloc((size_t)cfg->nnodes, sizeof *a->node_hosts);
    if (!a->node_hosts) return ddp_error(DDP_ERR_NOMEM, "launch: out of memory for %d nodes", (int)cfg->nnodes);
    w->nnodes = 0;
    w->elastic = 1;
    return DDP_OK;
  }
  DDP_TRY(claim_rank(cfg, a));
  DDP_TRY(learn_world(cfg, a));
  DDP_TRY(agree_master(cfg, a, host, port));
  return DDP_OK;
}

ddp_status ddp__agent_open(const ddp_launch_config *cfg, ddp__agent *a) {
  memset(a, 0, sizeof *a);
  if (gethostname(a->host, sizeof a->host - 1) != 0) snprintf(a->host, sizeof a->host, "localhost");
  a->rdzv_timeout_s = cfg->rdzv_timeout_s;
  a->monitor_interval_s = cfg->monitor_interval_s;
  ddp__world *w = &a->world;
  w->nproc = cfg->nproc_per_node;
  w->max_restarts = cfg->max_restarts;
  snprintf(w->run_id, sizeof w->run_id, "%s", cfg->rdzv_id);
  ddp_status s = cfg->nnodes == 1 ? open_single(cfg, a) : open_multi(cfg, a);
  if (s && a->server.pid > 0 && ddp__store_proc_exited(&a->server)) {
    char what[256];
    ddp__store_proc_describe(&a->server, what, sizeof what);
    s = ddp_error_wrap(s, "%s", what);
  }
  if (s) ddp__agent_close(a);
  return s;
}

static ddp_status beat(ddp__agent *a) {
  char key[64];
  snprintf(key, sizeof key, "node/%d/beat", (int)a->world.node_rank);
  return ddp_store_add(a->store, key, 1, NULL);
}

/* Reads every other node's beat count; a node whose count has not moved for
 * silence_limit_s is gone: an error naming it. */
static ddp_status check_beats(ddp__agent *a) {
  double now = ddp_time_s();
  for (int32_t r = 0; r < a->world.nnodes; r++) {
    if (r == a->world.node_rank) continue;
    char key[64];
    int64_t count;
    snprintf(key, sizeof key, "node/%d/beat", (int)r);
    DDP_TRY(ddp_store_add(a->store, key, 0, &count));
    if (count != a->beats[r] || a->beat_seen_s[r] == 0) {
      a->beats[r] = count;
      a->beat_seen_s[r] = now;
    } else if (now - a->beat_seen_s[r] > a->silence_limit_s) {
      return ddp_error(DDP_ERR_PEER,
                       "node %d has been silent for %.0f s while node %d waits for it to end attempt "
                       "%d: its ddprun died or hangs (its workers die with it)",
                       (int)r, now - a->beat_seen_s[r], (int)a->world.node_rank, (int)a->attempt);
    }
  }
  return DDP_OK;
}

static void attempt_key(char *buf, size_t bytes, int32_t attempt, const char *what) {
  snprintf(buf, bytes, "attempt/%d/%s", (int)attempt, what);
}

int ddp__agent_poll(void *ctx) {
  ddp__agent *a = ctx;
  if (!a->store) return 0;
  char key[64];
  attempt_key(key, sizeof key, a->attempt, "failed");
  const char *keys[] = {key};
  int exists = 0;
  if (beat(a) != DDP_OK || ddp_store_check(a->store, keys, 1, &exists) != DDP_OK) return -1;
  return exists;
}

void ddp__agent_announce_failure(ddp__agent *a, int32_t attempt, const char *failure) {
  if (!a->store || !failure || !*failure) return;
  char key[64];
  attempt_key(key, sizeof key, attempt, "failed");
  if (ddp_store_compare_set(a->store, key, "", 0, failure, strlen(failure), NULL, NULL) != DDP_OK)
    ddp_clear_error(); /* end_attempt publishes it again and reports a lost store */
}

ddp_status ddp__agent_end_attempt(ddp__agent *a, int32_t attempt, const char *failure, double deadline_s,
                                  int *any_failed) {
  *any_failed = failure != NULL;
  a->remote_failure[0] = '\0';
  if (!a->store) return DDP_OK;
  char failed[64], ended[64], closed[64], read[64];
  attempt_key(failed, sizeof failed, attempt, "failed");
  attempt_key(ended, sizeof ended, attempt, "ended");
  attempt_key(closed, sizeof closed, attempt, "closed");
  attempt_key(read, sizeof read, attempt, "read");
  if (failure) DDP_TRY(ddp_store_compare_set(a->store, failed, "", 0, failure, strlen(failure), NULL, NULL));
  int64_t count;
  DDP_TRY(ddp_store_add(a->store, ended, 1, &count));
  if (count == a->world.nnodes) DDP_TRY(ddp_store_set(a->store, closed, "1", 1));
  /* Other nodes may still be running their workers: wait in slices, so that a
   * SIGINT or SIGTERM to this ddprun (left in the signal pipe) ends the wait. */
  const char *keys[] = {closed};
  memset(a->beat_seen_s, 0, (size_t)a->world.nnodes * sizeof *a->beat_seen_s);
  for (;;) {
    ddp_status s = beat(a);
    if (s == DDP_OK) s = ddp_store_wait(a->store, keys, 1, 500);
    if (s == DDP_OK) break;
    if (s == DDP_ERR_TIMEOUT) s = check_beats(a);
    if (s == DDP_ERR_PEER) return s;
    if (s != DDP_OK)
      return ddp_error_wrap(s, "node %d waiting for the other nodes to end attempt %d", (int)a->world.node_rank,
                            (int)attempt);
    int sigs[16], n = ddp__signals_take(sigs, 16);
    for (int i = 0; i < n; i++)
      if (sigs[i] == SIGINT || sigs[i] == SIGTERM || sigs[i] == SIGHUP)
        return ddp_error(DDP_ERR_ABORTED, "node %d: stopped by signal %d while waiting for the other nodes",
                         (int)a->world.node_rank, sigs[i]);
    if (deadline_s > 0 && ddp_time_s() > deadline_s)
      return ddp_error(DDP_ERR_TIMEOUT, "node %d: the job timeout passed while waiting for the other nodes",
                       (int)a->world.node_rank);
  }
  void *v = NULL;
  size_t bytes = 0;
  if (ddp_store_get(a->store, failed, 0, &v, &bytes) == DDP_OK) {
    *any_failed = 1;
    if (!failure) snprintf(a->remote_failure, sizeof a->remote_failure, "%s", (char *)v);
    ddp_free(v);
  } else {
    ddp_clear_error();
  }
  DDP_TRY(ddp_store_add(a->store, read, 1, &count));
  a->read_outcome = 1;
  return DDP_OK;
}

void ddp__agent_close(ddp__agent *a) {
  if (!a) return;
  if (a->server.pid > 0 && a->store && a->read_outcome) {
    /* The store dies with this process: let every node read the outcome of
     * the last attempt first (bounded, in case a node is gone). */
    char read[64];
    attempt_key(read, sizeof read, a->attempt, "read");
    double until = ddp_time_s() + CLOSE_LINGER_S;
    while (ddp_time_s() < until) {
      int64_t count = 0;
      if (ddp_store_add(a->store, read, 0, &count) != DDP_OK || count >= a->world.nnodes) break;
      usleep(10 * 1000);
    }
  }
  ddp_store_watch_close(a->round_watch);
  a->round_watch = NULL;
  ddp_store_destroy(a->store);
  ddp__store_proc_stop(&a->server); /* last: the workers are gone, every node has read */
  ddp_free(a->beats);
  ddp_free(a->beat_seen_s);
  ddp_free(a->node_hosts);
  a->node_hosts = NULL;
  a->store = NULL;
  a->server.pid = 0;
  a->beats = NULL;
  a->beat_seen_s = NULL;
}
