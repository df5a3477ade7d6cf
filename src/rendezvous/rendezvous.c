/* ddp_rendezvous: open or host the store, then the join protocol. Every rank
 * claims its rank, registers its host identity and waits until all
 * world_size ranks have; the last to arrive publishes the table of hosts.
 * Keys (docs/rendezvous.md):
 *   rdzv/world_size compare_set() by the first rank; the others must agree
 *   rdzv/claim/<r>  add()ed by whoever claims rank r: 2 means a duplicate
 *   rdzv/rank/<r>   "ddp-rdzv 1 <world_size> <pid> <host_id>"
 *   rdzv/joined     add()ed once per rank that registered
 *   rdzv/done       set once by the last rank to join: "ddp-rdzv 1 ok\n<hosts>\n
 *                   <host id>\n...<host index of rank 0> <of rank 1> ...\n", or
 *                   by a rank that found the job broken: "ddp-rdzv 1 abort\n<why>" */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core_internal.h"
#include "net/net.h"
#include "rendezvous/rdzv_internal.h"

#define KEY_JOINED "rdzv/joined"
#define KEY_DONE "rdzv/done"
#define KEY_WORLD "rdzv/world_size"
#define KEY_RANK_FMT "rdzv/rank/%d"
#define KEY_CLAIM_FMT "rdzv/claim/%d"
#define REG_MAGIC "ddp-rdzv 1"
#define MAX_LISTED_RANKS 32
/* How long a duplicate waits for the first claimant's registration, to name it. */
#define DUPLICATE_PEEK_MS 2000
#define HOST_LINGER_S 2.0
#define PROGRESS_MIN_S 1.0
#define PROGRESS_MAX_S 30.0

static void linger(ddp_rendezvous_info *info);

void ddp_rendezvous_info_destroy(ddp_rendezvous_info *info) {
  if (!info) return;
  if (info->server) linger(info);
  ddp_store_destroy(info->store);
  ddp_store_server_stop(info->server);
  ddp_free(info->rank_host);
  memset(info, 0, sizeof *info);
}

static int64_t remaining_ms(double deadline) {
  double left = deadline - ddp_time_s();
  return left <= 0.001 ? 1 : (int64_t)(left * 1000.0);
}

/* ---- Opening the store ---------------------------------------------------- */

static int is_loopback(const char *host) {
  return strcmp(host, "localhost") == 0 || strncmp(host, "127.", 4) == 0 ||
         strcmp(host, "::1") == 0 || strcmp(host, "ip6-localhost") == 0;
}

/* Rank 0 without a launcher: host the server, then connect to it. */
static ddp_status host_store(ddp_rendezvous_info *info, const ddp_store_options *so) {
  /* Listen on every interface, as PyTorch does, because MASTER_ADDR may name
   * this host by an address other than the one its name resolves to here;
   * a loopback MASTER_ADDR keeps the store off the network. */
  const char *bind = "0.0.0.0";
  if (is_loopback(info->master_addr))
    bind = strchr(info->master_addr, ':') ? "::1" : "127.0.0.1";
  else if (strchr(info->master_addr, ':'))
    bind = "::";
  ddp_status s = ddp_store_server_start(bind, (uint16_t)info->master_port, NULL, &info->server);
  if (s == DDP_ERR_ADDRINUSE)
    return ddp_error(s,
                     "rank 0 cannot listen on %s:%d: address already in use — another job or a "
                     "stale process holds the port; pick another MASTER_PORT (`ss -ltnp "
                     "'sport = :%d'` shows the holder)",
                     bind, (int)info->master_port, (int)info->master_port);
  if (s) return ddp_error_wrap(s, "rank 0 cannot host the store on %s:%d", bind, (int)info->master_port);
  info->master_port = ddp_store_server_port(info->server);
  if (strchr(info->master_addr, ':'))
    snprintf(info->store_addr, sizeof info->store_addr, "[%s]:%d", info->master_addr,
             (int)info->master_port);
  else
    snprintf(info->store_addr, sizeof info->store_addr, "%s:%d", info->master_addr,
             (int)info->master_port);
  const char *self = strcmp(bind, "::") == 0 || strcmp(bind, "::1") == 0 ? "::1" : "127.0.0.1";
  s = ddp_store_tcp_connect(self, (uint16_t)info->master_port, so, &info->store);
  if (s) return ddp_error_wrap(s, "rank 0 cannot connect to the store it hosts");
  return DDP_OK;
}

static ddp_status connect_store(ddp_rendezvous_info *info, const char *host, int32_t port,
                                const ddp_store_options *so) {
  ddp_status s = ddp_store_tcp_connect(host, (uint16_t)port, so, &info->store);
  if (s == DDP_OK) return DDP_OK;
  /* The store's message nests the socket's error ("store h:p: cannot connect
   * within 30 s after 12 attempts (last error: connect to h:p: Connection
   * refused)"): keep the innermost part, which is what the user can act on. */
  char last[512], full[512];
  snprintf(last, sizeof last, "%s", ddp_last_error());
  memcpy(full, last, sizeof full);
  const char *inner = last, *at;
  while ((at = strstr(inner, "last error: ")) != NULL) inner = at + strlen("last error: ");
  if (inner != last) {
    memmove(last, inner, strlen(inner) + 1);
    size_t len = strlen(last);
    while (len > 0 && last[len - 1] == ')') last[--len] = '\0';
  }
  const char *hint = info->store_is_external
                         ? "is the launcher that set DDP_STORE_ADDR still running?"
                     : info->init_method[0] == 't'
                         ? "is rank 0 running, and is the init url's host:port right?"
                         : "is rank 0 running, and are MASTER_ADDR and MASTER_PORT right?";
  if (s == DDP_ERR_TIMEOUT)
    return ddp_error(s, "rank %d cannot reach the store at %s after %g s (last error: %s); %s",
                     (int)info->rank, info->store_addr, info->timeout_s, last, hint);
  if (s == DDP_ERR_AUTH) /* the store's message names the token and the variable */
    return ddp_error(s, "rank %d cannot use the store at %s: %s", (int)info->rank, info->store_addr,
                     full);
  return ddp_error(s, "rank %d cannot reach the store at %s (%s); %s", (int)info->rank,
                   info->store_addr, last, hint);
}

/* A launcher's store outlives one attempt of the job (ddprun restarts the
 * group in the same store): DDP_STORE_PREFIX, which the launcher sets per
 * attempt, gives each attempt's rendezvous and groups their own keys. */
static ddp_status scope_store(ddp_rendezvous_info *info) {
  const char *prefix = ddp_env_str("DDP_STORE_PREFIX", NULL);
  if (!prefix) return DDP_OK;
  ddp_store *scoped = NULL;
  ddp_status s = ddp_store_prefix(info->store, prefix, &scoped);
  ddp_store_destroy(info->store);
  info->store = scoped;
  if (s) return ddp_error_wrap(s, "DDP_STORE_PREFIX=\"%s\"", prefix);
  return DDP_OK;
}

static ddp_status open_store(const ddp__rdzv_url *url, ddp_rendezvous_info *info) {
  ddp_store_options so = {0};
  so.timeout_ms = (int64_t)(info->timeout_s * 1000.0);
  so.connect_timeout_ms = so.timeout_ms;
  so.token = NULL; /* $DDP_STORE_TOKEN, on both sides */
  if (url->scheme == DDP__RDZV_FILE) {
    ddp_status s = ddp_store_file_open(url->path, &so, &info->store);
    if (s) return ddp_error_wrap(s, "rank %d cannot open the file store %s", (int)info->rank, url->path);
    return DDP_OK;
  }
  if (info->store_is_external) {
    char host[DDP_RENDEZVOUS_ADDR_BYTES];
    int32_t port;
    DDP_TRY(ddp__net_split_hostport("DDP_STORE_ADDR", info->store_addr, host, sizeof host, &port));
    DDP_TRY(connect_store(info, host, port, &so));
    return scope_store(info);
  }
  if (info->rank == 0) return host_store(info, &so);
  return connect_store(info, info->master_addr, info->master_port, &so);
}

/* ---- Join ---------------------------------------------------------------- */

typedef struct registration {
  int32_t world_size;
  long pid;
  char host_id[DDP_RENDEZVOUS_HOST_ID_BYTES];
} registration;

static int parse_registration(const char *text, registration *reg) {
  int world, consumed = 0;
  long pid;
  if (sscanf(text, REG_MAGIC " %d %ld %n", &world, &pid, &consumed) != 2 || consumed == 0)
    return -1;
  const char *id = text + consumed;
  size_t n = strcspn(id, " \n");
  if (n == 0 || n >= sizeof reg->host_id) return -1;
  memcpy(reg->host_id, id, n);
  reg->host_id[n] = '\0';
  reg->world_size = world;
  reg->pid = pid;
  return 0;
}

/* Sets rdzv/done to an abort message unless it is already set (so the first
 * verdict stands), telling every waiting rank to give up now. */
static void publish_abort(ddp_store *store, const char *why) {
  char value[1200];
  int n = snprintf(value, sizeof value, REG_MAGIC " abort\n%s", why);
  if (n < 0) return;
  if ((size_t)n >= sizeof value) n = (int)sizeof value - 1;
  ddp_status s = ddp_store_compare_set(store, KEY_DONE, "", 0, value, (size_t)n, NULL, NULL);
  if (s) DDP_WARN("rendezvous: could not publish the abort (%s)", ddp_last_error());
}

static ddp_status duplicate_rank(ddp_rendezvous_info *info, long pid) {
  char key[64], other[300] = "another process";
  snprintf(key, sizeof key, KEY_RANK_FMT, (int)info->rank);
  void *v = NULL;
  size_t n = 0;
  registration reg;
  if (ddp_store_get(info->store, key, DUPLICATE_PEEK_MS, &v, &n) == DDP_OK &&
      parse_registration(v, &reg) == 0)
    snprintf(other, sizeof other, "pid %ld on %s", reg.pid, reg.host_id);
  ddp_free(v);
  char why[900];
  snprintf(why, sizeof why,
           "rank %d is claimed by two processes: %s and pid %ld on %s (rank from %s); every "
           "process needs its own rank in 0..%d",
           (int)info->rank, other, pid, info->host_id,
           ddp_rendezvous_source_name(info->rank_source), (int)info->world_size - 1);
  publish_abort(info->store, why);
  return ddp_error(DDP_ERR_INVALID, "rendezvous at %s: %s", info->store_addr, why);
}

/* The last rank to join reads every registration and publishes the table of
 * host identities (or an abort when the ranks disagree on the world size). */
static ddp_status publish_table(ddp_rendezvous_info *info, double deadline) {
  int32_t world = info->world_size;
  ddp_status s = DDP_OK;
  char **keys = ddp_calloc((size_t)world, sizeof *keys);
  ddp_store_value *values = ddp_calloc((size_t)world, sizeof *values);
  int32_t *host_of = ddp_calloc((size_t)world, sizeof *host_of);
  int32_t *owner = ddp_calloc((size_t)world, sizeof *owner); /* lowest rank of each host */
  registration *regs = ddp_calloc((size_t)world, sizeof *regs);
  char *table = NULL;
  if (!keys || !values || !host_of || !owner || !regs) {
    s = ddp_error(DDP_ERR_NOMEM, "rendezvous: out of memory for %d registrations", (int)world);
    goto done;
  }
  for (int32_t r = 0; r < world && !s; r++) {
    keys[r] = ddp_alloc(32);
    if (!keys[r]) s = ddp_error(DDP_ERR_NOMEM, "rendezvous: out of memory");
    else snprintf(keys[r], 32, KEY_RANK_FMT, (int)r);
  }
  for (int32_t first = 0; first < world && !s; first += (int32_t)DDP_STORE_MAX_KEYS_PER_CALL) {
    int32_t count = world - first;
    if (count > (int32_t)DDP_STORE_MAX_KEYS_PER_CALL) count = (int32_t)DDP_STORE_MAX_KEYS_PER_CALL;
    s = ddp_store_multi_get(info->store, (const char *const *)keys + first, (size_t)count,
                            remaining_ms(deadline), values + first);
    if (s) s = ddp_error_wrap(s, "rendezvous: reading the registrations");
  }
  /* Host index per rank, in order of each host's lowest rank. O(world * hosts),
   * fine for the thousands of ranks and hundreds of hosts a job has. */
  int32_t num_hosts = 0;
  size_t table_bytes = 64;
  for (int32_t r = 0; r < world && !s; r++) {
    if (!values[r].data || parse_registration(values[r].data, &regs[r]) != 0) {
      s = ddp_error(DDP_ERR_FORMAT, "rendezvous: malformed registration at %s: '%.80s'", keys[r],
                    values[r].data ? (char *)values[r].data : "");
      break;
    }
    if (regs[r].world_size != world) {
      char why[1024];
      snprintf(why, sizeof why,
               "ranks disagree on the world size: rank %d (pid %ld on %s) says %d, rank %d "
               "(pid %ld on %s) says %d",
               (int)r, regs[r].pid, regs[r].host_id, (int)regs[r].world_size, (int)info->rank,
               (long)getpid(), info->host_id, (int)world);
      publish_abort(info->store, why);
      s = ddp_error(DDP_ERR_INVALID, "rendezvous at %s: %s", info->store_addr, why);
      break;
    }
    int32_t h = 0;
    while (h < num_hosts && strcmp(regs[owner[h]].host_id, regs[r].host_id) != 0) h++;
    if (h == num_hosts) {
      owner[num_hosts++] = r;
      table_bytes += strlen(regs[r].host_id) + 1;
    }
    host_of[r] = h;
    table_bytes += 12;
  }
  if (s) goto done;
  table = ddp_alloc(table_bytes);
  if (!table) {
    s = ddp_error(DDP_ERR_NOMEM, "rendezvous: out of memory for the host table");
    goto done;
  }
  size_t len = (size_t)snprintf(table, table_bytes, REG_MAGIC " ok\n%d\n", (int)num_hosts);
  for (int32_t h = 0; h < num_hosts; h++)
    len += (size_t)snprintf(table + len, table_bytes - len, "%s\n", regs[owner[h]].host_id);
  for (int32_t r = 0; r < world; r++)
    len += (size_t)snprintf(table + len, table_bytes - len, r + 1 < world ? "%d " : "%d\n",
                            (int)host_of[r]);
  DDP_ASSERT(len < table_bytes);
  s = ddp_store_compare_set(info->store, KEY_DONE, "", 0, table, len, NULL, NULL);
  if (s) s = ddp_error_wrap(s, "rendezvous: publishing %s", KEY_DONE);
done:
  if (keys)
    for (int32_t r = 0; r < world; r++) ddp_free(keys[r]);
  if (values) ddp_store_values_free(values, (size_t)world);
  ddp_free(keys);
  ddp_free(values);
  ddp_free(host_of);
  ddp_free(owner);
  ddp_free(regs);
  ddp_free(table);
  return s;
}

/* After a timeout: "3/4 joined; missing ranks: 2". */
static void describe_missing(ddp_rendezvous_info *info, char *out, size_t bytes) {
  int32_t world = info->world_size;
  int64_t joined = -1;
  if (ddp_store_add(info->store, KEY_JOINED, 0, &joined) != DDP_OK) joined = -1;
  uint8_t *present = ddp_calloc((size_t)world, 1);
  int32_t *missing = ddp_calloc((size_t)world, sizeof *missing);
  int known = 0;
  char **keys = NULL;
  size_t count = 0;
  if (present && missing && ddp_store_list_keys(info->store, &keys, &count) == DDP_OK) {
    for (size_t i = 0; i < count; i++) {
      int r, consumed = 0;
      if (sscanf(keys[i], "rdzv/rank/%d%n", &r, &consumed) == 1 && keys[i][consumed] == '\0' &&
          r >= 0 && r < world)
        present[r] = 1;
    }
    ddp_store_keys_free(keys, count);
    known = 1;
  }
  int32_t num_missing = 0;
  if (known)
    for (int32_t r = 0; r < world; r++)
      if (!present[r]) missing[num_missing++] = r;
  char list[600] = "unknown";
  if (known) ddp__format_ranks(missing, num_missing, MAX_LISTED_RANKS, list, sizeof list);
  if (joined >= 0)
    snprintf(out, bytes, "%lld/%d joined; missing ranks: %s", (long long)joined, (int)world, list);
  else
    snprintf(out, bytes, "missing ranks: %s", list);
  ddp_free(present);
  ddp_free(missing);
}

/* Parses the table in rdzv/done into info's host fields, deriving the local
 * rank and local world size where no variable gave them. */
static ddp_status read_table(ddp_rendezvous_info *info, const char *text) {
  int32_t world = info->world_size;
  const char *p = text + strlen(REG_MAGIC " ok\n");
  char *end;
  long hosts = strtol(p, &end, 10);
  if (end == p || *end != '\n' || hosts < 1 || hosts > world) goto malformed;
  p = end + 1;
  info->num_hosts = (int32_t)hosts;
  const char *my_host = NULL;
  const char *lines = p;
  for (long h = 0; h < hosts; h++) {
    const char *nl = strchr(p, '\n');
    if (!nl) goto malformed;
    p = nl + 1;
  }
  info->rank_host = ddp_calloc((size_t)world, sizeof *info->rank_host);
  if (!info->rank_host) return ddp_error(DDP_ERR_NOMEM, "rendezvous: out of memory");
  for (int32_t r = 0; r < world; r++) {
    long h = strtol(p, &end, 10);
    if (end == p || h < 0 || h >= hosts || (*end != ' ' && *end != '\n')) goto malformed;
    info->rank_host[r] = (int32_t)h;
    p = end + 1;
  }
  info->host_index = info->rank_host[info->rank];
  my_host = lines;
  for (int32_t h = 0; h < info->host_index; h++) my_host = strchr(my_host, '\n') + 1;
  size_t idlen = strcspn(my_host, "\n");
  if (idlen != strlen(info->host_id) || memcmp(my_host, info->host_id, idlen) != 0)
    return ddp_error(DDP_ERR_STATE,
                     "rendezvous at %s: the host table gives rank %d the host '%.*s', not this "
                     "process's '%s' (two processes claimed rank %d?)",
                     info->store_addr, (int)info->rank, (int)idlen, my_host, info->host_id,
                     (int)info->rank);
  int32_t below = 0, same = 0;
  for (int32_t r = 0; r < world; r++)
    if (info->rank_host[r] == info->host_index) {
      same++;
      if (r < info->rank) below++;
    }
  if (info->local_rank < 0) {
    info->local_rank = below;
    info->local_rank_source = DDP_RENDEZVOUS_SOURCE_HOSTS;
  }
  if (info->local_world_size < 0) {
    info->local_world_size = same;
    info->local_world_size_source = DDP_RENDEZVOUS_SOURCE_HOSTS;
  }
  if (info->local_rank >= info->local_world_size)
    return ddp_error(DDP_ERR_INVALID,
                     "rendezvous: local rank %d (from %s) is out of range for local world size "
                     "%d (from %s)",
                     (int)info->local_rank, ddp_rendezvous_source_name(info->local_rank_source),
                     (int)info->local_world_size,
                     ddp_rendezvous_source_name(info->local_world_size_source));
  return DDP_OK;
malformed:
  return ddp_error(DDP_ERR_FORMAT, "rendezvous at %s: malformed host table in %s", info->store_addr,
                   KEY_DONE);
}

static const char *timeout_hint(const ddp_rendezvous_info *info) {
  switch (info->world_size_source) {
    case DDP_RENDEZVOUS_SOURCE_SLURM:
      return "; were all SLURM_NTASKS tasks started with srun?";
    case DDP_RENDEZVOUS_SOURCE_MPI:
      return "; were all ranks started by the same mpirun?";
    default:
      return "; did every worker start, with the same world size and init url?";
  }
}

/* Waits for rdzv/done until the deadline. A long wait is never silent: rank 0
 * logs who is still missing every progress interval (a tenth of the timeout,
 * between 1 and 30 s), so a job stuck on one absent rank says so long before
 * the timeout. */
static ddp_status wait_done(ddp_rendezvous_info *info, double deadline, void **done,
                            size_t *done_bytes) {
  double start = ddp_time_s();
  double interval = info->timeout_s / 10;
  if (interval < PROGRESS_MIN_S) interval = PROGRESS_MIN_S;
  if (interval > PROGRESS_MAX_S) interval = PROGRESS_MAX_S;
  for (;;) {
    double now = ddp_time_s();
    int last_slice = info->rank != 0 || now + interval >= deadline;
    int64_t slice_ms = last_slice ? remaining_ms(deadline) : (int64_t)(interval * 1000.0);
    ddp_status s = ddp_store_get(info->store, KEY_DONE, slice_ms, done, done_bytes);
    if (s != DDP_ERR_TIMEOUT || last_slice) return s;
    char missing[800];
    describe_missing(info, missing, sizeof missing);
    DDP_WARN("rendezvous at %s: still waiting after %.0f s (timeout %g s): %s",
             info->store_addr, ddp_time_s() - start, info->timeout_s, missing);
  }
}

static ddp_status join(ddp_rendezvous_info *info, double deadline) {
  ddp_store *store = info->store;
  long pid = (long)getpid();
  char claim_key[64], rank_key[64];
  snprintf(claim_key, sizeof claim_key, KEY_CLAIM_FMT, (int)info->rank);
  snprintf(rank_key, sizeof rank_key, KEY_RANK_FMT, (int)info->rank);

  /* The first rank to arrive fixes the world size; a rank that disagrees
   * (a stale WORLD_SIZE, a mixed-up launch) fails everyone at once. */
  char world[16];
  int wn = snprintf(world, sizeof world, "%d", (int)info->world_size);
  void *agreed = NULL;
  size_t agreed_bytes = 0;
  ddp_status s = ddp_store_compare_set(store, KEY_WORLD, "", 0, world, (size_t)wn, &agreed,
                                       &agreed_bytes);
  if (s) return ddp_error_wrap(s, "rendezvous at %s: rank %d", info->store_addr, (int)info->rank);
  int differs = !agreed || agreed_bytes != (size_t)wn || memcmp(agreed, world, (size_t)wn) != 0;
  if (differs) {
    char why[600];
    snprintf(why, sizeof why,
             "ranks disagree on the world size: rank %d (pid %ld on %s) has %d (from %s), the "
             "ranks before it have %.12s",
             (int)info->rank, pid, info->host_id, (int)info->world_size,
             ddp_rendezvous_source_name(info->world_size_source), agreed ? (char *)agreed : "?");
    ddp_free(agreed);
    publish_abort(store, why);
    return ddp_error(DDP_ERR_INVALID, "rendezvous at %s: %s", info->store_addr, why);
  }
  ddp_free(agreed);

  int64_t claims = 0;
  s = ddp_store_add(store, claim_key, 1, &claims);
  if (s) return ddp_error_wrap(s, "rendezvous: rank %d claiming %s", (int)info->rank, claim_key);
  if (claims > 1) return duplicate_rank(info, pid);

  char reg[DDP_RENDEZVOUS_HOST_ID_BYTES + 64];
  int n = snprintf(reg, sizeof reg, REG_MAGIC " %d %ld %s", (int)info->world_size, pid, info->host_id);
  s = ddp_store_set(store, rank_key, reg, (size_t)n);
  if (s) return ddp_error_wrap(s, "rendezvous: rank %d registering at %s", (int)info->rank, rank_key);
  int64_t joined = 0;
  s = ddp_store_add(store, KEY_JOINED, 1, &joined);
  if (s) return ddp_error_wrap(s, "rendezvous: rank %d joining", (int)info->rank);
  DDP_DEBUG("rendezvous: rank %d joined %s (%lld/%d)", (int)info->rank, info->store_addr,
            (long long)joined, (int)info->world_size);
  if (joined == info->world_size) DDP_TRY(publish_table(info, deadline));

  void *done = NULL;
  size_t done_bytes = 0;
  s = wait_done(info, deadline, &done, &done_bytes);
  if (s == DDP_ERR_TIMEOUT) {
    /* Say who is missing, and tell the ranks still waiting the same, so that
     * every rank fails with one verdict instead of a cascade of timeouts. */
    char missing[800], why[1000];
    describe_missing(info, missing, sizeof missing);
    snprintf(why, sizeof why, "rank %d timed out after %g s waiting for workers: %s", (int)info->rank,
             info->timeout_s, missing);
    publish_abort(store, why);
    return ddp_error(s, "rendezvous at %s: %s (key '%s' never set)%s", info->store_addr, why,
                     KEY_DONE, timeout_hint(info));
  }
  if (s == DDP_ERR_CLOSED) {
    char last[512];
    snprintf(last, sizeof last, "%s", ddp_last_error());
    return ddp_error(s, "rendezvous at %s: rank %d lost the store while waiting for workers (did "
                     "the rank or launcher hosting it exit?): %s",
                     info->store_addr, (int)info->rank, last);
  }
  if (s) return ddp_error_wrap(s, "rendezvous at %s: rank %d waiting for %s", info->store_addr,
                               (int)info->rank, KEY_DONE);
  const char *text = done;
  if (strncmp(text, REG_MAGIC " abort\n", strlen(REG_MAGIC " abort\n")) == 0) {
    s = ddp_error(DDP_ERR_ABORTED, "rendezvous at %s aborted: %s", info->store_addr,
                  text + strlen(REG_MAGIC " abort\n"));
  } else if (strncmp(text, REG_MAGIC " ok\n", strlen(REG_MAGIC " ok\n")) == 0) {
    s = read_table(info, text);
  } else {
    s = ddp_error(DDP_ERR_FORMAT, "rendezvous at %s: %s holds '%.40s', not a rendezvous result "
                  "(a stale store from another job?)",
                  info->store_addr, KEY_DONE, text);
  }
  ddp_free(done);
  return s;
}

/* The rank that hosts the store keeps it up briefly (at most HOST_LINGER_S),
 * until the others have hung up: after a failed join, so they read the
 * verdict it published rather than "connection closed"; after a good run, so
 * a peer still reading the release of a final (monitored) barrier, or
 * destroying its group a moment later, does not lose the store under it
 * (programs under srun and mpirun failed that way at exit). */
static void linger(ddp_rendezvous_info *info) {
  ddp_store_destroy(info->store);
  info->store = NULL;
  double until = ddp_time_s() + HOST_LINGER_S;
  ddp_store_server_stats stats;
  for (;;) {
    ddp_store_server_get_stats(info->server, &stats);
    if (stats.clients == 0 || ddp_time_s() >= until) break;
    usleep(10000);
  }
}

ddp_status ddp_rendezvous(const char *url, const ddp_rendezvous_options *opts,
                          ddp_rendezvous_info *out) {
  if (!out) return ddp_error(DDP_ERR_INVALID, "ddp_rendezvous: out is NULL");
  memset(out, 0, sizeof *out);
  double start = ddp_time_s();
  ddp__rdzv_url parsed;
  DDP_TRY(ddp__rdzv_url_parse(url, &parsed));
  ddp_status s = ddp__rdzv_resolve(&parsed, opts, out);
  if (s == DDP_OK) s = ddp__net_host_id(out->host_id, sizeof out->host_id);
  if (s == DDP_OK) {
    DDP_DEBUG("rendezvous: %s:// rank %d (%s) of %d (%s), store %s%s, host %s, timeout %g s",
              out->init_method, (int)out->rank, ddp_rendezvous_source_name(out->rank_source),
              (int)out->world_size, ddp_rendezvous_source_name(out->world_size_source),
              out->store_addr, out->store_is_external ? " (external)" : "", out->host_id,
              out->timeout_s);
    s = open_store(&parsed, out);
  }
  if (s == DDP_OK) s = join(out, start + out->timeout_s);
  if (s) {
    ddp_rendezvous_info_destroy(out); /* lingers if this rank hosts the store */
    return s;
  }
  ddp_log_set_rank(out->rank);
  return DDP_OK;
}
