/* A reader for the optim reference fixtures that
 * scripts/make_optim_fixtures.py writes: the "DDPFIX01" format of the model
 * fixtures (scripts/make_fixtures.py), whose reader (tests/support/fixture.c)
 * takes float32, int64 and bfloat16 but not the float64 that exact learning
 * rates need. Format in docs/optim.md. Test code only; memory comes from
 * malloc so that it does not disturb ddp_alloc_count(). */
#ifndef DDP_TESTS_OPTIM_FIXTURE_H
#define DDP_TESTS_OPTIM_FIXTURE_H

#include <stddef.h>
#include <stdint.h>

/* ddp_dtype's codes. */
enum { FIXTURE_F32 = 0, FIXTURE_F64 = 1, FIXTURE_I64 = 3 };
#define FIXTURE_MAX_DIMS 6

typedef struct fixture_record {
  char *name;
  int dtype;
  int ndim;
  int64_t shape[FIXTURE_MAX_DIMS];
  size_t numel;
  void *data; /* numel elements of dtype, aligned for any of them */
} fixture_record;

typedef struct fixture {
  fixture_record *records;
  size_t count;
} fixture;

/* Reads `path` into *fx. Returns 0, or -1 with a message ("optim_adam.bin:
 * record 'grads' (offset 812): 320 elements of 4 bytes, only 64 bytes left")
 * in err. Every length is checked against the file before it is used. */
int fixture_load(fixture *fx, const char *path, char *err, size_t err_size);
/* The record `name`, or NULL. */
const fixture_record *fixture_find(const fixture *fx, const char *name);
void fixture_free(fixture *fx);

#endif /* DDP_TESTS_OPTIM_FIXTURE_H */
