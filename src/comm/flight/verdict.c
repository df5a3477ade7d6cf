/* The flight recorder's verdict: from every rank's dump, per group, who
 * stopped where. Collectives are numbered alike on every rank of a group, so
 * the highest number any rank entered is where the group stands: a rank
 * that never entered it is the one the others wait for; ranks that entered
 * it as different collectives are a mismatch (the debug mode's wording); a
 * rank without a dump is named as such. Point-to-point operations still
 * running are listed with what their peer was doing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/flight/flight.h"
#include "core/core_internal.h"

#define MAX_LISTED 16

uint64_t ddp__flight_bytes(const ddp__flight_record *r) {
  if (r->kind == DDP__OP_P2P_BATCH) return 0; /* count is the batch's operations */
  if (r->dtype < 0 || r->dtype > DDP_BFLOAT16) return 0;
  return r->count * (uint64_t)ddp_dtype_size((ddp_dtype)r->dtype);
}

void ddp__flight_format_bytes(uint64_t bytes, char *out, size_t size) {
  static const char *units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) {
    snprintf(out, size, "%llu B", (unsigned long long)bytes);
    return;
  }
  double v = (double)bytes / 1024.0;
  int u = 0;
  while (v >= 1024.0 && u < 3) {
    v /= 1024.0;
    u++;
  }
  snprintf(out, size, "%.3g %s", v, units[u]);
}

static bool is_p2p(const ddp__flight_record *r) {
  return r->kind == DDP__OP_SEND || r->kind == DDP__OP_RECV || r->kind == DDP__OP_P2P_BATCH;
}

void ddp__flight_describe(const ddp__flight_record *r, char *out, size_t bytes) {
  const char *name = ddp__op_kind_name((ddp__op_kind)r->kind);
  char size[32];
  ddp__flight_format_bytes(ddp__flight_bytes(r), size, sizeof size);
  if (r->kind == DDP__OP_BARRIER)
    snprintf(out, bytes, "%s #%llu", name, (unsigned long long)r->seq);
  else if (r->kind == DDP__OP_P2P_BATCH) /* count: its operations (NCCL's grouped batch) */
    snprintf(out, bytes, "%s #%llu (%llu operations)", name, (unsigned long long)r->seq,
             (unsigned long long)r->count);
  else if (is_p2p(r))
    snprintf(out, bytes, "%s #%llu %s rank %d (%s, tag %d)", name, (unsigned long long)r->seq,
             r->kind == DDP__OP_SEND ? "to" : "from", (int)r->peer, size, (int)r->tag);
  else
    snprintf(out, bytes, "%s #%llu (%s)", name, (unsigned long long)r->seq, size);
}

/* ---- Output -------------------------------------------------------------- */

typedef struct out_text {
  FILE *f;
  const char *prefix; /* "group pg/1/sub/1/: " or "" */
} out_text;

static void ranks_text(const int32_t *ranks, int32_t n, char *out, size_t bytes) {
  char list[256];
  ddp__format_ranks(ranks, n, MAX_LISTED, list, sizeof list);
  snprintf(out, bytes, "%s %s", n == 1 ? "rank" : "ranks", list);
}

static void seconds_text(int64_t ns, char *out, size_t bytes) {
  snprintf(out, bytes, "%.3g s", ns > 0 ? (double)ns / 1e9 : 0.0);
}

/* ---- One group ------------------------------------------------------------- */

/* What one rank's ring says, for the verdict. */
typedef struct rank_view {
  const ddp__flight_group *group; /* NULL: no dump has this rank of the group */
  const ddp__flight_record *last; /* the highest-numbered collective it entered */
  const ddp__flight_record *p2p;  /* its newest send/recv that did not complete */
} rank_view;

/* From its start; an op still queued on its device (enqueued, never
 * started there) from when the program handed it over. */
static int64_t waited_ns(const ddp__flight_record *r, const ddp__flight_group *g) {
  int64_t from = r->started_ns >= 0 ? r->started_ns
                 : r->state == DDP__FLIGHT_ENQUEUED ? r->scheduled_ns : -1;
  if (from < 0) return 0;
  int64_t end = r->ended_ns >= 0 ? r->ended_ns : g->dump_ns;
  return end - from;
}

/* The program called it: an op queued on a device stream (enqueued) was
 * entered by its rank even if its kernels have not started. */
static bool entered(const ddp__flight_record *r) {
  return r->seq > 0 && (r->state == DDP__FLIGHT_STARTED || r->state == DDP__FLIGHT_COMPLETED ||
                        r->state == DDP__FLIGHT_FAILED || r->state == DDP__FLIGHT_ENQUEUED);
}

/* An engine on a device stream (NCCL) holds several collectives entered
 * at once, the newest queued behind the oldest: where such a rank stands
 * is its oldest collective not completed (the one its GPU waits in), not
 * the newest it handed over. Other ranks run one collective at a time, so
 * their newest is where they stand. */
static void view_of(const ddp__flight_group *g, rank_view *v) {
  v->group = g;
  v->last = v->p2p = NULL;
  const ddp__flight_record *oldest_open = NULL;
  bool queued_on_device = false;
  for (size_t i = 0; i < g->n; i++) {
    const ddp__flight_record *r = &g->records[i];
    if (!entered(r)) continue;
    if (is_p2p(r)) {
      if (r->state != DDP__FLIGHT_COMPLETED) v->p2p = r;
      continue;
    }
    if (!v->last || r->seq >= v->last->seq) v->last = r;
    queued_on_device = queued_on_device || r->state == DDP__FLIGHT_ENQUEUED;
    bool open = r->state == DDP__FLIGHT_STARTED || r->state == DDP__FLIGHT_ENQUEUED;
    if (open && (!oldest_open || r->seq < oldest_open->seq)) oldest_open = r;
  }
  if (queued_on_device && oldest_open) v->last = oldest_open;
}

/* Collectives that must agree across ranks: op, count, dtype, root, reduce op. */
static bool same_call(const ddp__flight_record *a, const ddp__flight_record *b) {
  return a->kind == b->kind && a->count == b->count && a->dtype == b->dtype && a->root == b->root &&
         a->reduce_op == b->reduce_op;
}

static void call_text(const ddp__flight_record *r, int32_t size, char *out, size_t bytes) {
  ddp__op_args a;
  memset(&a, 0, sizeof a);
  a.kind = (ddp__op_kind)r->kind;
  a.count = (size_t)r->count;
  a.dtype = (ddp_dtype)(r->dtype < 0 ? 0 : r->dtype);
  a.reduce_op = (ddp_reduce_op)(r->reduce_op < 0 ? 0 : r->reduce_op);
  a.root = r->root;
  ddp__op_describe(&a, size, out, bytes);
}

/* "; rank 1 was in recv #3 from rank 0 (...)": what `peer` was doing. */
static void peer_text(const rank_view *views, int32_t size, int32_t peer, char *out, size_t bytes) {
  char what[160];
  if (peer < 0 || peer >= size) {
    out[0] = '\0';
  } else if (!views[peer].group) {
    snprintf(out, bytes, "; no dump from rank %d", (int)peer);
  } else if (views[peer].p2p) {
    ddp__flight_describe(views[peer].p2p, what, sizeof what);
    snprintf(out, bytes, "; rank %d was in %s", (int)peer, what);
  } else if (views[peer].last && views[peer].last->state != DDP__FLIGHT_COMPLETED) {
    ddp__flight_describe(views[peer].last, what, sizeof what);
    snprintf(out, bytes, "; rank %d was in %s", (int)peer, what);
  } else {
    snprintf(out, bytes, "; rank %d was in no operation of this group", (int)peer);
  }
}

/* The findings for one group. `views` has `size` entries; `reported_absent`
 * marks group ranks already named as having no dump (the world's). Returns
 * how many lines it wrote. */
/* ---- One group's verdict, step by step ---------------------------------------- */

/* The ranks without a dump of this group into list[], and "no dump from
 * ranks 2, 5" into text ("" when none). *unnamed: some of them were not
 * named already (as the world's ranks, with why). Returns their count. */
static int32_t missing_ranks(const rank_view *views, int32_t size, const bool *reported_absent, int32_t *list,
                             char *text, size_t bytes, bool *unnamed) {
  int32_t n_missing = 0;
  *unnamed = false;
  for (int32_t r = 0; r < size; r++)
    if (!views[r].group) {
      list[n_missing++] = r;
      *unnamed = *unnamed || !(reported_absent && reported_absent[r]);
    }
  text[0] = '\0';
  if (n_missing) {
    char ranks[300];
    ddp__format_ranks(list, n_missing, MAX_LISTED, ranks, sizeof ranks);
    snprintf(text, bytes, "no dump from %s %s", n_missing == 1 ? "rank" : "ranks", ranks);
  }
  return n_missing;
}

/* Where the group stands: *top is the highest collective number any rank
 * entered, and the result the call most of the ranks there made (ties: the
 * lowest rank's); NULL when no rank recorded a collective. */
static const ddp__flight_record *reference_call(const rank_view *views, int32_t size, uint64_t *top) {
  *top = 0;
  for (int32_t r = 0; r < size; r++)
    if (views[r].last && views[r].last->seq > *top) *top = views[r].last->seq;
  const ddp__flight_record *ref = NULL;
  int ref_votes = 0;
  for (int32_t r = 0; r < size; r++) {
    const ddp__flight_record *a = views[r].last;
    if (!a || a->seq != *top) continue;
    int votes = 0;
    for (int32_t q = 0; q < size; q++)
      if (views[q].last && views[q].last->seq == *top && same_call(a, views[q].last)) votes++;
    if (votes > ref_votes) {
      ref = a;
      ref_votes = votes;
    }
  }
  return ref;
}

/* Mismatches: ranks that entered #top as another call than `ref`, one line
 * per other call. list and waiters: scratch of `size` entries. Returns the
 * lines written. */
static int report_mismatches(out_text *o, const rank_view *views, int32_t size, uint64_t top,
                             const ddp__flight_record *ref, int32_t *list, int32_t *waiters) {
  int lines = 0;
  char ref_call[160];
  call_text(ref, size, ref_call, sizeof ref_call);
  for (int32_t r = 0; r < size; r++) {
    const ddp__flight_record *a = views[r].last;
    if (!a || a->seq != top || same_call(a, ref)) continue;
    bool first_of_kind = true;
    for (int32_t q = 0; q < r; q++)
      if (views[q].last && views[q].last->seq == top && same_call(views[q].last, a)) first_of_kind = false;
    if (!first_of_kind) continue;
    int32_t n = 0, m = 0;
    for (int32_t q = 0; q < size; q++) {
      const ddp__flight_record *b = views[q].last;
      if (!b || b->seq != top) continue;
      if (same_call(b, a)) list[n++] = q;
      else if (same_call(b, ref)) waiters[m++] = q;
    }
    char odd[160], odd_ranks[320], ref_ranks[320];
    call_text(a, size, odd, sizeof odd);
    ranks_text(list, n, odd_ranks, sizeof odd_ranks);
    ranks_text(waiters, m, ref_ranks, sizeof ref_ranks);
    fprintf(o->f, "%scollective #%llu mismatch: %s called %s but %s called %s\n", o->prefix,
            (unsigned long long)top, odd_ranks, odd, ref_ranks, ref_call);
    lines++;
  }
  return lines;
}

/* The ranks that wait in #top (entered it as `ref` and did not complete
 * it) into waiters[], the longest wait into *longest_ns. Returns their
 * count. */
static int32_t waiting_ranks(const rank_view *views, int32_t size, uint64_t top, const ddp__flight_record *ref,
                             int32_t *waiters, int64_t *longest_ns) {
  int32_t n_wait = 0;
  *longest_ns = 0;
  for (int32_t r = 0; r < size; r++) {
    const ddp__flight_record *a = views[r].last;
    if (!a || a->seq != top || !same_call(a, ref) || a->state == DDP__FLIGHT_COMPLETED) continue;
    waiters[n_wait++] = r;
    int64_t w = waited_ns(a, views[r].group);
    if (w > *longest_ns) *longest_ns = w;
  }
  return n_wait;
}

/* Ranks behind: their last collective is older than #top (`what`). Grouped
 * by where they are, the furthest behind first, two lines per group. The
 * first group's line carries wait_text and missing_text when `append`
 * (nothing explained the group yet). list: scratch. Returns the lines
 * written. */
static int report_behind(out_text *o, const rank_view *views, int32_t size, uint64_t top, const char *what,
                         bool append, const char *wait_text, const char *missing_text, int32_t *list) {
  int lines = 0;
  char text[1024], ranks[320];
  bool *done = ddp_calloc((size_t)size, sizeof *done);
  for (int32_t r = 0; r < size && done; r++) {
    if (!views[r].group || done[r]) continue;
    const ddp__flight_record *a = views[r].last;
    uint64_t at = a ? a->seq : 0;
    if (at >= top) continue;
    int32_t n = 0;
    for (int32_t q = r; q < size; q++) {
      const ddp__flight_record *b = views[q].last;
      if (views[q].group && !done[q] && (b ? b->seq : 0) == at) {
        list[n++] = q;
        done[q] = true;
      }
    }
    ranks_text(list, n, ranks, sizeof ranks);
    int len = snprintf(text, sizeof text, "%s never entered %s", ranks, what);
    if (append && wait_text[0]) len += snprintf(text + len, sizeof text - (size_t)len, "; %s", wait_text);
    if (append && missing_text[0]) snprintf(text + len, sizeof text - (size_t)len, "; %s", missing_text);
    fprintf(o->f, "%s%s\n", o->prefix, text);
    lines++;
    char last[200];
    if (a) {
      ddp__flight_describe(a, last, sizeof last);
      fprintf(o->f, "%s  %s: last collective %s, %s\n", o->prefix, ranks, last, ddp__flight_state_name(a->state));
    } else {
      fprintf(o->f, "%s  %s: no collective recorded\n", o->prefix, ranks);
    }
    lines++;
    append = false;
  }
  ddp_free(done);
  return lines;
}

/* Every rank with a dump entered #top and some (wait_ranks) are still in
 * it: one line, with who completed it. list: scratch. */
static void report_still_waiting(out_text *o, const rank_view *views, int32_t size, uint64_t top,
                                 const ddp__flight_record *ref, const char *wait_ranks, const char *waited,
                                 const char *what, const char *missing_text, int32_t n_missing, int32_t *list) {
  char text[1024];
  int32_t n_done = 0;
  for (int32_t r = 0; r < size; r++)
    if (views[r].last && views[r].last->seq == top && same_call(views[r].last, ref) &&
        views[r].last->state == DDP__FLIGHT_COMPLETED)
      list[n_done++] = r;
  int len = snprintf(text, sizeof text, "%s waited %s in %s", wait_ranks, waited, what);
  if (missing_text[0]) len += snprintf(text + len, sizeof text - (size_t)len, "; %s", missing_text);
  if (n_done) {
    char done_ranks[320];
    ranks_text(list, n_done, done_ranks, sizeof done_ranks);
    snprintf(text + len, sizeof text - (size_t)len, "; %s completed it", done_ranks);
  } else if (!n_missing) {
    snprintf(text + len, sizeof text - (size_t)len, "; every rank entered it and none completed it");
  }
  fprintf(o->f, "%s%s\n", o->prefix, text);
}

/* The collectives' story: mismatches in #top, then the ranks behind it,
 * else the ranks still in it. Returns the lines written. */
static int report_collectives(out_text *o, const rank_view *views, int32_t size, uint64_t top,
                              const ddp__flight_record *ref, const char *missing_text, int32_t n_missing,
                              int32_t *list, int32_t *waiters) {
  int lines = report_mismatches(o, views, size, top, ref, list, waiters);
  int64_t longest = 0;
  int32_t n_wait = waiting_ranks(views, size, top, ref, waiters, &longest);
  char what[200], waited[32], wait_ranks[320] = "", wait_text[400] = "";
  ddp__flight_describe(ref, what, sizeof what);
  seconds_text(longest, waited, sizeof waited);
  if (n_wait) {
    ranks_text(waiters, n_wait, wait_ranks, sizeof wait_ranks);
    snprintf(wait_text, sizeof wait_text, "%s waited %s in it", wait_ranks, waited);
  }
  lines += report_behind(o, views, size, top, what, lines == 0, wait_text, missing_text, list);
  if (lines == 0 && n_wait) {
    report_still_waiting(o, views, size, top, ref, wait_ranks, waited, what, missing_text, n_missing, list);
    lines++;
  }
  return lines;
}

/* Point-to-point operations still running, with what their peer did.
 * Returns the lines written. */
static int report_p2p(out_text *o, const rank_view *views, int32_t size) {
  int lines = 0;
  for (int32_t r = 0; r < size; r++) {
    const ddp__flight_record *p = views[r].p2p;
    if (!p) continue;
    char peer[256], what[200], waited[32];
    ddp__flight_describe(p, what, sizeof what);
    seconds_text(waited_ns(p, views[r].group), waited, sizeof waited);
    peer_text(views, size, p->peer, peer, sizeof peer);
    fprintf(o->f, "%srank %d %s %s in %s%s\n", o->prefix, (int)r,
            p->state == DDP__FLIGHT_FAILED ? "gave up after" : "waited", waited, what, peer);
    lines++;
  }
  return lines;
}

static int judge_group(out_text *o, const char *name, int32_t size, rank_view *views, const bool *reported_absent,
                       bool quiet_when_fine) {
  int32_t *list = ddp_calloc((size_t)size, sizeof *list);
  int32_t *waiters = ddp_calloc((size_t)size, sizeof *waiters);
  if (!list || !waiters) {
    ddp_free(list);
    ddp_free(waiters);
    fprintf(o->f, "%sout of memory judging group %s\n", o->prefix, name);
    return 1;
  }
  char missing_text[320];
  bool unnamed;
  int32_t n_missing = missing_ranks(views, size, reported_absent, list, missing_text, sizeof missing_text, &unnamed);
  uint64_t top;
  const ddp__flight_record *ref = reference_call(views, size, &top);
  int lines = 0;
  if (ref) lines += report_collectives(o, views, size, top, ref, missing_text, n_missing, list, waiters);
  lines += report_p2p(o, views, size);
  /* Nothing explained: say who is missing, or that all is well. */
  if (lines == 0 && unnamed) {
    fprintf(o->f, "%s%s\n", o->prefix, missing_text);
    lines++;
  } else if (lines == 0 && !quiet_when_fine && ref) {
    char what[200];
    ddp__flight_describe(ref, what, sizeof what);
    fprintf(o->f, "%sno operation was pending: every rank with a dump completed %s\n", o->prefix, what);
    lines++;
  }
  ddp_free(list);
  ddp_free(waiters);
  return lines;
}

/* ---- All groups -------------------------------------------------------------- */

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A group made from the world's store directly ("pg/<n>/", not a
 * subgroup): its ranks are the processes' RANKs. */
static bool is_root_group(const char *name) { return strstr(name, "sub/") == NULL; }

ddp_status ddp__flight_verdict(const ddp__flight_dump *dumps, size_t n, int32_t world_size,
                               const char *const *why_absent, char **text) {
  *text = NULL;
  if (world_size < 0)
    for (size_t i = 0; i < n; i++)
      if (dumps[i].world_size > world_size) world_size = dumps[i].world_size;
  char *buf = NULL;
  size_t size = 0;
  FILE *f = open_memstream(&buf, &size);
  if (!f) return ddp_error(DDP_ERR_NOMEM, "flight recorder verdict: out of memory");
  /* The world's ranks without a dump. */
  bool *absent = world_size > 0 ? ddp_calloc((size_t)world_size, sizeof *absent) : NULL;
  for (int32_t r = 0; r < world_size && absent; r++) {
    bool have = false;
    for (size_t i = 0; i < n && !have; i++) have = dumps[i].rank == r;
    if (have) continue;
    absent[r] = true;
    const char *why = why_absent ? why_absent[r] : NULL;
    fprintf(f, "no dump from rank %d%s%s\n", (int)r, why && *why ? ": " : "", why && *why ? why : "");
  }
  /* Distinct group names, in order. */
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += dumps[i].n_groups;
  const char **names = total ? ddp_calloc(total, sizeof *names) : NULL;
  size_t n_names = 0;
  for (size_t i = 0; i < n && names; i++)
    for (size_t g = 0; g < dumps[i].n_groups; g++) {
      const char *name = dumps[i].groups[g].name;
      bool seen = false;
      for (size_t k = 0; k < n_names && !seen; k++) seen = strcmp(names[k], name) == 0;
      if (!seen) names[n_names++] = name;
    }
  if (n_names) qsort(names, n_names, sizeof *names, name_cmp);
  for (size_t k = 0; k < n_names; k++) {
    /* The group's size and each rank's newest entry. */
    int32_t gsize = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t g = 0; g < dumps[i].n_groups; g++)
        if (strcmp(dumps[i].groups[g].name, names[k]) == 0 && dumps[i].groups[g].size > gsize)
          gsize = dumps[i].groups[g].size;
    rank_view *views = gsize > 0 ? ddp_calloc((size_t)gsize, sizeof *views) : NULL;
    int64_t *when = gsize > 0 ? ddp_calloc((size_t)gsize, sizeof *when) : NULL;
    if (!views || !when) {
      ddp_free(views);
      ddp_free(when);
      continue;
    }
    for (size_t i = 0; i < n; i++)
      for (size_t g = 0; g < dumps[i].n_groups; g++) {
        const ddp__flight_group *gr = &dumps[i].groups[g];
        if (strcmp(gr->name, names[k]) != 0 || gr->rank < 0 || gr->rank >= gsize) continue;
        if (views[gr->rank].group && when[gr->rank] >= dumps[i].dump_unix_ns) continue;
        view_of(gr, &views[gr->rank]);
        when[gr->rank] = dumps[i].dump_unix_ns;
      }
    bool root = is_root_group(names[k]) && gsize == world_size;
    char prefix[DDP__FLIGHT_NAME_BYTES + 16] = "";
    if (n_names > 1) snprintf(prefix, sizeof prefix, "group %s: ", names[k]);
    out_text o = {f, prefix};
    /* Subgroups speak only when something is wrong in them. */
    judge_group(&o, names[k], gsize, views, root ? absent : NULL, !root);
    ddp_free(views);
    ddp_free(when);
  }
  ddp_free(names);
  ddp_free(absent);
  if (fclose(f) != 0 || !buf) {
    free(buf);
    return ddp_error(DDP_ERR_NOMEM, "flight recorder verdict: out of memory");
  }
  char *out = ddp_alloc(size + 1);
  if (!out) {
    free(buf);
    return ddp_error(DDP_ERR_NOMEM, "flight recorder verdict: out of memory");
  }
  memcpy(out, buf, size + 1);
  free(buf);
  *text = out;
  return DDP_OK;
}
