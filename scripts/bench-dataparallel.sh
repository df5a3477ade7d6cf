#!/usr/bin/env bash
# Seed 003's comparison, measured in one go: one process with replicas
# against one process per replica, in ddp and in PyTorch. Seed 001's ConvNet
# on Fashion-MNIST, 200 samples a step in all four (2 x 100 or 1 x 200),
# SGD lr 0.01 momentum 0.9, one BLAS thread per replica:
#   ddp-dp     ddp-train --replicas 2 --batch-size 200      (DataParallel: 2 threads, 1 process)
#   ddp-ddp    ddprun --nproc-per-node 2 ddp-train --batch-size 100   (DDP: 2 processes)
#   torch-ddp  refs/torch_ddp_convnet.py --world 2 --batch 100 --threads 1   (PyTorch DDP, gloo)
#   torch-dp   scripts/torch/dataparallel_convnet.py --threads 2 --batch 200
#              (torch.nn.DataParallel in one process: on the CPU it runs the
#              module as it is, so its parallelism is 2 intra-op threads)
# Each reports samples/s over S steps after 10 warm-up steps. The order of
# the four rotates every round; each figure is the median of its rounds,
# and ddp-dp / ddp-ddp is also the median of each round's own ratio (the
# two ran seconds apart, so slow drifts of the machine cancel). The bar
# (issue 43): ddp-dp >= 0.95 x ddp-ddp.
#   scripts/bench-dataparallel.sh [rounds=5] [steps=200]
# Env: DDP_SHARED_DIR (where refs/ is; default ../shared), DDP_TORCH_PY
# (default /opt/torch-venv/bin/python, scripts/install-deps.sh refs),
# BENCH_SIDES (default "ddp-dp ddp-ddp torch-ddp torch-dp").
# Needs build/bin/{ddprun,ddp-train} (scripts/build.sh release) and the
# Fashion-MNIST package (scripts/install-deps.sh data).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-200}
sides=(${BENCH_SIDES:-ddp-dp ddp-ddp torch-ddp torch-dp})
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_ddp_convnet.py
die() { echo "bench-dataparallel: $*" >&2; exit 2; }
[ -x build/bin/ddprun ] && [ -x build/bin/ddp-train ] || die "build first (scripts/build.sh release)"
needs_torch=0
for s in "${sides[@]}"; do [[ $s == torch-* ]] && needs_torch=1; done
if (( needs_torch )); then
  [ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR to the folder holding refs/)"
  "$py" -c "import torch" 2>/dev/null || die "$py cannot import torch (scripts/install-deps.sh refs, or set DDP_TORCH_PY)"
fi
cores=$(nproc)
[ "$cores" -ge 2 ] || echo "bench-dataparallel: note: 2 replicas on $cores core(s) oversubscribe" >&2

# --workers 0: batches gathered inline in every ddp run, as the references'
# DataLoader (num_workers=0) does, so that no side has a loader thread on
# the core another side's second replica computes on.
ddp_common=(--model convnet --threads 1 --workers 0 --lr 0.01 --momentum 0.9 --seed 1
            --max-steps $((steps + 10)) --json)
json_sps() { /usr/bin/python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["steady_samples_per_s"])' 2>/dev/null; }
run_ddp-dp() {
  timeout 900 build/bin/ddp-train "${ddp_common[@]}" --replicas 2 --batch-size 200 2>/dev/null |
    tail -n 1 | json_sps
}
run_ddp-ddp() {
  timeout 900 build/bin/ddprun --nproc-per-node 2 build/bin/ddp-train "${ddp_common[@]}" \
    --batch-size 100 2>/dev/null | tail -n 1 | json_sps
}
run_torch-ddp() {
  timeout 900 "$py" "$ref" --world 2 --steps "$steps" --threads 1 --batch 100 \
    --port $((20000 + RANDOM % 20000)) 2>/dev/null | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p'
}
run_torch-dp() {
  timeout 900 "$py" scripts/torch/dataparallel_convnet.py --threads 2 --batch 200 --steps "$steps" \
    2>/dev/null | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p'
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

declare -A runs last
echo "load before: $(uptime | sed 's/.*load average/load average/')" >&2
n=${#sides[@]}
for r in $(seq "$rounds"); do
  k=$(( (r - 1) % n ))
  order=("${sides[@]:$k}" "${sides[@]:0:$k}")
  for side in "${order[@]}"; do
    v=$("run_$side")
    [ -n "$v" ] || die "round $r: $side gave no figure (run it by hand to see why)"
    runs[$side]+="$v "
    last[$side]=$v
    echo "round $r: $side $v samples/s" >&2
  done
  if [ -n "${last[ddp-dp]:-}" ] && [ -n "${last[ddp-ddp]:-}" ]; then
    runs[ratio]+="$(awk -v a="${last[ddp-dp]}" -v b="${last[ddp-ddp]}" 'BEGIN { print a / b }') "
  fi
done
echo "load after: $(uptime | sed 's/.*load average/load average/')" >&2

declare -A med
for key in "${!runs[@]}"; do med[$key]=$(median ${runs[$key]}); done
echo "ConvNet on Fashion-MNIST, 200 samples a step, $steps steps, median of $rounds rounds ($cores cores)"
printf '%-10s %12s  %s\n' side samples/s "rounds"
for side in "${sides[@]}"; do
  printf '%-10s %12.0f  %s\n' "$side" "${med[$side]}" "${runs[$side]}"
done
ratio() { # a b -> "a/b" as x.xx, or "-"
  [ -n "${med[$1]:-}" ] && [ -n "${med[$2]:-}" ] && awk -v a="${med[$1]}" -v b="${med[$2]}" 'BEGIN { printf "%.3f", a / b }' || echo -
}
echo "ddp-dp / ddp-ddp:    $(ratio ddp-dp ddp-ddp) (medians); $( [ -n "${med[ratio]:-}" ] && printf '%.3f' "${med[ratio]}" || echo -) (median of the rounds' own ratios); bar >= 0.95"
echo "ddp-dp / torch-ddp:  $(ratio ddp-dp torch-ddp)"
echo "ddp-dp / torch-dp:   $(ratio ddp-dp torch-dp)"
echo "ddp-ddp / torch-ddp: $(ratio ddp-ddp torch-ddp)"
echo "ddp-ddp / torch-dp:  $(ratio ddp-ddp torch-dp)"
