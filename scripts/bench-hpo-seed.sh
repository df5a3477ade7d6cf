#!/usr/bin/env bash
# Seed 002's job in the same go (issue 22): the convnet-N search with workers
# of 2 ranks on 2 ranks, a reduced budget, ddp-hpo (the trainer, data-parallel
# on the worker's subgroup) against Propulate 1.2.2 running the tutorial's
# ind_loss with PyTorch DDP over gloo (../shared/refs/propulate_torch_ddp.py).
# Both: pop_size 2 (the reference's 2 x workers), seed 0 (so the first two
# individuals' conv_layers and activation agree: the cost of an evaluation
# follows conv_layers), batch 8 per rank, Adadelta + StepLR(1, gamma), NLL,
# EPOCHS epochs on the first TRAIN training images, validation on the first
# VAL test images. The figure is wall seconds per evaluation of the search
# (not the processes' start), median over the rounds, alternating order;
# the ratio is Propulate's over ddp's.
#   scripts/bench-hpo-seed.sh [rounds=3] [generations=4] [epochs=2] [train=2000] [val=1000]
# Needs build/bin/{ddprun,ddp-hpo}, Fashion-MNIST, Open MPI and the
# reference environment (/opt/torch-venv, or DDP_TORCH_PY).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; gens=${2:-4}; epochs=${3:-2}; train=${4:-2000}; val=${5:-1000}
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
ref=${DDP_SHARED_DIR:-../shared}/refs/propulate_torch_ddp.py
die() { echo "bench-hpo-seed: $*" >&2; exit 2; }
[ -x build/bin/ddp-hpo ] || die "build first (scripts/build.sh)"
[ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR)"
"$py" -c "import propulate, torch" 2>/dev/null || die "no Propulate + PyTorch at $py (scripts/install-deps.sh refs)"
ours() {
  DDP_TIMEOUT=600 timeout 3000 build/bin/ddprun --nproc-per-node 2 build/bin/ddp-hpo --objective convnet \
    --ranks-per-worker 2 --pop-size 2 --seed 0 --generations "$gens" --epochs "$epochs" \
    --train-samples "$train" --val-samples "$val" --json 2>/dev/null | tail -n 1 |
    python3 -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d["seconds"] / d["evaluations"])'
}
theirs() {
  timeout 3000 mpirun --allow-run-as-root --oversubscribe -np 2 "$py" "$ref" --ranks-per-worker 2 \
    --generations "$gens" --epochs "$epochs" --train-samples "$train" --val-samples "$val" 2>/dev/null |
    sed -n 's/.*seconds_per_eval=\([0-9.]*\).*/\1/p' | tail -n 1
}
o=() t=()
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then a=$(ours); b=$(theirs); else b=$(theirs); a=$(ours); fi
  echo "round $r: ddp-hpo $a s/evaluation, Propulate + PyTorch DDP $b s/evaluation" >&2
  o+=("$a"); t+=("$b")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mo=$(median "${o[@]}"); mt=$(median "${t[@]}")
awk -v o="$mo" -v t="$mt" -v r="$rounds" -v g="$gens" -v e="$epochs" -v n="$train" 'BEGIN {
  printf "seed 002 job, 1 worker of 2 ranks, %d generations, %d epochs on %d images: ddp-hpo %.2f s/evaluation, Propulate + PyTorch DDP %.2f s/evaluation, %.1fx less time (median of %d rounds)\n", g, e, n, o, t, t / o, r }'
