/* A worker for the flight recorder's tests (test_flight.sh): joins the job
 * with env://, then runs --steps allreduces of --count floats. One rank can
 * break the job at allreduce number --at:
 *   --skip-rank R   rank R skips that allreduce and sleeps --sleep seconds
 *                   (default 60) instead, as a rank stuck elsewhere would
 *   --stop-rank R   rank R stops itself with SIGSTOP before it
 *   --exit-rank R   rank R exits 2 there, as a program on a usage error
 * Rank 0 prints "flight_worker: entering allreduce #K at <unix time, s>"
 * before allreduce K (--at), so a test can time what follows. A failing
 * allreduce prints the error and exits 6. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ddp/ddp.h"

int main(int argc, char **argv) {
  long steps = 8, at = 5, skip_rank = -1, stop_rank = -1, exit_rank = -1, count = 2;
  double sleep_s = 60;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atol(argv[++i]);
    else if (!strcmp(argv[i], "--at") && i + 1 < argc) at = atol(argv[++i]);
    else if (!strcmp(argv[i], "--count") && i + 1 < argc) count = atol(argv[++i]);
    else if (!strcmp(argv[i], "--skip-rank") && i + 1 < argc) skip_rank = atol(argv[++i]);
    else if (!strcmp(argv[i], "--stop-rank") && i + 1 < argc) stop_rank = atol(argv[++i]);
    else if (!strcmp(argv[i], "--exit-rank") && i + 1 < argc) exit_rank = atol(argv[++i]);
    else if (!strcmp(argv[i], "--sleep") && i + 1 < argc) sleep_s = atof(argv[++i]);
    else {
      fprintf(stderr, "flight_worker: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  ddp_process_group *pg = NULL;
  if (ddp_init_process_group("env://", NULL, NULL, &pg) != DDP_OK) {
    fprintf(stderr, "flight_worker: init: %s\n", ddp_last_error());
    return 4;
  }
  int rank = ddp_process_group_rank(pg);
  float *buf = calloc((size_t)count, sizeof *buf);
  if (!buf) return 3;
  for (long k = 1; k <= steps; k++) {
    if (k == at && rank == 0) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      printf("flight_worker: entering allreduce #%ld at %.6f\n", k, (double)ts.tv_sec + ts.tv_nsec * 1e-9);
      fflush(stdout);
    }
    if (k == at && rank == skip_rank) {
      fprintf(stderr, "flight_worker: rank %d skips allreduce #%ld\n", rank, k);
      /* Busy elsewhere for the whole time: a signal (the launcher's SIGUSR1
       * asking for a dump) cuts a sleep short, so sleep to a deadline. */
      struct timespec until;
      clock_gettime(CLOCK_MONOTONIC, &until);
      until.tv_sec += (time_t)sleep_s;
      while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) != 0) {
      }
      break;
    }
    if (k == at && rank == exit_rank) {
      fprintf(stderr, "flight_worker: rank %d exits 2 before allreduce #%ld\n", rank, k);
      exit(2);
    }
    if (k == at && rank == stop_rank) {
      fprintf(stderr, "flight_worker: rank %d stops itself before allreduce #%ld\n", rank, k);
      raise(SIGSTOP);
    }
    for (long i = 0; i < count; i++) buf[i] = (float)(rank + 1);
    if (ddp_allreduce(pg, buf, (size_t)count, DDP_FLOAT32, DDP_REDUCE_SUM) != DDP_OK) {
      fprintf(stderr, "flight_worker: rank %d: allreduce #%ld: %s\n", rank, k, ddp_last_error());
      fflush(stderr);
      free(buf);
      ddp_process_group_destroy(pg); /* no leak report under ASan to change the exit code */
      return 6;
    }
  }
  free(buf);
  ddp_process_group_destroy(pg);
  return 0;
}
