/* core's internal helpers for the layers above (its one internal header for
 * them; docs/architecture.md): small text helpers that several layers'
 * messages and parsers share. Not installed. */
#ifndef DDP_CORE_INTERNAL_H
#define DDP_CORE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes ranks as compact ranges ("2, 5-7, 9"), at most `max_items` items and
 * then "... (N more)". out (bytes > 0) is always terminated; a list too long
 * for it is cut at an item. */
void ddp__format_ranks(const int32_t *ranks, int32_t count, int max_items, char *out,
                       size_t bytes);

/* Parses s[0..len), all decimal digits (no sign, no spaces, at most 18), into
 * *out when the value lies in [lo, hi]; returns 0, else -1 with *out
 * untouched. */
int ddp__parse_decimal(const char *s, size_t len, int64_t lo, int64_t hi, int64_t *out);

#ifdef __cplusplus
}
#endif
#endif /* DDP_CORE_INTERNAL_H */
