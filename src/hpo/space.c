/* Search spaces: parsing "name=kind:args,..." into traits, and formatting
 * an individual's values. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpo/hpo_internal.h"

struct ddp_hpo_space {
  int n;
  ddp_hpo_trait *traits;
  char *text;        /* the names and choices point into this copy of the spec */
  const char **names_of_choices; /* every trait's choices, back to back */
  int *sorted;       /* trait indices by name */
  int *intervals;    /* FLOAT and LOGFLOAT traits, in order */
  int n_intervals;
};

int ddp_hpo_space_size(const ddp_hpo_space *s) { return s->n; }
const ddp_hpo_trait *ddp_hpo_space_trait(const ddp_hpo_space *s, int i) { return &s->traits[i]; }
const int *ddp__hpo_space_sorted(const ddp_hpo_space *s) { return s->sorted; }
const int *ddp__hpo_space_intervals(const ddp_hpo_space *s, int *count) {
  *count = s->n_intervals;
  return s->intervals;
}

int ddp_hpo_space_find(const ddp_hpo_space *s, const char *name) {
  for (int i = 0; i < s->n; i++)
    if (!strcmp(s->traits[i].name, name)) return i;
  return -1;
}

void ddp_hpo_space_destroy(ddp_hpo_space *s) {
  if (!s) return;
  ddp_free(s->traits);
  ddp_free(s->text);
  ddp_free(s->names_of_choices);
  ddp_free(s->sorted);
  ddp_free(s->intervals);
  ddp_free(s);
}

static bool parse_number(const char *text, double *out) {
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (errno || end == text || *end || !isfinite(v)) return false;
  *out = v;
  return true;
}

static bool parse_integer(const char *text, double *out) {
  char *end;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (errno || end == text || *end || llabs(v) > (1LL << 53)) return false;
  *out = (double)v;
  return true;
}

/* One "name=kind:args" in place (the text is ours to cut). */
static ddp_status parse_trait(char *item, ddp_hpo_trait *t, const char **choices, int *n_choices) {
  char *eq = strchr(item, '=');
  if (!eq || eq == item)
    return ddp_error(DDP_ERR_INVALID, "search space: '%s' is not name=kind:args", item);
  *eq = '\0';
  t->name = item;
  char *kind = eq + 1, *args = strchr(kind, ':');
  if (!args) return ddp_error(DDP_ERR_INVALID, "%s: '%s' has no ':' after the kind", item, kind);
  *args++ = '\0';
  if (!strcmp(kind, "cat") || !strcmp(kind, "categorical")) {
    t->kind = DDP_HPO_CATEGORICAL;
    t->choices = choices;
    for (char *c = args;;) {
      char *bar = strchr(c, '|');
      if (bar) *bar = '\0';
      if (!*c) return ddp_error(DDP_ERR_INVALID, "%s: an empty choice", item);
      for (int k = 0; k < t->n_choices; k++)
        if (!strcmp(choices[k], c)) return ddp_error(DDP_ERR_INVALID, "%s: '%s' twice", item, c);
      choices[t->n_choices++] = c;
      if (!bar) break;
      c = bar + 1;
    }
    *n_choices += t->n_choices;
    return DDP_OK;
  }
  char *colon = strchr(args, ':');
  if (!colon) return ddp_error(DDP_ERR_INVALID, "%s: %s needs LO:HI, got '%s'", item, kind, args);
  *colon = '\0';
  const char *lo = args, *hi = colon + 1;
  double a, b;
  if (!strcmp(kind, "int")) {
    t->kind = DDP_HPO_INT;
    if (!parse_integer(lo, &a) || !parse_integer(hi, &b))
      return ddp_error(DDP_ERR_INVALID, "%s: int bounds must be integers, got '%s' and '%s'", item,
                       lo, hi);
  } else if (!strcmp(kind, "float") || !strcmp(kind, "logfloat")) {
    t->kind = kind[0] == 'l' ? DDP_HPO_LOGFLOAT : DDP_HPO_FLOAT;
    if (!parse_number(lo, &a) || !parse_number(hi, &b))
      return ddp_error(DDP_ERR_INVALID, "%s: %s bounds must be numbers, got '%s' and '%s'", item,
                       kind, lo, hi);
    if (t->kind == DDP_HPO_LOGFLOAT && (a <= 0 || b <= 0))
      return ddp_error(DDP_ERR_INVALID, "%s: logfloat needs bounds > 0, got %g and %g", item, a, b);
  } else {
    return ddp_error(DDP_ERR_INVALID, "%s: unknown kind '%s' (int, float, logfloat or cat)", item,
                     kind);
  }
  t->lo = a < b ? a : b; /* either order */
  t->hi = a < b ? b : a;
  if (t->lo == t->hi)
    return ddp_error(DDP_ERR_INVALID, "%s: the bounds are equal (%g): nothing to search", item, a);
  return DDP_OK;
}


ddp_status ddp_hpo_space_parse(const char *spec, ddp_hpo_space **out) {
  if (!spec || !out) return ddp_error(DDP_ERR_INVALID, "ddp_hpo_space_parse: spec or out is NULL");
  *out = NULL;
  ddp_hpo_space *s = ddp_calloc(1, sizeof *s);
  size_t len = strlen(spec);
  if (!s || !(s->text = ddp_alloc(len + 1))) {
    ddp_free(s);
    return ddp_error(DDP_ERR_NOMEM, "search space: out of memory");
  }
  memcpy(s->text, spec, len + 1);
  int items = 1;
  for (const char *p = spec; *p; p++) items += *p == ',' || *p == '|';
  s->traits = ddp_calloc((size_t)items, sizeof *s->traits);
  s->names_of_choices = ddp_calloc((size_t)items, sizeof *s->names_of_choices);
  s->sorted = ddp_calloc((size_t)items, sizeof *s->sorted);
  s->intervals = ddp_calloc((size_t)items, sizeof *s->intervals);
  ddp_status st = DDP_OK;
  if (!s->traits || !s->names_of_choices || !s->sorted || !s->intervals)
    st = ddp_error(DDP_ERR_NOMEM, "search space: out of memory");
  int n_choices = 0;
  for (char *item = s->text; st == DDP_OK && item;) {
    char *comma = strchr(item, ',');
    if (comma) *comma = '\0';
    if (!*item) {
      st = ddp_error(DDP_ERR_INVALID, "search space '%s': an empty trait", spec);
      break;
    }
    ddp_hpo_trait *t = &s->traits[s->n];
    st = parse_trait(item, t, s->names_of_choices + n_choices, &n_choices);
    if (st == DDP_OK && ddp_hpo_space_find(s, t->name) >= 0)
      st = ddp_error(DDP_ERR_INVALID, "search space: trait '%s' twice", t->name);
    if (st == DDP_OK) s->n++;
    item = comma ? comma + 1 : NULL;
  }
  if (st != DDP_OK) {
    ddp_hpo_space_destroy(s);
    return st;
  }
  for (int i = 0; i < s->n; i++) {
    s->sorted[i] = i;
    if (s->traits[i].kind == DDP_HPO_FLOAT || s->traits[i].kind == DDP_HPO_LOGFLOAT)
      s->intervals[s->n_intervals++] = i;
  }
  /* By name, as Python's sorted() orders str keys (code points: bytes for
   * UTF-8); insertion sort, the traits are few. */
  for (int i = 1; i < s->n; i++)
    for (int j = i; j > 0 && strcmp(s->traits[s->sorted[j - 1]].name,
                                    s->traits[s->sorted[j]].name) > 0; j--) {
      int x = s->sorted[j];
      s->sorted[j] = s->sorted[j - 1];
      s->sorted[j - 1] = x;
    }
  *out = s;
  return DDP_OK;
}

void ddp_hpo_format(const ddp_hpo_space *s, const double *values, char *buf, size_t bytes) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < s->n && at < bytes; i++) {
    const ddp_hpo_trait *t = &s->traits[i];
    int w;
    if (t->kind == DDP_HPO_CATEGORICAL)
      w = snprintf(buf + at, bytes - at, "%s%s=%s", i ? " " : "", t->name,
                   t->choices[(int)values[i]]);
    else if (t->kind == DDP_HPO_INT)
      w = snprintf(buf + at, bytes - at, "%s%s=%lld", i ? " " : "", t->name, (long long)values[i]);
    else
      w = snprintf(buf + at, bytes - at, "%s%s=%.6g", i ? " " : "", t->name, values[i]);
    if (w < 0) break;
    at += (size_t)w;
  }
}
