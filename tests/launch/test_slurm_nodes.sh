#!/usr/bin/env bash
# ddp programs under a real two-node Slurm on this machine
# (scripts/slurm-cluster.sh up --nodes 2: nodes ddpn0 and ddpn1, each its own
# network namespace and slurmd; one bring-up for every case):
#   srun -N 2 -n 4 cluster_worker        : ranks 0-1 on host 0, 2-3 on host 1,
#                                          master ddpn0:<15000 + job % 20000>
#   examples/slurm/job.sbatch as written : its default two nodes, in each of
#                                          its three modes (ddprun per node,
#                                          seed 000's launch.sh loop, srun)
#   ddp-train --model toy, 20 steps at   : world 4 over two nodes, under ddprun
#   world 4                                and under srun: the same train_loss
#   a rank killed on node 1              : both nodes' ddprun stop their
#                                          workers; srun fails within seconds;
#                                          node 1's summary names rank 3
# Every worker checks its rank's source and an allreduce against a closed
# form. SKIP (77) when not root, or when Slurm or network namespaces cannot
# run here. Torn down on every path (trap, and the cluster script's watchdog
# if this shell is killed).
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
# On failure, also the nodes' states and the daemons' last log lines.
fail() {
  echo "FAIL: $*"
  if [ -n "${cluster:-}" ] && [ -d "$cluster/log" ]; then
    timeout 5 "$src/scripts/slurm-cluster.sh" run "$cluster" sinfo -N -o '%N %t %E' 2>&1
    local f
    for f in "$cluster"/log/*.log; do echo "--- tail of ${f##*/}"; tail -n 8 "$f"; done
  fi
  exit 1
}

src=${DDP_SOURCE_DIR:?set DDP_SOURCE_DIR to the source tree}
tests=${DDP_TEST_BIN_DIR:?set DDP_TEST_BIN_DIR to the build tests directory}
bin=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}
worker=$tests/cluster_worker
for f in "$worker" "$tests/launch_worker" "$bin/ddprun" "$bin/ddp-train"; do
  [ -x "$f" ] || fail "$f is not built"
done
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd and make network namespaces"

. "$src/tests/support/slurm_test_cluster.sh"
slurm_test_cluster_up --nodes 2
echo "two-node cluster up in $((SECONDS - t0)) s ($cluster)"
# Slurm's commands work from node 0's namespace only: slurm_test_run.

# check_ok FILE N PER_NODE WANT: N distinct "ok rank r/N" lines, rank r on
# host r / PER_NODE of 2, each matching the pattern WANT.
check_ok() {
  local file=$1 n=$2 per=$3 want=$4 r
  for r in $(seq 0 $((n - 1))); do
    grep "^ok rank $r/$n " "$file" | grep " host $((r / per))/2 " | grep -q -- "$want" ||
      fail "no 'ok rank $r/$n ... host $((r / per))/2' line matching '$want' in: $(cat "$file")"
  done
  [ "$(grep -c '^ok rank' "$file")" = "$n" ] || fail "expected $n ok lines: $(cat "$file")"
}

# ---- srun -N 2 -n 4, no launcher -------------------------------------------
t=$SECONDS
slurm_test_srun "$tmp/srun.out" -N 2 -n 4 --ntasks-per-node=2 -- \
  "$worker" --source slurm --world 4 --local-world 2
check_ok "$tmp/srun.out" 4 2 " source slurm master ddpn0:$((15000 + job % 20000))"
echo "srun -N 2 -n 4: ranks 0-1 on ddpn0, 2-3 on ddpn1, reduced right ($((SECONDS - t)) s)"

# ---- batch jobs, submitted together (slurm_test_submit) ----------------------
t=$SECONDS
# The example as written (--nodes=2), with this cluster's time limit and the
# worker as its program, in each mode.
for mode in ddprun seed; do
  DDP_LAUNCH=$mode DDP_BIN=$bin NPROC_PER_NODE=2 slurm_test_submit "example_$mode" --cpus-per-task=2 \
    examples/slurm/job.sbatch "$worker" --source env --world 4 --local-world 2
done
DDP_LAUNCH=srun slurm_test_submit example_srun --ntasks-per-node=2 --cpus-per-task=1 \
  examples/slurm/job.sbatch "$worker" --source slurm --world 4 --local-world 2
# Real training through the example at world 4 over the two nodes.
train=("$bin/ddp-train" --model toy --epochs 100 --max-steps 20 --json)
DDP_LAUNCH=ddprun DDP_BIN=$bin NPROC_PER_NODE=2 slurm_test_submit train_ddprun --cpus-per-task=2 \
  examples/slurm/job.sbatch "${train[@]}"
DDP_LAUNCH=srun slurm_test_submit train_srun --ntasks-per-node=2 --cpus-per-task=1 \
  examples/slurm/job.sbatch "${train[@]}"

slurm_test_wait example_ddprun
check_ok "$out" 4 2 " source env .* run slurm-[0-9]*"
slurm_test_wait example_seed
check_ok "$out" 4 2 " source env master ddpn0:"
slurm_test_wait example_srun
check_ok "$out" 4 2 " source slurm master ddpn0:"
echo "examples/slurm/job.sbatch on 2 nodes, DDP_LAUNCH=ddprun, seed and srun: 4 ranks each ($((SECONDS - t)) s)"
slurm_test_same_loss 4
echo "ddp-train --model toy, 20 steps at world 4 on 2 nodes: train_loss ${loss[0]} under ddprun and srun"

# ---- a rank dies on node 1 ---------------------------------------------------
# Rank 3 (node 1) SIGKILLs itself once every rank has passed the barrier; the
# others hang. Node 1's ddprun names rank 3 and stops; node 0's sees the other
# node fail and stops its own workers; srun ends with a failure.
t=$SECONDS
slurm_test_run timeout 90 srun --immediate=30 --time=2 -N 2 --ntasks-per-node=1 --cpus-per-task=2 \
  "$bin/ddprun" --nproc-per-node 2 --grace-period 2 "$tests/launch_worker" --nproc 2 --nnodes 2 \
  --die-rank 3 --die-how kill --hang >"$tmp/die.out" 2>"$tmp/die.err"
rc=$?
took=$((SECONDS - t))
[ $rc != 0 ] && [ $rc != 124 ] || fail "srun exited $rc after rank 3 died: $(cat "$tmp/die.err")"
[ $took -le 30 ] || fail "the job took $took s to fail after rank 3 died"
grep -q 'first failure: rank 3 (local rank 1) on host .*killed by signal 9 (SIGKILL)' "$tmp/die.err" ||
  fail "no summary naming rank 3: $(cat "$tmp/die.err")"
grep -q 'node 0 stopped its workers\|another node failed' "$tmp/die.err" ||
  fail "node 0 did not say it stopped for the other node: $(cat "$tmp/die.err")"
echo "rank 3 killed on ddpn1: both nodes stopped, srun exited $rc in $took s"

echo "PASS (all cases in $((SECONDS - t0)) s, bring-up included)"
