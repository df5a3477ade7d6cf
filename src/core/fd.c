/* Writing to a file descriptor whole: short writes and EINTR handled, the
 * one loop the io, comm and launch layers write files and pipes with. */
#include <errno.h>
#include <unistd.h>

#include "core/core_internal.h"

int ddp__write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -1;
    if (w == 0) {
      errno = EIO; /* write(2) returning 0 for len > 0: nothing will go */
      return -1;
    }
    p += w;
    len -= (size_t)w;
  }
  return 0;
}
