/* Small text helpers the layers above share (core/core_internal.h): the
 * compact rank lists of error messages and strict decimal parsing. */
#include <stdio.h>

#include "core/core_internal.h"

int ddp__parse_decimal(const char *s, size_t len, int64_t lo, int64_t hi, int64_t *out) {
  if (len == 0 || len > 18) return -1;
  int64_t v = 0;
  for (size_t i = 0; i < len; i++) {
    if (s[i] < '0' || s[i] > '9') return -1;
    v = v * 10 + (s[i] - '0');
  }
  if (v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

void ddp__format_ranks(const int32_t *ranks, int32_t count, int max_items, char *out,
                       size_t bytes) {
  size_t len = 0;
  int items = 0;
  out[0] = '\0';
  for (int32_t i = 0; i < count;) {
    int32_t j = i;
    while (j + 1 < count && ranks[j + 1] == ranks[j] + 1) j++;
    if (items == max_items) {
      snprintf(out + len, bytes - len, ", ... (%d more)", (int)(count - i));
      return;
    }
    int n;
    const char *sep = items ? ", " : "";
    if (j == i)
      n = snprintf(out + len, bytes - len, "%s%d", sep, (int)ranks[i]);
    else
      n = snprintf(out + len, bytes - len, "%s%d-%d", sep, (int)ranks[i], (int)ranks[j]);
    if (n < 0 || (size_t)n >= bytes - len) return; /* truncated: out stays terminated */
    len += (size_t)n;
    items++;
    i = j + 1;
  }
}
