# Sourced by the Slurm tests (after they define skip and fail and set src to
# the source tree): a private Slurm for the test's lifetime, and the srun
# and sbatch steps the tests share.
#
# slurm_test_cluster_up [up options...] makes tmp (a scratch directory) and
# brings up scripts/slurm-cluster.sh's cluster in $tmp/cluster with the
# options given (--nodes 2 ...), sets cluster to its directory and t0 to the
# bring-up's start; skips (77) when Slurm cannot run here. Teardown (down,
# then rm -rf $tmp) runs on every exit; the cluster script's watchdog
# (--owner) does it too if the test is killed outright. No variable of
# another launcher leaks in from the caller, and DDP_TIMEOUT bounds every
# ddp wait at 60 s.
slurm_test_cluster_up() {
  tmp=$(mktemp -d)
  cluster=""
  trap slurm_test_cluster_down EXIT
  trap 'exit 1' INT TERM
  unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
    GROUP_RANK SLURM_JOB_ID SLURM_PROCID SLURM_NTASKS SLURM_NODELIST SLURM_JOB_NODELIST
  export DDP_TIMEOUT=60
  t0=$SECONDS
  local dir rc
  dir=$("$src/scripts/slurm-cluster.sh" up --owner $$ "$@" "$tmp/cluster")
  rc=$?
  [ $rc = 77 ] && skip "Slurm ($*) cannot run here (see the reason above)"
  [ $rc = 0 ] || fail "slurm-cluster.sh up $* exited $rc"
  cluster=$dir
}

slurm_test_cluster_down() {
  [ -n "${cluster:-}" ] && "$src/scripts/slurm-cluster.sh" down "$cluster"
  rm -rf "${tmp:?}"
}

# slurm_test_run CMD...: CMD where Slurm's commands reach the cluster (in
# node 0's namespaces when it has several nodes).
slurm_test_run() { "$src/scripts/slurm-cluster.sh" run "$cluster" "$@"; }

# slurm_test_srun OUT SRUN_OPTIONS... -- PROGRAM ARGS...: srun, bounded
# (--immediate=30, --time=2, timeout 90), with rank 0 also printing "job
# <id>" (the script cannot learn it otherwise); stdout in OUT, stderr in
# OUT.err. Fails unless srun exits 0; sets job to the job id.
slurm_test_srun() {
  local out=$1 opts=() rc
  shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  slurm_test_run timeout 90 srun --immediate=30 --time=2 "${opts[@]}" bash -c \
    '[ "$SLURM_PROCID" = 0 ] && echo "job $SLURM_JOB_ID"; exec "$0" "$@"' "$@" >"$out" 2>"$out.err"
  rc=$?
  [ $rc = 0 ] || fail "srun exited $rc: $(cat "$out" "$out.err")"
  job=$(sed -n 's/^job \([0-9]*\)$/\1/p' "$out")
  [ -n "$job" ] || fail "no job id in the srun output: $(cat "$out")"
}

# slurm_test_submit NAME [sbatch options...] SCRIPT [ARGS...]: sbatch --wait
# in the background, from the source tree, with --time=2. sbatch has no
# --immediate: `timeout` bounds the wait, --time and the partition's
# MaxTime bound the job, and teardown cancels whatever is left. The job's
# output goes to $tmp/NAME-<jobid>.out, sbatch's to $tmp/NAME.sbatch.{out,err}.
# Jobs submitted together cost one wait (each sbatch polls every 2 s).
declare -A slurm_test_sbatch_pid
slurm_test_submit() {
  local name=$1
  shift
  (cd "$src" && exec "$src/scripts/slurm-cluster.sh" run "$cluster" timeout 150 sbatch --wait \
    --parsable --time=2 --output="$tmp/$name-%j.out" "$@") >"$tmp/$name.sbatch.out" \
    2>"$tmp/$name.sbatch.err" &
  slurm_test_sbatch_pid[$name]=$!
}

# slurm_test_wait NAME: waits for that sbatch; fails unless it exited 0 and
# the job wrote its output; sets job and out (the output file).
slurm_test_wait() {
  local name=$1 rc
  wait "${slurm_test_sbatch_pid[$name]}"
  rc=$?
  job=$(head -1 "$tmp/$name.sbatch.out" | cut -d';' -f1)
  out=$tmp/$name-$job.out
  [ $rc = 0 ] || fail "$name: sbatch --wait exited $rc: $(cat "$tmp/$name.sbatch.err" "$out" 2>/dev/null)"
  [ -f "$out" ] || fail "$name: no job output $out"
}

# slurm_test_same_loss WORLD: the jobs train_ddprun and train_srun both
# trained at world WORLD for 20 steps and ended with the same train_loss
# (same seed, same shards: the launcher must not change the training); sets
# loss to the two values.
slurm_test_same_loss() {
  local world=$1 name line
  loss=()
  for name in train_ddprun train_srun; do
    slurm_test_wait "$name"
    line=$(grep '"world_size"' "$out" | tail -1)
    grep -q "\"world_size\": $world" <<<"$line" && grep -q '"steps": 20' <<<"$line" ||
      fail "$name: no world-$world, 20-step summary: $(cat "$out")"
    loss+=("$(sed -n 's/.*"train_loss": \([^,]*\),.*/\1/p' <<<"$line")")
  done
  [ -n "${loss[0]}" ] && [ "${loss[0]}" = "${loss[1]}" ] ||
    fail "train_loss differs between ddprun (${loss[0]}) and srun (${loss[1]})"
}
