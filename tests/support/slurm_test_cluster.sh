# Sourced by the Slurm tests (after they define skip and fail and set src to
# the source tree): a private Slurm for the test's lifetime.
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
