/* Weak stand-ins for the local and tcp backends' constructors, so libddp
 * links while they are being built: the real definitions (src/comm/local*.c,
 * src/comm/tcp*.c) override these. A group that would need one fails with
 * DDP_ERR_UNSUPPORTED. */
#include "comm/backend.h"

__attribute__((weak)) ddp_status ddp__backend_local_create(const ddp__backend_config *cfg,
                                                           ddp__backend **out) {
  *out = NULL;
  return ddp_error(DDP_ERR_UNSUPPORTED, "local backend not built yet");
}

__attribute__((weak)) ddp_status ddp__backend_tcp_create(const ddp__backend_config *cfg,
                                                         ddp__backend **out) {
  *out = NULL;
  return ddp_error(DDP_ERR_UNSUPPORTED, "tcp backend not built yet");
}
