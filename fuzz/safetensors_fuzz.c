/* libFuzzer target: the safetensors reader (header length, the JSON parser,
 * entry validation, tiling) on arbitrary bytes. Any input must give DDP_OK
 * or an error, never a crash, a hang or a read outside the image; an
 * accepted file's tensors must lie inside it. */
#include <stdint.h>
#include <string.h>

#include "io/io_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ddp_safetensors *st;
  if (ddp__safetensors_from_bytes("fuzz", data, size, &st) != DDP_OK) return 0;
  for (size_t i = 0; i < ddp_safetensors_count(st); i++) {
    ddp_safetensors_tensor t;
    if (ddp_safetensors_get(st, i, &t) != DDP_OK) __builtin_trap();
    if (t.file_offset + t.bytes > size) __builtin_trap();
    volatile uint8_t sink = 0;
    for (size_t k = 0; k < t.bytes; k++) sink ^= ((const uint8_t *)t.data)[k];
    (void)sink;
  }
  (void)ddp_safetensors_metadata(st, "format");
  ddp_safetensors_free(st);
  return 0;
}
