#!/usr/bin/env bash
# A ddp program under Open MPI's mpirun, no launcher: `mpirun -np 4
# cluster_worker` must rendezvous from OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/
# LOCAL_SIZE alone (all ranks on this host, so the master is 127.0.0.1
# without MASTER_ADDR), reduce right, and exit 0; and a wrong expectation
# (--world 5) must make every rank, and so mpirun, fail (the worker's checks
# can fail). Only MASTER_PORT is given: the default 29500 could be taken by
# another test on this machine. SKIP (77) without mpirun.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

worker=${DDP_TEST_BIN_DIR:?set DDP_TEST_BIN_DIR to the build tests directory}/cluster_worker
[ -x "$worker" ] || fail "$worker is not built"
command -v mpirun >/dev/null || skip "no mpirun (scripts/install-deps.sh mpi installs Open MPI)"
mpirun --version 2>/dev/null | grep -q "Open MPI" || skip "mpirun is not Open MPI's"
command -v ss >/dev/null || skip "no 'ss' (iproute2) to find a free port"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR DDP_STORE_ADDR SLURM_PROCID \
  SLURM_JOB_ID PMI_RANK PMIX_RANK
export DDP_TIMEOUT=30

. "$(dirname "$0")/../support/free_port.sh"
free_port() { ddp_free_port; }

# Root may run mpirun only when asked to; --oversubscribe: 4 ranks on 2 cores.
mpi=(mpirun --allow-run-as-root --oversubscribe -np 4 -x MASTER_PORT -x DDP_TIMEOUT)

t=$SECONDS
export MASTER_PORT=$(free_port) || fail "no free port"
timeout 60 "${mpi[@]}" "$worker" --source mpi --world 4 --local-world 4 \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc = 0 ] || fail "mpirun exited $rc: $(cat "$tmp/out" "$tmp/err")"
for r in 0 1 2 3; do
  grep -q "^ok rank $r/4 local $r/4 source mpi master 127.0.0.1:$MASTER_PORT host 0/1 sum 10$" \
    "$tmp/out" || fail "no ok line for rank $r: $(cat "$tmp/out")"
done
[ "$(grep -c '^ok rank' "$tmp/out")" = 4 ] || fail "expected 4 ok lines: $(cat "$tmp/out")"
echo "mpirun -np 4: 4 ranks rendezvoused from OMPI_COMM_WORLD_* and reduced right ($((SECONDS - t)) s)"

t=$SECONDS
export MASTER_PORT=$(free_port) || fail "no free port"
timeout 60 "${mpi[@]}" "$worker" --source mpi --world 5 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc = 124 ] && fail "mpirun with a wrong expectation hung until the timeout"
[ $rc != 0 ] || fail "mpirun exited 0 although every rank expected a world of 5"
grep -q "world size 4, expected 5" "$tmp/err" || fail "no world-size error: $(cat "$tmp/err")"
echo "mpirun with a wrong expectation fails (exit $rc) naming the world size ($((SECONDS - t)) s)"
echo PASS
