#!/usr/bin/env bash
# Issue 36: where async's lift from its tail sits, in the parameters or in
# BatchNorm's running statistics. Each async run (ConvNet, 1 epoch, 1 server
# + 2 trainers) writes the model when the first trainer stops
# (DDP_PS_SNAPSHOT) and its final model (--save); two mixes are written
# (parameters before the tail with the statistics after it, and the
# reverse) and all four are evaluated with `ddp-train --init M --epochs 0`.
# The final model's accuracy is checked against the run's own.
# usage: scripts/ps-tail-mix.sh [BUILD_DIR]   (SEEDS, default "1 2 3";
#   PYTHON, default /opt/torch-venv/bin/python, needs the safetensors package)
set -uo pipefail
bin=${1:-build}/bin
seeds=${SEEDS:-"1 2 3"}
py=${PYTHON:-/opt/torch-venv/bin/python}
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
acc() { "$bin/ddp-train" --model convnet --init "$1" --epochs 0 --json 2>"$d/eval.err" | tail -1 |
        python3 -c 'import json,sys; print("%.2f" % (100*json.load(sys.stdin)["test_accuracy"]))'; }
echo "load before: $(cat /proc/loadavg); $(date -u +%FT%TZ)"
printf "%-5s %5s %8s %8s %22s %22s\n" seed tail before after "params before+stats after" "params after+stats before"
for seed in $seeds; do
  rm -f "$d"/*.st*
  DDP_PS_STALENESS=1 DDP_PS_SNAPSHOT="$d/snap.st" timeout 1800 "$bin/ddprun" --nproc-per-node 3 \
    "$bin/ddp-train" --model convnet --epochs 1 --lr 0.01 --momentum 0.9 --param-servers 1 \
    --ps-mode async --seed "$seed" --json --save "$d/final.st" >"$d/out" 2>"$d/err" || { tail "$d/err"; exit 1; }
  "$py" - "$d/snap.st" "$d/final.st" "$d/pb.st" "$d/bp.st" <<'PY' || exit 1
import sys
from safetensors.torch import load_file, save_file
s, f = load_file(sys.argv[1]), load_file(sys.argv[2])
stat = lambda k: "running_" in k or "num_batches_tracked" in k
save_file({k: f[k] if stat(k) else s[k] for k in s}, sys.argv[3], metadata={"format": "pt"})
save_file({k: s[k] if stat(k) else f[k] for k in s}, sys.argv[4], metadata={"format": "pt"})
PY
  run=$(tail -1 "$d/out" | python3 -c 'import json,sys; print("%.2f" % (100*json.load(sys.stdin)["test_accuracy"]))')
  before=$(acc "$d/snap.st"); after=$(acc "$d/final.st"); pb=$(acc "$d/pb.st"); bp=$(acc "$d/bp.st")
  [ "$after" = "$run" ] || { echo "seed $seed: the saved final model scores $after, the run $run"; exit 1; }
  read -r lo hi < <(grep -o 'spanned [0-9]*\.\.[0-9]*' "$d/err" | tr -c '0-9\n' ' ' | awk '{print $1, $2}')
  printf "%-5s %5s %8s %8s %22s %22s\n" "$seed" "$((hi - lo))" "$before" "$after" "$pb" "$bp"
done
echo "load after: $(cat /proc/loadavg)"
