#!/usr/bin/env bash
# Where a data-parallel ConvNet run and its single-rank twin part ways, and
# how far each is from the same steps computed in float64 (issue 19,
# docs/parallel.md "How close is equal"). For k = 1..STEPS it runs ddp-train
# --model convnet --sync-bn for k steps as 2 ranks x batch B and as 1 rank x
# batch 2B from the same initial weights, and PyTorch once in float64 over the
# same sample order, then prints per step and pair of runs the worst tensor:
# max|x-y| over max|ref| ("rel") and over tests/train/compare_state.py's
# default bound ("/bnd"), and the largest ||x-y|| over the length of the
# float64 run's update of a tensor ("upd", compare_state.py --init's measure).
# Usage: scripts/dp-divergence.sh [steps=10] [extra ddp-train args...]
#   e.g. DDP_CPU_KERNELS=generic scripts/dp-divergence.sh 10 --momentum 0.9
#   DP_ARGS="--lr 0.02" (the 2-rank runs' own arguments instead of
#   "--sync-bn --lr LR") shows what wrong data-parallel mathematics gives.
# SEED, BATCH (per rank), LR and DDP_DATA override the defaults (2, 50,
# 0.01, Fashion-MNIST). Needs a release build (build/bin) and a Python with
# torch (DDP_TORCH_PY, default the reference environment's, else Debian's
# /usr/bin/python3). About 25 s for 10 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-10}; shift || true
bin=${DDP_BIN_DIR:-build/bin}
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
[ -x "$py" ] || py=/usr/bin/python3 # Debian's PyTorch 1.13 computes the float64 steps as well
data=${DDP_DATA:-/usr/share/datasets/fashion-mnist}
seed=${SEED:-2}; batch=${BATCH:-50}; lr=${LR:-0.01}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
momentum=0
for ((i = 1; i <= $#; i++)); do [ "${!i}" = --momentum ] && { j=$((i + 1)); momentum=${!j}; }; done

"$bin"/ddp-train --model convnet --data "$data" --epochs 0 --seed "$seed" \
  --save "$work/init.safetensors" >/dev/null 2>&1 ||
  { echo "dp-divergence: writing ddp's initial weights failed" >&2; exit 1; }
"$py" scripts/torch/float64_trajectory.py --data "$data" --init "$work/init.safetensors" \
  --steps "$steps" --batch-size $((2 * batch)) --lr "$lr" --momentum "$momentum" --seed "$seed" --out "$work/ref"
common=(--model convnet --data "$data" --seed "$seed" --init "$work/init.safetensors" "$@")
"$bin"/ddp-train "${common[@]}" --epochs 0 --dump-state "$work/init.txt" >/dev/null 2>&1
read -r -a dp_args <<<"${DP_ARGS:---sync-bn --lr $lr}"
for ((k = 1; k <= steps; k++)); do
  timeout 300 "$bin"/ddprun --nproc-per-node 2 "$bin"/ddp-train "${common[@]}" "${dp_args[@]}" \
    --max-steps "$k" --batch-size "$batch" --dump-state "$work/dp.$k" >/dev/null 2>"$work/dp.err" ||
    { tail -n 5 "$work/dp.err" >&2; exit 1; }
  timeout 300 "$bin"/ddp-train "${common[@]}" --sync-bn --lr "$lr" --max-steps "$k" \
    --batch-size $((2 * batch)) --dump-state "$work/single.$k" >/dev/null 2>"$work/single.err" ||
    { tail -n 5 "$work/single.err" >&2; exit 1; }
done
"$py" - "$work" "$steps" <<'PY'
import math, sys
work, steps = sys.argv[1], int(sys.argv[2])
def load(path):
    out = {}
    for line in open(path):
        f = line.split()
        out[f[0]] = [float(v) for v in f[2:]]
    return out
init = load(f"{work}/init.txt")
def dist(x, y, ref, p0):
    """max|x-y| over max|ref| and over compare_state.py's bound; and
    ||x-y|| over the length of ref's update from the initial state."""
    scale = max(abs(v) for v in ref)
    err = max(abs(a - b) for a, b in zip(x, y))
    l2 = math.sqrt(sum((a - b) ** 2 for a, b in zip(x, y)))
    upd = math.sqrt(sum((a - b) ** 2 for a, b in zip(ref, p0)))
    # A convolution's bias before batch norm gets no gradient (its update
    # is 0 in exact arithmetic): only its max error says something.
    norm = math.sqrt(sum(v * v for v in ref))
    rel_upd = l2 / upd if upd > 1e-3 * norm else 0.0
    return err / scale if scale else err, err / (1e-4 * scale + 1e-6), rel_upd
print(f"{'step':>4}  {'2 ranks vs 1 rank':>40}  {'2 ranks vs float64':>40}  {'1 rank vs float64':>40}")
print(f"{'':>4}  " + "  ".join(f"{'worst tensor':>20} {'rel':>7} {'/bnd':>5} {'upd':>7}" for _ in range(3)))
for k in range(1, steps + 1):
    dp, single, ref = (load(f"{work}/{t}.{k}") for t in ("dp", "single", "ref"))
    names = [n for n in ref if not n.endswith("num_batches_tracked")]
    cols = []
    for x, y in ((dp, single), (dp, ref), (single, ref)):
        d = {n: dist(x[n], y[n], ref[n], init[n]) for n in names}
        worst = max(names, key=lambda n: d[n][1])
        worst_upd = max(d[n][2] for n in names)
        rel, bnd, _ = d[worst]
        cols.append(f"{worst:>20} {rel:7.1e} {bnd:5.2f} {worst_upd:7.1e}")
    print(f"{k:>4}  " + "  ".join(cols))
PY
