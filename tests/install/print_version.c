/* For test_install.sh: the version of the headers this was compiled with,
 * then the version of the library it runs with ("0.1.0 0.1.0"). */
#include <stdio.h>

#include "ddp/ddp.h"

int main(void) {
  printf("%d.%d.%d %s\n", DDP_VERSION_MAJOR, DDP_VERSION_MINOR, DDP_VERSION_PATCH,
         ddp_version());
  return 0;
}
