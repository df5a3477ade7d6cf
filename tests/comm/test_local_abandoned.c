/* Shared-memory segments that a killed group left in /dev/shm, under any
 * launcher: rank 0 write-locks its segment until every rank has mapped it,
 * and ddp__local_shm_remove_abandoned removes the segments whose lock nobody
 * holds. A real rank 0 (a child process waiting for a rank 1 that never
 * comes) keeps its segment while alive and loses it once SIGKILLed; files
 * that only look like segments (empty, another version) stay.
 *
 * Other tests' rank 0 may sweep /dev/shm while this runs, so the checks are
 * on the files (gone or there), not on this call's count. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "comm/local/local.h"
#include "ddp/store.h"

static bool exists(const char *path) { return access(path, F_OK) == 0; }

/* /dev/shm's segment named after `pid`, or "" (waits up to 10 s for it). */
static void segment_of(pid_t pid, char *path, size_t bytes) {
  char prefix[48];
  snprintf(prefix, sizeof prefix, "ddp-local-%d-", (int)pid);
  path[0] = '\0';
  for (int tries = 0; tries < 1000 && !path[0]; tries++) {
    DIR *d = opendir("/dev/shm");
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
      if (!strncmp(e->d_name, prefix, strlen(prefix))) snprintf(path, bytes, "/dev/shm/%s", e->d_name);
    closedir(d);
    if (!path[0]) {
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
}

/* Rank 0 of a 2-rank group whose rank 1 never comes: creates and publishes
 * its segment, then waits (up to 60 s) until killed. */
static _Noreturn void lonely_rank0(void) {
  ddp_store *store;
  if (ddp_store_mem_create(NULL, &store) != DDP_OK) _exit(2);
  int32_t host_of[2] = {0, 0}, process_of[2] = {0, 1};
  ddp__backend_config cfg = {.store = store, .rank = 0, .size = 2, .host_of = host_of,
                             .process_of = process_of, .timeout_ns = 60 * 1000000000LL};
  ddp__local_mem *mem;
  ddp__local_shm_create(&cfg, &mem);
  _exit(3); /* only after the timeout: the parent kills it long before */
}

/* A file named like a segment; with a header (magic, version) if `header`. */
static void make_file(const char *path, uint64_t magic, uint32_t version, bool header) {
  int fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
  assert_true(fd >= 0);
  if (header) {
    struct {
      uint64_t magic;
      uint32_t version;
      uint32_t size;
    } head = {magic, version, 2};
    assert_int_equal(write(fd, &head, sizeof head), (ssize_t)sizeof head);
  }
  close(fd);
}

static void test_abandoned_segments_removed_live_kept(void **state) {
  (void)state;
  pid_t child = fork();
  assert_true(child >= 0);
  if (child == 0) lonely_rank0();
  char seg[512];
  segment_of(child, seg, sizeof seg);
  assert_true(seg[0] != '\0');

  /* Look-alikes: no header yet (a creator between its open and its lock
   * looks so), another version's header; and one abandoned by construction
   * (this version, no lock held), named after this process. */
  char empty[96], old[96], orphan[96];
  pid_t me = getpid();
  snprintf(empty, sizeof empty, "/dev/shm/ddp-local-%d-00000000000e0001", (int)me);
  snprintf(old, sizeof old, "/dev/shm/ddp-local-%d-00000000000e0002", (int)me);
  snprintf(orphan, sizeof orphan, "/dev/shm/ddp-local-%d-00000000000e0003", (int)me);
  make_file(empty, 0, 0, false);
  make_file(old, DDP__LOCAL_MAGIC, DDP__LOCAL_VERSION - 1, true);
  make_file(orphan, DDP__LOCAL_MAGIC, DDP__LOCAL_VERSION, true);

  int removed_alive = ddp__local_shm_remove_abandoned();
  bool seg_kept_alive = exists(seg);
  bool orphan_gone = !exists(orphan);

  kill(child, SIGKILL);
  int status;
  assert_int_equal(waitpid(child, &status, 0), child);
  assert_true(WIFSIGNALED(status));
  int removed_dead = ddp__local_shm_remove_abandoned();
  bool seg_gone_dead = !exists(seg);
  bool empty_kept = exists(empty), old_kept = exists(old);
  unlink(empty);
  unlink(old);
  unlink(orphan);
  if (!seg_gone_dead) unlink(seg);
  printf("  removed %d with rank 0 alive, %d after its SIGKILL (%s)\n", removed_alive, removed_dead,
         seg);
  assert_true(seg_kept_alive); /* its creator holds the lock */
  assert_true(orphan_gone);
  assert_true(seg_gone_dead); /* the kernel dropped the lock with the process */
  assert_true(empty_kept);
  assert_true(old_kept);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_abandoned_segments_removed_live_kept),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
