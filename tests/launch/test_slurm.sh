#!/usr/bin/env bash
# A ddp program under a real single-node Slurm (scripts/slurm-cluster.sh, one
# bring-up for every case):
#   srun   -n 4 cluster_worker           : rendezvous from SLURM_PROCID/NTASKS/
#                                          LOCALID/STEP_NODELIST alone, master
#                                          port 15000 + SLURM_JOB_ID % 20000
#   sbatch --wait job.sh (srun inside)   : the same from a batch job script
#   sbatch --wait ddprun --nproc-per-node 2 (no --nnodes/--node-rank): ddprun
#                                          derives the world from the allocation
#                                          (only once ddprun is built)
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
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd"

tmp=$(mktemp -d)
cluster=""
cleanup() {
  [ -n "$cluster" ] && "$src/scripts/slurm-cluster.sh" down "$cluster"
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# No variables of another launcher may leak in from the caller.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  GROUP_RANK SLURM_JOB_ID SLURM_PROCID SLURM_NTASKS SLURM_NODELIST SLURM_JOB_NODELIST
export DDP_TIMEOUT=60

t0=$SECONDS
cluster=$("$src/scripts/slurm-cluster.sh" up --owner $$ "$tmp/cluster")
rc=$?
[ $rc = 77 ] && { cluster=""; skip "Slurm cannot run here (see the reason above)"; }
[ $rc = 0 ] || { cluster=""; fail "slurm-cluster.sh up exited $rc"; }
eval "$("$src/scripts/slurm-cluster.sh" env "$cluster")"
host=$(hostname -s)
echo "cluster up in $((SECONDS - t0)) s ($cluster)"

# check_ok FILE N JOBID: N distinct "ok rank r/N" lines, master host:port as
# Slurm's contract says (the first node, 15000 + job id mod 20000).
check_ok() {
  local file=$1 n=$2 job=$3 r want_port
  want_port=$((15000 + job % 20000))
  for r in $(seq 0 $((n - 1))); do
    grep -q "^ok rank $r/$n .* master $host:$want_port " "$file" ||
      fail "no 'ok rank $r/$n ... master $host:$want_port' line in: $(cat "$file")"
  done
  [ "$(grep -c '^ok rank' "$file")" = "$n" ] || fail "expected $n ok lines: $(cat "$file")"
}

# ---- srun -n 4 ------------------------------------------------------------
t=$SECONDS
# Rank 0 also prints the job id (the script cannot learn it otherwise).
timeout 90 srun --immediate=30 --time=2 -n 4 bash -c \
  '[ "$SLURM_PROCID" = 0 ] && echo "job $SLURM_JOB_ID"; exec "$0" "$@"' \
  "$worker" --source slurm --world 4 --local-world 4 >"$tmp/srun.out" 2>"$tmp/srun.err"
rc=$?
[ $rc = 0 ] || fail "srun exited $rc: $(cat "$tmp/srun.out" "$tmp/srun.err")"
job=$(sed -n 's/^job \([0-9]*\)$/\1/p' "$tmp/srun.out")
[ -n "$job" ] || fail "no job id in the srun output: $(cat "$tmp/srun.out")"
check_ok "$tmp/srun.out" 4 "$job"
echo "srun -n 4: 4 ranks rendezvoused from SLURM_* and reduced right ($((SECONDS - t)) s)"

# ---- sbatch --wait with a job script ---------------------------------------
t=$SECONDS
cat >"$tmp/job.sh" <<EOF
#!/bin/bash
#SBATCH --job-name=ddp-test
#SBATCH --ntasks=4
#SBATCH --time=2
#SBATCH --output=$tmp/job-%j.out
echo "batch job \$SLURM_JOB_ID on \$SLURM_JOB_NODELIST, \$SLURM_NTASKS tasks"
srun "$worker" --source slurm --world 4 --local-world 4
EOF
# sbatch has no --immediate: the timeout bounds the wait, the partition's
# MaxTime and --time bound the job, and `down` cancels whatever is left.
timeout 90 sbatch --wait --parsable "$tmp/job.sh" >"$tmp/sbatch.out" 2>"$tmp/sbatch.err"
rc=$?
job=$(head -1 "$tmp/sbatch.out" | cut -d';' -f1)
out="$tmp/job-$job.out"
[ $rc = 0 ] || fail "sbatch --wait exited $rc: $(cat "$tmp/sbatch.err" "$out" 2>/dev/null)"
[ -f "$out" ] || fail "no job output $out"
check_ok "$out" 4 "$job"
echo "sbatch --wait: job $job, 4 ranks rendezvoused and reduced right ($((SECONDS - t)) s)"

echo "PASS (all cases in $((SECONDS - t0)) s, cluster bring-up included)"
