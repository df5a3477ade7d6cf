/* libFuzzer target for the store server's message parser: feeds arbitrary
 * bytes through ddp__store_parse_request exactly as the server reads a
 * client's stream (frame after frame until one is incomplete or refused),
 * checks what a parsed request promises, and applies the writes to a table as
 * the server would, so the operations' semantics are fuzzed too.
 *
 * Build and run: scripts/fuzz.sh [seconds] (clang, -fsanitize=fuzzer,address).
 * The same function runs without libFuzzer in tests/store/test_store_protocol.c
 * over the seed corpus (fuzz/corpus/store_protocol/). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "store/protocol.h"
#include "store/table.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)       \
  do {                    \
    if (!(cond)) abort(); \
  } while (0)

static void check_key(const ddp__slice *k, const ddp_store_limits *lim, const uint8_t *buf,
                      size_t len) {
  CHECK(k->len >= 1 && k->len <= lim->max_key_bytes);
  CHECK(k->data >= buf && k->data + k->len <= buf + len);
  CHECK(memchr(k->data, 0, k->len) == NULL);
}

static void check_value(const ddp__slice *v, const ddp_store_limits *lim, const uint8_t *buf,
                        size_t len) {
  CHECK(v->len <= lim->max_value_bytes);
  CHECK(v->len == 0 || (v->data >= buf && v->data + v->len <= buf + len));
}

/* Applies a parsed request to the table, as the server's handler does. */
static void apply(ddp__kv_table *t, const ddp__store_request *r) {
  const char *key = (const char *)r->key.data;
  const uint8_t *res;
  size_t res_len;
  int64_t sum;
  int deleted;
  switch (r->op) {
    case DDP__OP_SET: ddp__kv_set(t, key, r->key.len, r->value.data, r->value.len, NULL); break;
    case DDP__OP_APPEND:
      ddp__kv_append(t, key, r->key.len, r->value.data, r->value.len, NULL);
      break;
    case DDP__OP_ADD: ddp__kv_add(t, key, r->key.len, r->integer, &sum, NULL); break;
    case DDP__OP_COMPARE_SET:
      if (ddp__kv_compare_set(t, key, r->key.len, r->value.data, r->value.len, r->desired.data,
                              r->desired.len, &res, &res_len, NULL) == DDP_OK)
        CHECK(res_len == 0 || res != NULL);
      break;
    case DDP__OP_DELETE: ddp__kv_delete(t, key, r->key.len, &deleted); break;
    case DDP__OP_MULTI_SET:
      for (uint32_t i = 0; i < r->num_keys; i++)
        ddp__kv_set(t, (const char *)r->keys[i].data, r->keys[i].len, r->values[i].data,
                    r->values[i].len, NULL);
      break;
    case DDP__OP_NUM_KEYS:
    case DDP__OP_LIST_KEYS: CHECK(ddp__kv_count_prefix(t, key, r->key.len) <= t->num_values); break;
    default: break;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The first byte picks small or default limits, so both the "over the
   * limit" paths and large inputs are reached. */
  ddp_store_limits in = {0};
  if (size > 0 && (data[0] & 1)) {
    in.max_key_bytes = 8;
    in.max_value_bytes = 64;
    in.max_message_bytes = 256;
    in.max_keys_per_call = 4;
  }
  ddp_store_limits lim;
  ddp__store_limits_resolve(&in, &lim);
  ddp__kv_table table;
  ddp__kv_init(&table, 1 << 20);
  size_t off = size > 0 ? 1 : 0;
  while (off < size) {
    ddp__store_request req;
    size_t used = 0;
    uint8_t status = 0;
    char err[128];
    ddp__parse_result r = ddp__store_parse_request(data + off, size - off, &lim, &req, &used,
                                                   &status, err, sizeof err);
    if (r == DDP__PARSE_MORE) break;
    if (r == DDP__PARSE_ERROR) {
      CHECK(status != DDP__WIRE_OK);
      CHECK(err[0] != '\0');
      CHECK(req.keys == NULL && req.values == NULL);
      break;
    }
    CHECK(used >= DDP__STORE_FRAME_HEADER + 1 && used <= size - off);
    CHECK(used - DDP__STORE_FRAME_HEADER <= lim.max_message_bytes);
    const uint8_t *frame = data + off;
    switch (req.op) {
      case DDP__OP_SET:
      case DDP__OP_APPEND:
      case DDP__OP_GET:
      case DDP__OP_ADD:
      case DDP__OP_DELETE:
        check_key(&req.key, &lim, frame, used);
        check_value(&req.value, &lim, frame, used);
        break;
      case DDP__OP_COMPARE_SET:
        check_key(&req.key, &lim, frame, used);
        check_value(&req.value, &lim, frame, used);
        check_value(&req.desired, &lim, frame, used);
        break;
      case DDP__OP_WAIT:
      case DDP__OP_CHECK:
      case DDP__OP_MULTI_GET:
      case DDP__OP_MULTI_SET:
      case DDP__OP_WATCH:
        CHECK(req.num_keys <= lim.max_keys_per_call);
        for (uint32_t i = 0; i < req.num_keys; i++) {
          check_key(&req.keys[i], &lim, frame, used);
          if (req.op == DDP__OP_MULTI_SET) check_value(&req.values[i], &lim, frame, used);
        }
        break;
      case DDP__OP_HELLO: CHECK(req.key.len <= DDP_STORE_MAX_TOKEN_BYTES); break;
      case DDP__OP_NUM_KEYS:
      case DDP__OP_LIST_KEYS: CHECK(req.key.len <= lim.max_key_bytes); break;
      case DDP__OP_PING: break;
      default: CHECK(0 && "parser accepted an unknown opcode");
    }
    apply(&table, &req);
    ddp__store_request_free(&req);
    off += used;
  }
  /* The table's accounting must add up. */
  uint64_t bytes = 0;
  size_t values = 0, b = 0;
  for (ddp__kv_entry *e = ddp__kv_next(&table, &b, NULL); e; e = ddp__kv_next(&table, &b, e))
    if (e->has_value) {
      bytes += e->key_len + e->value_len;
      values++;
    }
  CHECK(bytes == table.bytes && values == table.num_values);
  ddp__kv_free(&table);
  return 0;
}
