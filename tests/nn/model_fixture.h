/* Shared by the nn tests: loads tests/fixtures/model_<name>.bin or fails the
 * cmocka test with the reader's message. Include after <cmocka.h>. */
#ifndef DDP_TEST_NN_MODEL_FIXTURE_H
#define DDP_TEST_NN_MODEL_FIXTURE_H

#include <stdio.h>

#include "support/fixture.h"

static inline fixture *load_fixture(const char *model) {
  char file[64], path[1024];
  snprintf(file, sizeof file, "model_%s.bin", model);
  fixture *f = NULL;
  if (fixture_load(fixture_path(file, path, sizeof path), &f) != DDP_OK)
    fail_msg("%s", ddp_last_error());
  return f;
}

#endif
