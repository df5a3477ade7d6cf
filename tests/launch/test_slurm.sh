#!/usr/bin/env bash
# A ddp program under a real single-node Slurm (scripts/slurm-cluster.sh, one
# bring-up for every case):
#   srun   -n 4 cluster_worker           : rendezvous from SLURM_PROCID/NTASKS/
#                                          LOCALID/STEP_NODELIST alone, master
#                                          port 15000 + SLURM_JOB_ID % 20000
#   sbatch --wait job.sh (srun inside)   : the same from a batch job script
#   sbatch examples/slurm/job.sbatch     : the example, DDP_LAUNCH=srun
#   sbatch --wait ddprun --nproc-per-node 2 (no --nnodes/--node-rank): ddprun
#                                          derives the world from the allocation
#   examples/slurm/job.sbatch            : DDP_LAUNCH=ddprun and seed as well
#   the example training for real        : ddp-train --model toy, 20 steps
#                                          at world 2 under ddprun and under
#                                          srun: same final train_loss
# Every worker checks its rank's source and an allreduce against a closed
# form and exits non-zero otherwise; this script checks the exit codes and
# that every rank printed its "ok" line. SKIP (77) when not root or Slurm
# cannot start here. The cluster is torn down on every path (trap, and the
# cluster script's watchdog if this shell is killed).
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

src=${DDP_SOURCE_DIR:?set DDP_SOURCE_DIR to the source tree}
worker=${DDP_TEST_BIN_DIR:?set DDP_TEST_BIN_DIR to the build tests directory}/cluster_worker
ddprun=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}/ddprun
[ -x "$worker" ] || fail "$worker is not built"
[ -x "$ddprun" ] || fail "$ddprun is not built"
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd"

. "$src/tests/support/slurm_test_cluster.sh"
slurm_test_cluster_up
eval "$("$src/scripts/slurm-cluster.sh" env "$cluster")"
host=$(hostname -s)
echo "cluster up in $((SECONDS - t0)) s ($cluster)"

# check_ok FILE N KIND JOBID: N distinct "ok rank r/N" lines, each showing
# what KIND of launch must give:
#   slurm   source slurm, master <first node>:<15000 + job id % 20000>
#   ddprun  source env (ddprun's RANK...), run id slurm-<job id>: ddprun read
#           the allocation (it was given no --nnodes / --node-rank)
#   seed    source env, master <first node>:<15000 + job id % 20000>, which
#           job.sbatch passed to launch.sh and launch.sh to ddprun
check_ok() {
  local file=$1 n=$2 kind=$3 job=$4 r want
  case "$kind" in
    slurm) want=" source slurm master $host:$((15000 + job % 20000)) " ;;
    ddprun) want=" source env .* run slurm-$job\$" ;;
    seed) want=" source env master $host:$((15000 + job % 20000)) " ;;
  esac
  for r in $(seq 0 $((n - 1))); do
    grep -q "^ok rank $r/$n .*$want" "$file" ||
      fail "no 'ok rank $r/$n ...$want' line in: $(cat "$file")"
  done
  [ "$(grep -c '^ok rank' "$file")" = "$n" ] || fail "expected $n ok lines: $(cat "$file")"
}

# ---- srun -n 4 ------------------------------------------------------------
t=$SECONDS
slurm_test_srun "$tmp/srun.out" -n 4 -- "$worker" --source slurm --world 4 --local-world 4
check_ok "$tmp/srun.out" 4 slurm "$job"
echo "srun -n 4: 4 ranks rendezvoused from SLURM_* and reduced right ($((SECONDS - t)) s)"

# ---- batch jobs, submitted together (slurm_test_submit) ----------------------
# collect NAME N KIND WHAT: the job exited 0 and all N ranks printed their
# ok line (check_ok's KIND).
collect() {
  local name=$1 n=$2 kind=$3 what=$4
  slurm_test_wait "$name"
  check_ok "$out" "$n" "$kind" "$job"
  echo "$what: job $job, $n ranks rendezvoused and reduced right ($((SECONDS - t)) s)"
}
t=$SECONDS

# A job script of our own: srun inside the allocation starts the 4 workers.
cat >"$tmp/job.sh" <<EOF
#!/bin/bash
#SBATCH --job-name=ddp-test
#SBATCH --ntasks=4
echo "batch job \$SLURM_JOB_ID on \$SLURM_JOB_NODELIST, \$SLURM_NTASKS tasks"
srun "$worker" --source slurm --world 4 --local-world 4
EOF
slurm_test_submit job "$tmp/job.sh"

# The example as a user submits it, with this cluster's limits on the command
# line (one node, 2 minutes) and the worker as its program; no launcher.
DDP_LAUNCH=srun slurm_test_submit example_srun --nodes=1 --ntasks-per-node=4 --cpus-per-task=1 \
  examples/slurm/job.sbatch "$worker" --source slurm --world 4 --local-world 4

# ddprun in the batch step itself, with no --nnodes / --node-rank: it must
# derive one node, node rank 0 and the master from SLURM_* (run id slurm-<job>).
cat >"$tmp/ddprun_job.sh" <<EOF
#!/bin/bash
#SBATCH --job-name=ddp-test-ddprun
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
"$ddprun" --nproc-per-node 2 "$worker" --source env --world 2 --local-world 2
EOF
slurm_test_submit ddprun "$tmp/ddprun_job.sh"
# The example's two ddprun paths (DDP_BIN: where the example finds ddprun): srun starts one ddprun per node (default),
# and seed 000's loop of launch.sh with the world spelled out.
for mode in ddprun seed; do
  DDP_LAUNCH=$mode DDP_BIN=$(dirname "$ddprun") slurm_test_submit "example_$mode" --nodes=1 --ntasks-per-node=1 --cpus-per-task=2 \
    examples/slurm/job.sbatch "$worker" --source env --world 2 --local-world 2
done

# Real training through the example: ddp-train (data-parallel) for 20 steps
# at world 2, once under ddprun and once under plain srun (seed 001's toy
# model: seconds even under ASan; the ConvNet takes ~12 s in release).
train=(build/bin/ddp-train --model toy --epochs 100 --max-steps 20 --json)
[ -n "${DDP_BIN_DIR:-}" ] && train[0]=$DDP_BIN_DIR/ddp-train
DDP_LAUNCH=ddprun DDP_BIN=$(dirname "$ddprun") slurm_test_submit train_ddprun --nodes=1 \
  --ntasks-per-node=1 --cpus-per-task=2 examples/slurm/job.sbatch "${train[@]}"
DDP_LAUNCH=srun slurm_test_submit train_srun --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 \
  examples/slurm/job.sbatch "${train[@]}"

collect job 4 slurm "sbatch --wait job.sh (srun inside)"
collect example_srun 4 slurm "examples/slurm/job.sbatch, DDP_LAUNCH=srun"
collect ddprun 2 ddprun "sbatch: ddprun --nproc-per-node 2, world from SLURM_*"
collect example_ddprun 2 ddprun "examples/slurm/job.sbatch, DDP_LAUNCH=ddprun (srun ddprun)"
collect example_seed 2 seed "examples/slurm/job.sbatch, DDP_LAUNCH=seed (launch.sh)"

# The two training jobs: both exited 0, trained at world 2 for 20 steps, and
# ended with the same loss.
slurm_test_same_loss 2
echo "examples/slurm/job.sbatch ddp-train --model toy, 20 steps at world 2:" \
  "train_loss ${loss[0]} under ddprun and srun ($((SECONDS - t)) s)"

echo "PASS (all cases in $((SECONDS - t0)) s, cluster bring-up included)"
