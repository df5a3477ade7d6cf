/* allreduce_demo: a process group and a few collectives, either as separate
 * processes meeting through an init URL (as under torchrun), e.g.
 *
 *   export MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2
 *   RANK=0 ./build/bin/allreduce_demo & RANK=1 ./build/bin/allreduce_demo; wait
 *
 * or as N threads of this one process sharing an in-process store (the
 * single-process multi-replica mode):
 *
 *   ./build/bin/allreduce_demo --threads 4
 *
 * Each rank averages a vector, broadcasts a message from the last rank with
 * the byte collectives, and says which transport reaches each peer.
 * DDP_DEBUG=detail checks every collective's arguments across ranks. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

#define CHECK(expr)                                                                    \
  do {                                                                                 \
    ddp_status s_ = (expr);                                                            \
    if (s_ != DDP_OK) {                                                                \
      fprintf(stderr, "allreduce_demo: %s: %s\n", #expr, ddp_last_error());            \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

static int demo(ddp_process_group *pg) {
  int rank = ddp_process_group_rank(pg), size = ddp_process_group_size(pg);
  float grad[4]; /* (4,) this rank's "gradient": rank + 1 everywhere */
  for (int i = 0; i < 4; i++) grad[i] = (float)(rank + 1);
  CHECK(ddp_allreduce(pg, grad, 4, DDP_FLOAT32, DDP_REDUCE_AVG));

  void *msg = NULL;
  size_t bytes = 0;
  char text[64];
  if (rank == size - 1) {
    bytes = (size_t)snprintf(text, sizeof text, "hello from rank %d", rank);
    msg = text;
  }
  CHECK(ddp_broadcast_bytes(pg, &msg, &bytes, size - 1));

  char transports[256] = "";
  for (int q = 0, n = 0; q < size && n < (int)sizeof transports; q++)
    n += snprintf(transports + n, sizeof transports - (size_t)n, "%s%d:%s", q ? " " : "", q,
                  ddp_process_group_transport(pg, q));
  printf("rank %d of %d: avg %g (want %g), \"%.*s\", peers %s\n", rank, size, grad[0],
         (size + 1) / 2.0, (int)bytes, (const char *)msg, transports);
  if (rank != size - 1) ddp_free(msg);
  CHECK(ddp_monitored_barrier(pg, 30, true));
  return 0;
}

typedef struct thread_rank {
  ddp_store *store;
  int rank, size, result;
} thread_rank;

static void *thread_main(void *arg) {
  thread_rank *t = arg;
  ddp_process_group *pg = NULL;
  if (ddp_process_group_create(t->store, t->rank, t->size, NULL, &pg) != DDP_OK) {
    fprintf(stderr, "allreduce_demo: rank %d: %s\n", t->rank, ddp_last_error());
    t->result = 1;
    return NULL;
  }
  t->result = demo(pg);
  ddp_process_group_destroy(pg);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc > 2 && strcmp(argv[1], "--threads") == 0) {
    int n = atoi(argv[2]);
    if (n < 1 || n > 64) {
      fprintf(stderr, "allreduce_demo: --threads takes 1..64\n");
      return 2;
    }
    ddp_store *store;
    CHECK(ddp_store_mem_create(NULL, &store));
    thread_rank ranks[64];
    pthread_t threads[64];
    for (int r = 0; r < n; r++) {
      ranks[r] = (thread_rank){.store = store, .rank = r, .size = n};
      pthread_create(&threads[r], NULL, thread_main, &ranks[r]);
    }
    int failed = 0;
    for (int r = 0; r < n; r++) {
      pthread_join(threads[r], NULL);
      failed |= ranks[r].result;
    }
    ddp_store_destroy(store);
    return failed;
  }
  ddp_process_group *pg;
  CHECK(ddp_init_process_group(argc > 1 ? argv[1] : "env://", NULL, NULL, &pg));
  int result = demo(pg);
  /* rank 0 may host the store: the barrier above lets everyone finish first */
  ddp_process_group_destroy(pg);
  return result;
}
