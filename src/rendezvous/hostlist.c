/* Slurm hostlists ("node[01-04,07]", "rack[1-2]-node[1-2]") expanded into host
 * names, as `scontrol show hostnames` does, and Slurm's tasks-per-node lists
 * ("2(x3),1"). Rank 0's host under Slurm is the first name of the list. */
#include <stdio.h>
#include <string.h>

#include "rendezvous/rdzv_internal.h"

#define MAX_HOSTS (1u << 20)
#define MAX_GROUPS 8   /* bracket groups in one name */
#define MAX_RANGES 256 /* ranges in one bracket group */
#define MAX_DIGITS 18

typedef struct range {
  uint64_t lo, hi;
  int width; /* digits of the lower bound: the zero padding to keep */
} range;

typedef struct group {
  size_t prefix_off, prefix_len; /* literal text before the '[' (offsets into the list) */
  range ranges[MAX_RANGES];
  int num_ranges;
  uint64_t count;
} group;

typedef struct item {
  group groups[MAX_GROUPS];
  int num_groups;
  size_t tail_off, tail_len; /* literal text after the last ']' */
} item;

/* Output of an expansion pass: with names == NULL it only counts. */
typedef struct sink {
  size_t count;
  size_t bytes; /* string bytes, NULs included */
  char **names;
  char *strings;
} sink;

static ddp_status bad(const char *list, size_t off, const char *what) {
  return ddp_error(DDP_ERR_INVALID, "hostlist '%s': %s at offset %zu", list, what, off);
}

static int is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.';
}

/* Parses a number of up to MAX_DIGITS digits at list[*pos]. */
static ddp_status parse_number(const char *list, size_t *pos, uint64_t *value, int *width) {
  size_t start = *pos;
  uint64_t v = 0;
  while (list[*pos] >= '0' && list[*pos] <= '9') {
    if (*pos - start >= MAX_DIGITS) return bad(list, start, "number too long");
    v = v * 10 + (uint64_t)(list[*pos] - '0');
    (*pos)++;
  }
  if (*pos == start) return bad(list, start, "expected a number in brackets");
  *value = v;
  *width = (int)(*pos - start);
  return DDP_OK;
}

/* Parses "01-04,07]" (the part after '[') into g; *pos ends after ']'. */
static ddp_status parse_group(const char *list, size_t *pos, group *g) {
  g->num_ranges = 0;
  g->count = 0;
  for (;;) {
    if (g->num_ranges == MAX_RANGES) return bad(list, *pos, "too many ranges in one bracket");
    range *r = &g->ranges[g->num_ranges++];
    int hi_width;
    DDP_TRY(parse_number(list, pos, &r->lo, &r->width));
    r->hi = r->lo;
    if (list[*pos] == '-') {
      (*pos)++;
      size_t hi_at = *pos;
      DDP_TRY(parse_number(list, pos, &r->hi, &hi_width));
      if (r->hi < r->lo) {
        char msg[96];
        snprintf(msg, sizeof msg, "descending range %llu-%llu", (unsigned long long)r->lo,
                 (unsigned long long)r->hi);
        return bad(list, hi_at, msg);
      }
    }
    g->count += r->hi - r->lo + 1;
    if (g->count > MAX_HOSTS)
      return ddp_error(DDP_ERR_RANGE, "hostlist '%s': more than %u hosts", list, MAX_HOSTS);
    char c = list[*pos];
    if (c == ',') {
      (*pos)++;
      continue;
    }
    if (c == ']') {
      (*pos)++;
      return DDP_OK;
    }
    if (c == '\0') return bad(list, *pos, "unclosed '['");
    if (c == '[') return bad(list, *pos, "nested '['");
    return bad(list, *pos, "expected ',', '-' or ']' in brackets");
  }
}

/* Parses one name pattern starting at list[*pos], up to a top-level ',' or
 * the end. */
static ddp_status parse_item(const char *list, size_t *pos, item *it) {
  it->num_groups = 0;
  size_t lit_start = *pos;
  for (;;) {
    char c = list[*pos];
    if (c == '\0' || c == ',') break;
    if (c == '[') {
      if (it->num_groups == MAX_GROUPS) return bad(list, *pos, "too many bracket groups in one name");
      group *g = &it->groups[it->num_groups++];
      g->prefix_off = lit_start;
      g->prefix_len = *pos - lit_start;
      (*pos)++;
      DDP_TRY(parse_group(list, pos, g));
      lit_start = *pos;
      continue;
    }
    if (c == ']') return bad(list, *pos, "']' without '['");
    if (!is_name_char(c)) {
      char msg[64];
      snprintf(msg, sizeof msg, "unexpected character '%c'", c);
      return bad(list, *pos, msg);
    }
    (*pos)++;
  }
  it->tail_off = lit_start;
  it->tail_len = *pos - lit_start;
  if (it->num_groups == 0 && it->tail_len == 0) return bad(list, *pos, "empty host name");
  return DDP_OK;
}

/* The index-th value of g (0 <= index < g->count), with its padding. */
static void group_value(const group *g, uint64_t index, uint64_t *value, int *width) {
  for (int i = 0; i < g->num_ranges; i++) {
    uint64_t n = g->ranges[i].hi - g->ranges[i].lo + 1;
    if (index < n) {
      *value = g->ranges[i].lo + index;
      *width = g->ranges[i].width;
      return;
    }
    index -= n;
  }
  DDP_ASSERT(0);
}

/* Emits every name of it into s (counting only when s->names is NULL). */
static ddp_status expand_item(const char *list, const item *it, sink *s) {
  uint64_t total = 1;
  for (int i = 0; i < it->num_groups; i++) {
    total *= it->groups[i].count;
    if (total > MAX_HOSTS) break;
  }
  if (s->count + total > MAX_HOSTS)
    return ddp_error(DDP_ERR_RANGE, "hostlist '%s': more than %u hosts", list, MAX_HOSTS);
  uint64_t idx[MAX_GROUPS] = {0}; /* odometer: the last group varies fastest */
  for (uint64_t n = 0; n < total; n++) {
    char name[1024];
    size_t len = 0;
    for (int i = 0; i < it->num_groups; i++) {
      const group *g = &it->groups[i];
      uint64_t v;
      int width;
      group_value(g, idx[i], &v, &width);
      int w = snprintf(name + len, sizeof name - len, "%.*s%0*llu", (int)g->prefix_len,
                       list + g->prefix_off, width, (unsigned long long)v);
      if (w < 0 || (size_t)w >= sizeof name - len)
        return ddp_error(DDP_ERR_RANGE, "hostlist '%s': a host name is too long", list);
      len += (size_t)w;
    }
    if (len + it->tail_len >= sizeof name)
      return ddp_error(DDP_ERR_RANGE, "hostlist '%s': a host name is too long", list);
    memcpy(name + len, list + it->tail_off, it->tail_len);
    len += it->tail_len;
    name[len] = '\0';
    if (s->names) {
      char *dst = s->strings + s->bytes;
      memcpy(dst, name, len + 1);
      s->names[s->count] = dst;
    }
    s->count++;
    s->bytes += len + 1;
    for (int i = it->num_groups - 1; i >= 0; i--) {
      if (++idx[i] < it->groups[i].count) break;
      idx[i] = 0;
    }
  }
  return DDP_OK;
}

static ddp_status expand(const char *list, sink *s, item *it) {
  size_t pos = 0;
  for (;;) {
    DDP_TRY(parse_item(list, &pos, it));
    DDP_TRY(expand_item(list, it, s));
    if (list[pos] == '\0') return DDP_OK;
    pos++; /* the ',' */
    if (list[pos] == '\0') return bad(list, pos, "trailing ','");
  }
}

ddp_status ddp_hostlist_expand(const char *list, char ***hosts, size_t *count) {
  *hosts = NULL;
  *count = 0;
  if (!list || !*list) return ddp_error(DDP_ERR_INVALID, "hostlist is empty");
  item *it = ddp_alloc(sizeof *it);
  if (!it) return ddp_error(DDP_ERR_NOMEM, "hostlist: out of memory");
  sink s = {0};
  ddp_status st = expand(list, &s, it);
  if (st == DDP_OK) {
    size_t header = s.count * sizeof(char *);
    char *block = ddp_alloc(header + s.bytes);
    if (!block) {
      st = ddp_error(DDP_ERR_NOMEM, "hostlist '%s': out of memory for %zu hosts", list, s.count);
    } else {
      sink out = {0, 0, (char **)(void *)block, block + header};
      st = expand(list, &out, it);
      DDP_ASSERT(st == DDP_OK && out.count == s.count);
      *hosts = out.names;
      *count = out.count;
    }
  }
  ddp_free(it);
  return st;
}

ddp_status ddp__slurm_tasks_per_node(const char *list, int64_t node_index, int32_t *out) {
  /* "2(x3),1": three nodes with 2 tasks, then one with 1. */
  const char *p = list;
  int64_t node = 0;
  if (!*p) return ddp_error(DDP_ERR_INVALID, "tasks-per-node list is empty");
  for (;;) {
    uint64_t tasks, repeat = 1;
    int width;
    size_t pos = (size_t)(p - list);
    ddp_status st = parse_number(list, &pos, &tasks, &width);
    if (st || tasks == 0 || tasks > INT32_MAX)
      return ddp_error(DDP_ERR_INVALID,
                       "tasks-per-node list '%s': expected a positive count at offset %zu", list,
                       (size_t)(p - list));
    p = list + pos;
    if (p[0] == '(') {
      if (p[1] != 'x')
        return ddp_error(DDP_ERR_INVALID, "tasks-per-node list '%s': expected '(xN)' at offset %zu",
                         list, (size_t)(p - list));
      pos += 2;
      st = parse_number(list, &pos, &repeat, &width);
      if (st || repeat == 0 || list[pos] != ')')
        return ddp_error(DDP_ERR_INVALID, "tasks-per-node list '%s': expected '(xN)' at offset %zu",
                         list, (size_t)(p - list));
      p = list + pos + 1;
    }
    if (node_index < node + (int64_t)repeat) {
      *out = (int32_t)tasks;
      return DDP_OK;
    }
    node += (int64_t)repeat;
    if (*p == '\0') break;
    if (*p != ',')
      return ddp_error(DDP_ERR_INVALID, "tasks-per-node list '%s': unexpected '%c' at offset %zu",
                       list, *p, (size_t)(p - list));
    p++;
  }
  return ddp_error(DDP_ERR_RANGE, "tasks-per-node list '%s' covers %lld nodes; node %lld is not in it",
                   list, (long long)node, (long long)node_index);
}
