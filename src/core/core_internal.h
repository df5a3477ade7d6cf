/* core's internal helpers for the layers above (its one internal header for
 * them; docs/architecture.md): small text helpers that several layers'
 * messages and parsers share, and the MT19937 generator. Not installed. */
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

/* Writes all len bytes to fd (short writes and EINTR handled; blocking fds).
 * 0, or -1 with errno set (EIO when write(2) makes no progress). */
int ddp__write_all(int fd, const void *buf, size_t len);

/* ---- MT19937 (mt19937.c) ----------------------------------------------------
 * The generator's state is 624 words and the index of the next word to read
 * (624: the next read twists first). Two seedings, as published:
 * init_genrand (one 32-bit word: PyTorch's manual_seed) and init_by_array
 * (a key of words: CPython's random.seed). Both set *index. */
#define DDP__MT19937_N 624
void ddp__mt19937_init_genrand(uint32_t state[DDP__MT19937_N], int *index, uint32_t seed);
void ddp__mt19937_init_by_array(uint32_t state[DDP__MT19937_N], int *index, const uint32_t *key, size_t len);
/* The next tempered 32-bit output. */
uint32_t ddp__mt19937_next(uint32_t state[DDP__MT19937_N], int *index);
/* Advances by `count` outputs, as if next were called that often. */
void ddp__mt19937_discard(uint32_t state[DDP__MT19937_N], int *index, uint64_t count);

#ifdef __cplusplus
}
#endif
#endif /* DDP_CORE_INTERNAL_H */
