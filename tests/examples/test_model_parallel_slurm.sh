#!/usr/bin/env bash
# Seed 000's Slurm job for examples/model_parallel_hpc.c on a private
# two-node Slurm (scripts/slurm-cluster.sh, tests/support/slurm_test_cluster.sh):
# examples/model_parallel_hpc.sbatch as written (two nodes), GROUPS_SIZE=2
# stages x GROUP_PER_NODE=1 replica a node = 2 workers a node, world 4, in
# both of its launch modes (DDP_LAUNCH=ddprun: one ddprun per node;
# DDP_LAUNCH=seed: the seed's loop running model_parallel_hpc.sh, over
# examples/slurm/launch.sh, per node). Each job must print 4 layout lines
# (replica k's two stages on node k), the loss falling and the two
# replicas' models identical. SKIP (77) when not root, or when Slurm or
# network namespaces cannot run here.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
src=${DDP_SOURCE_DIR:?set DDP_SOURCE_DIR to the source tree}
bin=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}
for f in "$bin/ddprun" "$bin/model_parallel_hpc"; do [ -x "$f" ] || fail "$f is not built"; done
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd and make network namespaces"

. "$src/tests/support/slurm_test_cluster.sh"
slurm_test_cluster_up --nodes 2
echo "two-node cluster up in $((SECONDS - t0)) s"
args=(--samples 65536 --batch_size 1024)
for mode in ddprun seed; do
  DDP_LAUNCH=$mode DDP_BIN=$bin GROUPS_SIZE=2 GROUP_PER_NODE=1 slurm_test_submit "mp_$mode" \
    examples/model_parallel_hpc.sbatch "${args[@]}"
done
for mode in ddprun seed; do
  slurm_test_wait "mp_$mode"
  for r in 0 1 2 3; do
    k=$((r / 2)) s=$((r % 2))
    grep -qE "^rank $r: replica $k of 2, stage $s of 2 \((head|tail)\), node $k .*: ok$" "$out" ||
      fail "$mode: no layout line for rank $r (replica $k, stage $s, node $k): $(cat "$out")"
  done
  grep -q "^loss over all replicas: first .*: ok$" "$out" || fail "$mode: the loss: $(cat "$out")"
  grep -q "^replicas after 32 steps: head and tail identical on all 4 ranks: ok$" "$out" ||
    fail "$mode: the replicas: $(cat "$out")"
  echo "ok: model_parallel_hpc.sbatch, DDP_LAUNCH=$mode: 2 nodes x (2 stages x 1 replica)"
done
