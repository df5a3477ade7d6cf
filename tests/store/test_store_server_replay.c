/* store server: replays the live-server fuzz target's seed corpus
 * (fuzz/corpus/store_server/, including inputs the fuzzer once crashed on)
 * and 500 deterministic mutations of it through the same harness, so CI
 * checks without clang that every such client is closed within 2 s and
 * leaves the server serving with no client or waiter held. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/core.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void test_server_corpus_replay(void **state) {
  (void)state;
  LLVMFuzzerInitialize(NULL, NULL);
  const char *src = getenv("DDP_SOURCE_DIR");
  char dir[600];
  snprintf(dir, sizeof dir, "%s/fuzz/corpus/store_server", src ? src : ".");
  DIR *d = opendir(dir);
  if (!d) fail_msg("no seed corpus at %s", dir);
  static uint8_t inputs[64][4096];
  static size_t lens[64];
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) && n < 64) {
    if (e->d_name[0] == '.') continue;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    lens[n] = fread(inputs[n], 1, sizeof inputs[n], f);
    fclose(f);
    LLVMFuzzerTestOneInput(inputs[n], lens[n]); /* aborts on a broken promise */
    n++;
  }
  closedir(d);
  assert_true(n >= 10);
  ddp_rng rng;
  ddp_rng_seed(&rng, 99);
  uint8_t m[4096];
  for (int round = 0; round < 500; round++) {
    int pick = (int)ddp_rng_below(&rng, (uint64_t)n);
    size_t len = lens[pick];
    memcpy(m, inputs[pick], len);
    int edits = 1 + (int)ddp_rng_below(&rng, 4);
    for (int i = 0; i < edits && len > 1; i++) {
      size_t at = 1 + ddp_rng_below(&rng, len - 1);
      switch (ddp_rng_below(&rng, 4)) {
        case 0: m[at] ^= (uint8_t)(1u << ddp_rng_below(&rng, 8)); break;
        case 1: m[at] = (uint8_t)ddp_rng_next(&rng); break;
        case 2: m[at] = ddp_rng_below(&rng, 2) ? 0xff : 0x7f; break;
        default: len = at; break;
      }
    }
    LLVMFuzzerTestOneInput(m, len);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_server_corpus_replay)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
