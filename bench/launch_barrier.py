"""The PyTorch side of scripts/bench-launch.sh: what a torchrun job does first
(init_process_group over gloo from torchrun's env://, then a barrier), then
prints the time it got past the barrier, as tests/launch/launch_worker.c
--print-time does for ddp."""
import time

import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
dist.barrier()
print(f"past_barrier {time.time():.6f}", flush=True)
dist.destroy_process_group()
