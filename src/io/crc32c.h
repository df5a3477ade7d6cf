/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
 * TFRecord framing (TensorBoard's event files), and its "masked" form, which
 * TFRecord stores so that a CRC computed over data that itself holds CRCs
 * does not degenerate. Written here (a 1 KiB table, byte at a time): the
 * records are a few hundred bytes a step, so speed does not matter, and a
 * library for it would be a dependency for twenty lines. */
#ifndef DDP_IO_CRC32C_H
#define DDP_IO_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of data[0..n) continued from `crc` (0 to start): the standard
 * check value, ddp__crc32c(0, "123456789", 9), is 0xE3069283. */
uint32_t ddp__crc32c(uint32_t crc, const void *data, size_t n);

/* TFRecord's mask of a CRC: rotate right by 15 bits, add 0xA282EAD8
 * (tensorflow/core/lib/hash/crc32c.h, Mask). */
uint32_t ddp__crc32c_mask(uint32_t crc);

#endif /* DDP_IO_CRC32C_H */
