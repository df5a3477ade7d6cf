#!/usr/bin/env bash
# Issue 25: async and ssp:2 train the ConvNet to within 1 point of
# data-parallel accuracy in the same number of epochs, mean of 3 seeds.
# Data parallel: 2 ranks; parameter server: 1 server + 2 trainers (the same
# 2 data shards); ConvNet on Fashion-MNIST, SGD lr 0.01 momentum 0.9, batch
# 100 per rank/trainer, EPOCHS epochs (default 2), seeds 1 2 3.
# usage: scripts/check-ps-accuracy.sh [BUILD_DIR]   (prints a table; exit 1 on a miss)
set -uo pipefail
build=${1:-build}
bin=$build/bin
epochs=${EPOCHS:-2}
seeds=${SEEDS:-"1 2 3"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--model convnet --epochs "$epochs" --batch-size 100 --lr 0.01 --momentum 0.9 --json)
acc() { python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["test_accuracy"])' "$1"; }
declare -A sum
for seed in $seeds; do
  for cfg in dp async ssp:2; do
    case $cfg in
      dp) args=(--nproc-per-node 2 "$bin/ddp-train" "${common[@]}" --seed "$seed") ;;
      *) args=(--nproc-per-node 3 "$bin/ddp-train" "${common[@]}" --seed "$seed" --param-servers 1 --ps-mode "$cfg") ;;
    esac
    timeout 1800 "$bin/ddprun" "${args[@]}" >"$tmp/out" 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
    a=$(acc "$tmp/out")
    printf "seed %s %-6s %.4f\n" "$seed" "$cfg" "$a"
    sum[$cfg]=$(python3 -c "print(${sum[$cfg]:-0} + $a)")
  done
done
n=$(echo $seeds | wc -w)
python3 - "$n" "${sum[dp]}" "${sum[async]}" "${sum[ssp:2]}" <<'PY'
import sys
n = int(sys.argv[1]); dp, a, s = (float(x) / n for x in sys.argv[2:])
print(f"mean test accuracy over {n} seeds: data parallel {100*dp:.2f}%, async {100*a:.2f}% ({100*(a-dp):+.2f}), ssp:2 {100*s:.2f}% ({100*(s-dp):+.2f})")
ok = a >= dp - 0.01 and s >= dp - 0.01
print("PASS" if ok else "FAIL: more than 1 point below data parallel")
sys.exit(0 if ok else 1)
PY
