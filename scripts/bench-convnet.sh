#!/usr/bin/env bash
# ddp vs PyTorch on one training step of the seed's ConvNet (batch 100, one
# thread, Fashion-MNIST), measured in the same go: the runs alternate, each
# side's figure is the median of its rounds, and the ratio is ddp / PyTorch.
#   scripts/bench-convnet.sh [rounds=5] [steps=150]
# Needs build/bin/bench_convnet (scripts/build.sh) and Debian's python3-torch.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-150}
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_ddp_convnet.py
[ -x build/bin/bench_convnet ] || { echo "bench-convnet: build first (scripts/build.sh)" >&2; exit 2; }
[ -f "$ref" ] || { echo "bench-convnet: $ref not found (set DDP_SHARED_DIR)" >&2; exit 2; }
/usr/bin/python3 -c "import torch" 2>/dev/null || { echo "bench-convnet: needs python3-torch (apt-get install python3-torch)" >&2; exit 2; }

ours=() theirs=()
for r in $(seq "$rounds"); do
  o=$(build/bin/bench_convnet --steps "$steps" --repeats 1 | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p')
  t=$(/usr/bin/python3 "$ref" --world 1 --steps "$steps" 2>/dev/null | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p')
  echo "round $r: ddp $o samples/s, torch $t samples/s" >&2
  ours+=("$o"); theirs+=("$t")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
awk -v o="$mo" -v t="$mt" -v r="$rounds" 'BEGIN {
  printf "convnet batch=100 threads=1: ddp %.0f samples/s, torch %.0f samples/s, ratio %.2fx (median of %d rounds)\n", o, t, o / t, r }'
