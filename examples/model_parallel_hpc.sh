#!/bin/bash
# Seed 000's launch.sh for examples/model_parallel_hpc.c: one node's share of
# the job, GROUPS_SIZE stages x GROUP_PER_NODE replicas = ddprun
# --nproc-per-node GROUPS_SIZE * GROUP_PER_NODE workers on this node (the
# seed's nproc_per_node counted replicas, one process per replica driving
# its GPUs; ddp starts a process per stage). Run it on each node, or let
# model_parallel_hpc.sbatch do so under Slurm:
#
#   host0$ examples/model_parallel_hpc.sh 2 0 host0      # node 0 of 2, master host0
#   host1$ examples/model_parallel_hpc.sh 2 1 host0      # node 1 of 2
#   examples/model_parallel_hpc.sh 1 0 127.0.0.1          # one machine
#   examples/model_parallel_hpc.sh 1 0 127.0.0.1 --device cuda   # a stage per GPU (cuda:LOCAL_RANK)
#
# Usage: model_parallel_hpc.sh NNODES NODE_RANK MASTER_ADDR [ARGS...]
# ARGS go to model_parallel_hpc (--batch_size, --samples, --max_steps ...).
# Environment: GROUPS_SIZE (stages per replica, default 2), GROUP_PER_NODE
# (replicas per node, default 2), MASTER_PORT (default 29500), DDP_BIN
# (where ddprun and the example are, default build/bin of this repository).
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
nnodes=$1 node_rank=$2 master_addr=$3
shift 3
gs=${GROUPS_SIZE:-2} gpn=${GROUP_PER_NODE:-2}
here=$(cd "$(dirname "$0")" && pwd)
bin=${DDP_BIN:-${SLURM_SUBMIT_DIR:-$here/..}/build/bin}
export DDP_BIN=$bin
NPROC_PER_NODE=$((gs * gpn)) exec "$here/slurm/launch.sh" "$nnodes" "$node_rank" "$master_addr" \
  "$bin/model_parallel_hpc" --groups_size "$gs" --group_per_node "$gpn" "$@"
