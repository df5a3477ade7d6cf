#!/usr/bin/env bash
# Trains the ConvNet on Fashion-MNIST with PyTorch and with ddp-train, like for
# like: the same settings (SGD lr 0.01, momentum 0.9, batch 100, 3 epochs),
# the same initial weights (PyTorch's, written as safetensors and given to
# ddp-train --init) and the same sample order (PyTorch's DistributedSampler at
# one replica, which ddp's sampler reproduces index for index), once for each
# of three seeds. What is left to differ is float summation order, and over
# 1,800 steps that alone moves a single run's test accuracy by a few tenths of
# a point either way (docs/training.md), so one seed cannot tell a real
# difference from noise. Checks (issue 3's bar):
#   - ddp reaches at least 89.5% at the fixed seed (the first listed, 2);
#   - ddp's mean accuracy over the seeds is within 0.5 points of PyTorch's.
# Each seed's PyTorch and ddp runs go side by side (two processes). Without
# python3-torch, ddp trains from its own initial weights at the fixed seed
# and only a sanity floor of 88% is checked (the script says so).
# Usage: scripts/check-accuracy.sh [epochs=3] [seeds="2 1 3"]
set -euo pipefail
cd "$(dirname "$0")/.."
epochs=${1:-3}
read -r -a seeds <<<"${2:-2 1 3}"
data=/usr/share/datasets/fashion-mnist
[ -d "$data" ] || { echo "check-accuracy: SKIP: $data missing (apt-get install dataset-fashion-mnist)"; exit 77; }
bin=${DDP_BIN_DIR:-build/bin}
work=$(mktemp -d)
torch_pid=""
trap '[ -n "$torch_pid" ] && kill "$torch_pid" 2>/dev/null; rm -rf "$work"' EXIT
acc() { /usr/bin/python3 -c 'import json,sys; print(json.loads(sys.argv[1])["test_accuracy"])' "$1"; }
settings() { echo --epochs "$epochs" --batch-size 100 --lr 0.01 --momentum 0.9 --seed "$1"; }
# ddp SEED ARGS...: ddp-train's --json summary line; on failure, its stderr's tail and exit.
ddp() {
  local seed=$1; shift
  timeout 900 "$bin"/ddp-train --model convnet --data "$data" $(settings "$seed") "$@" --json \
    >"$work/ddp$seed.out" 2>"$work/ddp$seed.err" ||
    { echo "check-accuracy: ddp-train failed (seed $seed):" >&2; tail -n 20 "$work/ddp$seed.err" >&2; exit 1; }
  tail -n 1 "$work/ddp$seed.out"
}

if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "check-accuracy: python3-torch not installed: ddp from its own initial weights, against the 88% floor only"
  ours=$(ddp "${seeds[0]}")
  echo "ddp seed ${seeds[0]}: $ours"
  /usr/bin/python3 - "$(acc "$ours")" <<'PY'
import sys
a = float(sys.argv[1])
ok = a >= 0.88
print(f"ddp test accuracy {100*a:.2f}% (floor 88.00%): {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
  exit
fi

results=()   # "seed torch_accuracy ddp_accuracy"
for seed in "${seeds[@]}"; do
  init="$work/init$seed.safetensors"
  timeout 900 /usr/bin/python3 scripts/torch/train_reference.py --data "$data" $(settings "$seed") \
    --save-init "$init" >"$work/torch$seed.out" &
  torch_pid=$!
  # The reference writes its initial weights (temporary name, then rename)
  # before its first step; ddp starts from them while PyTorch trains.
  for _ in $(seq 600); do [ -e "$init" ] || ! kill -0 "$torch_pid" 2>/dev/null && break; sleep 0.1; done
  [ -e "$init" ] || { echo "check-accuracy: train_reference.py (seed $seed) wrote no $init: it exited first or took over 60 s" >&2
                      cat "$work/torch$seed.out" >&2; exit 1; }
  ours=$(ddp "$seed" --init "$init")
  wait "$torch_pid" || { echo "check-accuracy: train_reference.py failed (seed $seed)" >&2; exit 1; }
  torch_pid=""
  theirs=$(tail -n 1 "$work/torch$seed.out")
  echo "seed $seed torch: $theirs"
  echo "seed $seed ddp:   $ours"
  results+=("$seed $(acc "$theirs") $(acc "$ours")")
done

/usr/bin/python3 - "${results[@]}" <<'PY'
import sys
rows = [r.split() for r in sys.argv[1:]]
rows = [(s, float(t), float(a)) for s, t, a in rows]
for s, t, a in rows:
    print(f"seed {s}: ddp {100*a:.2f}%  torch {100*t:.2f}%  difference {100*(a-t):+.2f} points")
s0, _, a0 = rows[0]
ok_floor = a0 >= 0.895
print(f"ddp at the fixed seed {s0}: {100*a0:.2f}% (floor 89.50%): {'ok' if ok_floor else 'FAIL'}")
mt = sum(t for _, t, _ in rows) / len(rows)
ma = sum(a for _, _, a in rows) / len(rows)
ok_mean = abs(ma - mt) <= 0.005
print(f"mean over {len(rows)} seeds: ddp {100*ma:.2f}%  torch {100*mt:.2f}%  difference {100*(ma-mt):+.2f} points "
      f"(limit 0.50): {'ok' if ok_mean else 'FAIL'}")
sys.exit(0 if ok_floor and ok_mean else 1)
PY
