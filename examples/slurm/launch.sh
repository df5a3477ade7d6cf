#!/bin/bash
# One node's share of a ddp job, as seed 000's launch.sh is for
# torch.distributed.launch: start NPROC_PER_NODE workers on this node with
# ddprun, told explicitly how many nodes there are, which one this is and where
# the master is. job.sbatch runs it once per node (DDP_LAUNCH=seed); run it by
# hand on each machine without Slurm:
#
#   host0$ examples/slurm/launch.sh 2 0 host0          # node 0 of 2, master host0
#   host1$ examples/slurm/launch.sh 2 1 host0          # node 1 of 2
#
# Usage: launch.sh NNODES NODE_RANK MASTER_ADDR [PROGRAM [ARGS...]]
# PROGRAM defaults to `ddp-train --model convnet --epochs 3`. Environment:
# NPROC_PER_NODE (workers on this node, default 4), MASTER_PORT (default
# 29500, torchrun's), DDP_BIN (where ddprun and ddp-train are, default
# build/bin beside this script's repository, or $SLURM_SUBMIT_DIR/build/bin).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
nnodes=$1        # total number of nodes in this job
node_rank=$2     # this node's rank, 0-indexed
master_addr=$3   # host name (or address) of node 0
shift 3
nproc_per_node=${NPROC_PER_NODE:-4} # workers (model replicas) on this node
port=${MASTER_PORT:-29500}
here=$(cd "$(dirname "$0")" && pwd)
bin=${DDP_BIN:-${SLURM_SUBMIT_DIR:-$here/../..}/build/bin}

[ $# -gt 0 ] || set -- "$bin/ddp-train" --model convnet --epochs 3
echo "launch.sh: node $node_rank of $nnodes on $(hostname -s), $nproc_per_node workers," \
  "master $master_addr:$port: $*" >&2
exec "$bin/ddprun" \
  --nproc-per-node "$nproc_per_node" \
  --nnodes "$nnodes" \
  --node-rank "$node_rank" \
  --master-addr "$master_addr" \
  --master-port "$port" \
  "$@"
