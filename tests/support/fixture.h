/* Reader for PyTorch reference fixtures ("DDPFIX01" files written by
 * scripts/make_fixtures.py; format in docs/nn.md). Tests only.
 *
 * A fixture is a list of named tensors. fixture_load reads the whole file and
 * checks every length against the file before trusting it; float records
 * stored as bfloat16 are widened to float32 (exactly) so callers only ever see
 * float32, float64 and int64 data. */
#ifndef DDP_TEST_FIXTURE_H
#define DDP_TEST_FIXTURE_H

#include "ddp/ddp.h"

typedef struct fixture_tensor {
  char *name;
  ddp_dtype dtype;        /* DDP_FLOAT32, DDP_FLOAT64 or DDP_INT64 (after widening) */
  ddp_dtype stored_dtype; /* as in the file: those, or DDP_BFLOAT16 */
  int32_t ndim;
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  void *data;             /* numel elements of dtype; owned by the fixture */
} fixture_tensor;

typedef struct fixture {
  int count;
  fixture_tensor *tensors; /* in file order */
} fixture;

/* Reads `path`. On failure returns DDP_ERR_IO (cannot read) or DDP_ERR_FORMAT
 * (with the file, the byte offset and what was wrong) and *out is NULL.
 * Free with fixture_free (NULL ok). */
ddp_status fixture_load(const char *path, fixture **out);
/* Parses an in-memory image (what fixture_load does after reading the file);
 * `what` names it in errors. */
ddp_status fixture_parse(const void *bytes, size_t size, const char *what, fixture **out);
void fixture_free(fixture *f);
/* The tensor named `name`, or NULL. */
const fixture_tensor *fixture_find(const fixture *f, const char *name);
/* "$DDP_SOURCE_DIR/tests/fixtures/<file>" (or "tests/fixtures/<file>" when the
 * variable is unset) into buf; returns buf. */
const char *fixture_path(const char *file, char *buf, size_t bytes);

#endif
