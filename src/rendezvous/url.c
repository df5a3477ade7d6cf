/* Init URLs: env://, tcp://host:port and file:///abs/path, each with an
 * optional ?rank=&world_size= query, parsed strictly so that a typo is an error
 * that quotes the URL rather than a hang on the wrong address. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/core_internal.h"
#include "net/net.h"
#include "rendezvous/rdzv_internal.h"

#define EXPECTED "expected env://, tcp:// or file://"

/* Parses "rank=1&world_size=4" into out->rank / out->world_size. */
static ddp_status parse_query(const char *url, const char *q, ddp__rdzv_url *out) {
  if (*q == '\0') return DDP_OK;
  while (*q) {
    const char *amp = strchr(q, '&');
    size_t len = amp ? (size_t)(amp - q) : strlen(q);
    const char *eq = memchr(q, '=', len);
    if (!eq)
      return ddp_error(DDP_ERR_INVALID, "init url '%s': query item '%.*s' is not key=value", url,
                       (int)len, q);
    size_t klen = (size_t)(eq - q);
    const char *val = eq + 1;
    size_t vlen = len - klen - 1;
    int32_t *slot;
    int64_t lo;
    if (klen == 4 && memcmp(q, "rank", 4) == 0) {
      slot = &out->rank;
      lo = 0;
    } else if (klen == 10 && memcmp(q, "world_size", 10) == 0) {
      slot = &out->world_size;
      lo = 1;
    } else {
      return ddp_error(DDP_ERR_INVALID,
                       "init url '%s': unknown query parameter '%.*s' (expected rank and world_size)",
                       url, (int)klen, q);
    }
    if (*slot != -1)
      return ddp_error(DDP_ERR_INVALID, "init url '%s': '%.*s' is given twice", url, (int)klen, q);
    int64_t v;
    if (ddp__parse_decimal(val, vlen, lo, INT32_MAX, &v) != 0)
      return ddp_error(DDP_ERR_INVALID, "init url '%s': %.*s='%.*s' is not an integer >= %d", url,
                       (int)klen, q, (int)vlen, val, (int)lo);
    *slot = (int32_t)v;
    if (!amp) break;
    q = amp + 1;
    if (*q == '\0')
      return ddp_error(DDP_ERR_INVALID, "init url '%s': query ends with '&'", url);
  }
  return DDP_OK;
}

ddp_status ddp__rdzv_url_parse(const char *url, ddp__rdzv_url *out) {
  memset(out, 0, sizeof *out);
  out->rank = -1;
  out->world_size = -1;
  if (!url || !*url) url = "env://";
  const char *sep = strstr(url, "://");
  if (!sep) return ddp_error(DDP_ERR_INVALID, "init url '%s': missing scheme (" EXPECTED ")", url);
  size_t slen = (size_t)(sep - url);
  const char *rest = sep + 3;
  char body[DDP__RDZV_PATH_MAX + 64];
  const char *qmark = strchr(rest, '?');
  size_t blen = qmark ? (size_t)(qmark - rest) : strlen(rest);
  if (blen >= sizeof body) return ddp_error(DDP_ERR_INVALID, "init url '%.64s...': too long", url);
  memcpy(body, rest, blen);
  body[blen] = '\0';
  if (strchr(body, '#'))
    return ddp_error(DDP_ERR_INVALID, "init url '%s': fragments ('#') are not allowed", url);

  if (slen == 3 && memcmp(url, "env", 3) == 0) {
    out->scheme = DDP__RDZV_ENV;
    if (body[0] != '\0')
      return ddp_error(DDP_ERR_INVALID,
                       "init url '%s': env:// takes no host or path (the address comes from "
                       "MASTER_ADDR and MASTER_PORT)",
                       url);
  } else if (slen == 3 && memcmp(url, "tcp", 3) == 0) {
    out->scheme = DDP__RDZV_TCP;
    size_t n = strlen(body);
    if (n > 0 && body[n - 1] == '/') body[--n] = '\0'; /* tolerate "tcp://h:p/" */
    if (n == 0)
      return ddp_error(DDP_ERR_INVALID, "init url '%s': tcp:// needs host:port", url);
    if (strchr(body, '/'))
      return ddp_error(DDP_ERR_INVALID, "init url '%s': tcp:// takes host:port and no path", url);
    if (strchr(body, '@'))
      return ddp_error(DDP_ERR_INVALID, "init url '%s': user names ('@') are not supported", url);
    char what[DDP__RDZV_PATH_MAX + 96];
    snprintf(what, sizeof what, "init url '%s'", url);
    DDP_TRY(ddp__net_split_hostport(what, body, out->host, sizeof out->host, &out->port));
  } else if (slen == 4 && memcmp(url, "file", 4) == 0) {
    out->scheme = DDP__RDZV_FILE;
    if (body[0] != '/')
      return ddp_error(DDP_ERR_INVALID,
                       "init url '%s': file:// names a path on a shared filesystem and takes no "
                       "host; write file:///absolute/path",
                       url);
    size_t n = strlen(body);
    if (n == 1 || body[n - 1] == '/')
      return ddp_error(DDP_ERR_INVALID, "init url '%s': the path names a directory, not a file",
                       url);
    if (n >= sizeof out->path)
      return ddp_error(DDP_ERR_INVALID, "init url '%.64s...': path too long", url);
    memcpy(out->path, body, n + 1);
  } else {
    return ddp_error(DDP_ERR_INVALID, "init url '%s': unknown scheme '%.*s' (" EXPECTED ")", url,
                     (int)slen, url);
  }
  if (qmark) return parse_query(url, qmark + 1, out);
  return DDP_OK;
}
