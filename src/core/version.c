/* The running library's version (ddp_version), spelled from the version
 * macros of the headers libddp was compiled with (include/ddp/core.h). */
#include "ddp/core.h"

#define SPELL(x) #x
#define SPELL_VALUE(x) SPELL(x)

const char *ddp_version(void) {
  return SPELL_VALUE(DDP_VERSION_MAJOR) "." SPELL_VALUE(DDP_VERSION_MINOR) "." SPELL_VALUE(
      DDP_VERSION_PATCH);
}
