#!/usr/bin/env bash
# The MPI backend under Slurm's own launcher (docs/comm.md, "MPI backend",
# `srun --mpi=pmix`), on a private single-node Slurm
# (scripts/slurm-cluster.sh):
#   srun --mpi=pmix -n 2 ddp-train --backend mpi : the ConvNet (--sync-bn,
#       10 steps, batch 50 per rank) reaches the parameters `ddprun
#       --nproc-per-node 2 ddp-train` reaches, within docs/parallel.md's
#       bound (compare_state.py --init), both ranks identical, world 2;
#       Slurm's PMIx plugin started MPI (PMIX_RANK), and ranks and world come
#       from MPI, not from SLURM_PROCID;
#   srun --mpi=none -n 2 ddp-train --backend mpi  : fails at once on every
#       rank, saying to launch with `srun --mpi=pmix` (no PMI, so MPI_Init
#       would make two worlds of one);
#   srun --mpi=pmix -N 2 -n 4 ddp-bench allreduce --backend mpi --check 1 :
#       2 ranks on each of 2 nodes (network namespaces of this machine, with
#       the same host name): the bootstrap store is reached across them
#       (rank 0's loopback only from its own namespace) and every size
#       reduces right.
# SKIP (77) with the reason: not root, no Slurm, no mpirun or a build
# without the MPI backend, Slurm without its pmix plugin (`srun --mpi=list`;
# Debian's slurm-wlm-basic-plugins has mpi_pmix.so, linked to libpmix2),
# no python3 or no Fashion-MNIST.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

src=${DDP_SOURCE_DIR:?set DDP_SOURCE_DIR to the source tree}
bin=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}/ddp-train
ddprun=$DDP_BIN_DIR/ddprun
bench=$DDP_BIN_DIR/ddp-bench
[ -x "$bin" ] || fail "$bin is not built"
[ -x "$ddprun" ] || fail "$ddprun is not built"
[ -x "$bench" ] || fail "$bench is not built"
[ "$(id -u)" = 0 ] || skip "needs root to run slurmd"
command -v mpirun >/dev/null || skip "mpirun not found (scripts/install-deps.sh mpi)"
py=$(command -v python3) || skip "no python3 to compare the dumps"
# A build without the MPI backend says so at once (no launcher needed).
if env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_RANK -u PMI_SIZE timeout 30 "$bin" --backend mpi \
    --model toy --max-steps 1 2>&1 | grep -q "built without MPI"; then
  skip "this build has no MPI backend"
fi
. "$src/tests/support/mpi_env.sh"
. "$src/tests/support/slurm_test_cluster.sh"
slurm_test_cluster_up --nodes 2
eval "$("$src/scripts/slurm-cluster.sh" env "$cluster")"
echo "cluster up in $((SECONDS - t0)) s ($cluster)"
slurm_test_run srun --mpi=list >"$tmp/list.out" 2>&1 || fail "srun --mpi=list: $(cat "$tmp/list.out")"
grep -qw pmix "$tmp/list.out" ||
  skip "this Slurm has no pmix plugin (srun --mpi=list: $(tr '\n\t' '  ' <"$tmp/list.out"); Debian: slurm-wlm-basic-plugins with libpmix2)"

fashion=/usr/share/datasets/fashion-mnist
data=$tmp/fashion-small
[ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] && "$py" "$src/tests/support/fashion_small.py" "$fashion" "$data" 1000 \
  >/dev/null || skip "no Fashion-MNIST in $fashion (dataset-fashion-mnist)"
conv=(--model convnet --data "$data" --seed 2 --lr 0.01 --sync-bn --json --max-steps 10 --batch-size 50)
"$bin" "${conv[@]}" --epochs 0 --dump-state "$tmp/init" >/dev/null 2>&1 || fail "writing the ConvNet's initial state"

# ---- srun --mpi=pmix -n 2 ----------------------------------------------------
# Each rank also prints what started it, so the check sees PMIx's rank (MPI
# started by Slurm's plugin) next to Slurm's own.
t=$SECONDS
# Bounded as slurm_test_srun's steps, with the time a sanitizer build's
# ConvNet needs on a loaded machine (--time in minutes, timeout in s).
slurm_test_run timeout 400 srun --immediate=30 --time=6 --mpi=pmix -N 1 -n 2 bash -c \
  'echo "launched SLURM_PROCID=$SLURM_PROCID PMIX_RANK=${PMIX_RANK:-unset}" >&2; exec "$0" "$@"' \
  "$bin" --backend mpi "${conv[@]}" --dump-state "$tmp/pmix.{rank}" >"$tmp/pmix.out" 2>"$tmp/pmix.out.err" ||
  fail "srun --mpi=pmix -n 2 ddp-train --backend mpi: $(tail -20 "$tmp/pmix.out.err")"
for r in 0 1; do
  grep -q "^launched SLURM_PROCID=$r PMIX_RANK=$r\$" "$tmp/pmix.out.err" ||
    fail "rank $r was not started through PMIx: $(cat "$tmp/pmix.out.err")"
done
[ -s "$tmp/pmix.0" ] && [ -s "$tmp/pmix.1" ] || fail "srun --mpi=pmix: no state dumps: $(tail -5 "$tmp/pmix.out.err")"
echo "srun --mpi=pmix -n 2 ddp-train --backend mpi: 10 ConvNet steps in $((SECONDS - t)) s"

# ---- the same training under ddprun (ddp's own backend), outside Slurm -------
timeout -k 10 300 env -u SLURM_CONF "$ddprun" --nproc-per-node 2 "$bin" "${conv[@]}" --dump-state "$tmp/ddp.{rank}" \
  >"$tmp/ddp.out" 2>"$tmp/ddp.err" || { tail -n 20 "$tmp/ddp.err"; fail "ddprun --nproc-per-node 2 ddp-train"; }
cmp -s "$tmp/pmix.0" "$tmp/pmix.1" || fail "srun --mpi=pmix: the two ranks' states differ"
cmp -s "$tmp/ddp.0" "$tmp/ddp.1" || fail "ddprun: the two ranks' states differ"
"$py" "$src/tests/train/compare_state.py" "$tmp/pmix.0" "$tmp/ddp.0" --init "$tmp/init" ||
  fail "srun --mpi=pmix --backend mpi and ddprun differ beyond docs/parallel.md's bound"
"$py" - "$tmp/pmix.out" "$tmp/ddp.out" <<'PY' || fail "summaries"
import json, sys
def last(path):
    return json.loads([l for l in open(path).read().splitlines() if l.startswith("{")][-1])
a, b = last(sys.argv[1]), last(sys.argv[2])
assert a["world_size"] == 2 and b["world_size"] == 2, (a["world_size"], b["world_size"])
assert a["steps"] == b["steps"] == 10, (a["steps"], b["steps"])
PY
echo "ok srun --mpi=pmix: --backend mpi == ddprun over 10 ConvNet steps (docs/parallel.md's bound), replicas identical"

# ---- srun --mpi=none: no PMI, refused at once ----------------------------------
t=$SECONDS
slurm_test_run timeout 90 srun --immediate=30 --time=2 --mpi=none -N 1 -n 2 "$bin" --backend mpi --model toy \
  --max-steps 1 >"$tmp/none.out" 2>&1 && fail "srun --mpi=none with --backend mpi succeeded: $(cat "$tmp/none.out")"
[ "$(grep -c 'srun --mpi=pmix' "$tmp/none.out")" -ge 2 ] ||
  fail "srun --mpi=none: not every rank said to use srun --mpi=pmix: $(cat "$tmp/none.out")"
[ $((SECONDS - t)) -le 30 ] || fail "srun --mpi=none: took $((SECONDS - t)) s to fail"
echo "ok srun --mpi=none --backend mpi: refused at once on both ranks: $(grep -m1 -o 'backend "mpi" needs[^:]*' "$tmp/none.out")"

# ---- srun --mpi=pmix -N 2 -n 4: MPI across two nodes ----------------------------
# Open MPI names its shared-memory segments after the host name, which both
# nodes share here: each node's ranks keep theirs in the node's own TmpFS.
t=$SECONDS
slurm_test_srun "$tmp/nodes.out" --mpi=pmix -N 2 -n 4 --ntasks-per-node=2 -- bash -c \
  'export OMPI_MCA_btl_vader_backing_directory='"$cluster"'/tmp/$SLURMD_NODENAME; exec "$0" "$@"' \
  "$bench" allreduce --backend mpi -b 8 -e 1M -f 16 -n 3 -w 1 --check 1
rows=$(grep -c '^ *[0-9]' "$tmp/nodes.out")
[ "$rows" -ge 3 ] || fail "srun --mpi=pmix -N 2 -n 4: no result rows: $(cat "$tmp/nodes.out" "$tmp/nodes.out.err")"
awk '/^ *[0-9]/ && $9 != 0 { bad = 1 } END { exit bad }' "$tmp/nodes.out" ||
  fail "srun --mpi=pmix -N 2 -n 4: wrong results: $(cat "$tmp/nodes.out")"
echo "ok srun --mpi=pmix -N 2 -n 4 ddp-bench --backend mpi: $rows sizes reduced right across 2 nodes ($((SECONDS - t)) s)"
