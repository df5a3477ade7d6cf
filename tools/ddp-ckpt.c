/* ddp-ckpt: works on checkpoints from the command line. `consolidate`
 * turns a sharded checkpoint (a directory: every rank's shard and the
 * metadata, ddp-train --sharded-checkpoint) into the model's whole state
 * dict, one safetensors file that PyTorch loads with strict=True. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "ddp/core.h"
#include "ddp/io.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: ddp-ckpt consolidate DIR OUT.safetensors\n"
          "       ddp-ckpt --version  (prints \"ddp-ckpt (ddp) VERSION\")\n"
          "\n"
          "Checkpoints (docs/sharding.md).\n"
          "\n"
          "consolidate  Reads the sharded checkpoint in DIR (metadata.safetensors and the\n"
          "             shard of every rank it names), assembles every tensor of the\n"
          "             model from its pieces and writes the model's state dict to\n"
          "             OUT.safetensors (written to a temporary name, then renamed):\n"
          "             PyTorch's names and order, \"format\": \"pt\", for\n"
          "             model.load_state_dict(safetensors.torch.load_file(OUT), strict=True).\n"
          "             The optimizer state stays in DIR (ddp-train --resume DIR loads it\n"
          "             at any world size).\n");
}

int main(int argc, char **argv) {
  cli_init("ddp-ckpt");
  const char *pos[3];
  int n = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] == '-' && a[1]) {
      cli_help_or_version(a, usage);
      cli_die_usage("unknown option '%s'", a);
    }
    if (n == 3) cli_die_usage("unexpected argument '%s'", a);
    pos[n++] = a;
  }
  if (n == 0) cli_die_usage("%s", "a command is needed (consolidate)");
  if (strcmp(pos[0], "consolidate")) cli_die_usage("unknown command '%s'", pos[0]);
  if (n != 3) cli_die_usage("%s", "consolidate takes DIR and OUT.safetensors");
  if (!ddp_sharded_is_checkpoint(pos[1])) {
    fprintf(stderr, "ddp-ckpt: %s is not a sharded checkpoint (a directory with "
                    "metadata.safetensors)\n", pos[1]);
    return 1;
  }
  ddp_status s = ddp_sharded_consolidate(pos[1], pos[2]);
  if (s != DDP_OK) {
    fprintf(stderr, "ddp-ckpt: %s\n", ddp_last_error());
    return 1;
  }
  return 0;
}
