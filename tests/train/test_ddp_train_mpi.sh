#!/usr/bin/env bash
# ddp-train over the MPI backend (docs/comm.md, "MPI backend"):
#  - `mpirun -np 2 ddp-train --backend mpi` trains the ConvNet (--sync-bn,
#    10 steps, batch 50 per rank) to the parameters `ddprun
#    --nproc-per-node 2 ddp-train` reaches, within docs/parallel.md's bound
#    (compare_state.py --init: ||a - b|| <= 1e-2 ||b - p0|| per tensor), both
#    ranks of each run identical, world_size 2 in the summary;
#  - `ddp-train --backend mpi` outside an MPI launch fails at once, saying why;
#  - `mpirun -np 2 ddp-hpo --backend mpi --ranks-per-worker 2` (a worker's
#    subgroup over MPI) evaluates its 25 individuals;
#  - `DDP_BACKEND=mpi mpirun -np 4 model_parallel_hpc` (2 stages x 2
#    replicas: subgroups, the pipeline's point-to-point over MPI) passes its
#    own checks (loss falls, replicas identical).
# Skips (77) with the reason without mpirun, the MPI backend, python3 or the
# Fashion-MNIST data.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
ddprun=${DDP_BIN_DIR:?}/ddprun
here=$(cd "$(dirname "$0")" && pwd)
command -v mpirun >/dev/null || skip "mpirun not found (scripts/install-deps.sh mpi)"
py=$(command -v python3) || skip "no python3 to compare the dumps"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR DDP_BACKEND \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE PMIX_RANK PMI_RANK
export DDP_TIMEOUT=120
. "$here/../support/mpi_env.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Outside an MPI launch: at once, naming the launchers.
start=$(date +%s)
timeout 30 "$bin" --backend mpi --model toy --max-steps 1 >"$tmp/outside.out" 2>&1 && fail "--backend mpi outside mpirun succeeded"
if grep -q "built without MPI" "$tmp/outside.out"; then
  skip "this build has no MPI backend: $(head -1 "$tmp/outside.out")"
fi
grep -q "mpirun" "$tmp/outside.out" || { cat "$tmp/outside.out"; fail "--backend mpi outside mpirun: no word of mpirun"; }
[ $(($(date +%s) - start)) -le 10 ] || fail "--backend mpi outside mpirun took more than 10 s to fail"
hpo=${DDP_BIN_DIR}/ddp-hpo
timeout -k 10 200 mpirun --allow-run-as-root --oversubscribe --timeout 190 -np 2 "$hpo" --backend mpi \
  --objective rastrigin --generations 25 --pop-size 4 --ranks-per-worker 2 --json >"$tmp/hpo.out" 2>"$tmp/hpo.err" \
  || { tail -n 20 "$tmp/hpo.err"; fail "mpirun -np 2 ddp-hpo --backend mpi"; }
"$py" - "$tmp/hpo.out" <<'PY' || fail "ddp-hpo over mpi: summary"
import json, sys
s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert s["evaluations"] == 25 and s["workers"] == 1, s
PY
echo "ok ddp-hpo --backend mpi: a worker of 2 ranks over MPI evaluated 25 individuals"
if [ -x "${DDP_BIN_DIR}/model_parallel_hpc" ]; then
  DDP_BACKEND=mpi timeout -k 10 300 mpirun --allow-run-as-root --oversubscribe --timeout 290 -np 4 -x DDP_BACKEND \
    "${DDP_BIN_DIR}/model_parallel_hpc" --groups_size 2 --group_per_node 2 --max_steps 20 >"$tmp/mp.out" 2>&1 \
    || { tail -n 20 "$tmp/mp.out"; fail "mpirun -np 4 model_parallel_hpc over mpi"; }
  grep -q "replicas after 20 steps: head and tail identical on all 4 ranks: ok" "$tmp/mp.out" \
    || { cat "$tmp/mp.out"; fail "model_parallel_hpc over mpi: replicas"; }
  echo "ok model_parallel_hpc over mpi: 2 stages x 2 replicas, $(grep -m1 'loss over' "$tmp/mp.out")"
fi
echo "ok outside mpirun: $(grep -o 'backend "mpi" needs.*' "$tmp/outside.out" | head -1 | cut -c1-160)"

fashion=/usr/share/datasets/fashion-mnist
data=$tmp/fashion-small
[ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] && "$py" "$here/../support/fashion_small.py" "$fashion" "$data" 1000 \
  || skip "no Fashion-MNIST in $fashion (dataset-fashion-mnist)"
conv=(--model convnet --data "$data" --seed 2 --lr 0.01 --sync-bn --json --max-steps 10 --batch-size 50)
"$bin" "${conv[@]}" --epochs 0 --dump-state "$tmp/init" >/dev/null 2>&1 || fail "writing the ConvNet's initial state"
timeout -k 10 300 mpirun --allow-run-as-root --oversubscribe --timeout 290 -np 2 \
  "$bin" --backend mpi "${conv[@]}" --dump-state "$tmp/mpi.{rank}" >"$tmp/mpi.out" 2>"$tmp/mpi.err" \
  || { tail -n 20 "$tmp/mpi.err"; fail "mpirun -np 2 ddp-train --backend mpi"; }
timeout -k 10 300 "$ddprun" --nproc-per-node 2 "$bin" "${conv[@]}" --dump-state "$tmp/ddp.{rank}" \
  >"$tmp/ddp.out" 2>"$tmp/ddp.err" || { tail -n 20 "$tmp/ddp.err"; fail "ddprun --nproc-per-node 2 ddp-train"; }
cmp -s "$tmp/mpi.0" "$tmp/mpi.1" || fail "mpi: the two ranks' states differ"
cmp -s "$tmp/ddp.0" "$tmp/ddp.1" || fail "ddp: the two ranks' states differ"
"$py" "$here/compare_state.py" "$tmp/mpi.0" "$tmp/ddp.0" --init "$tmp/init" || fail "mpi and ddp runs differ beyond the bound"
"$py" - "$tmp/mpi.out" "$tmp/ddp.out" <<'PY' || fail "summaries"
import json, sys
a, b = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
assert a["world_size"] == 2 and b["world_size"] == 2, (a["world_size"], b["world_size"])
assert a["steps"] == b["steps"] == 10, (a["steps"], b["steps"])
print("samples/s: mpi %.0f, ddp %.0f (not asserted: the machine is shared)" % (a["samples_per_s"], b["samples_per_s"]))
PY
echo "ok convnet: mpirun --backend mpi == ddprun over 10 steps (docs/parallel.md's bound), replicas identical"
