#!/usr/bin/env bash
# The seeds' model-parallel programs in examples/ (issue 23), under ddprun
# (a timeout on every run), each checked by what it prints:
#   toy_mp_stages       seed 001's demo_model_parallel: ToyMpModel as 2 stages,
#                       1 replica (2 ranks) and 2 replicas (4 ranks): every
#                       stage's parameters after the step equal the unsplit
#                       model's step on all replicas' samples
#   model_parallel_hpc  seed 000's head/tail model, --groups_size 2
#                       --group_per_node 2 (4 ranks on one node): the layout,
#                       the loss falling, the replicas identical after training
# Usage: test_examples_pipeline.sh [NAME...] (default: both).
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
[ -x "$bin/ddprun" ] || fail "$bin/ddprun is not built"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR
export DDP_TIMEOUT=60
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() { # N OUT NAME ARGS...: N ranks; output in $tmp/OUT
  local n=$1 out=$2 name=$3; shift 3
  timeout 180 "$bin/ddprun" --nproc-per-node "$n" "$bin/$name" "$@" >"$tmp/$out" 2>&1 \
    || { tail -n 20 "$tmp/$out"; fail "$name on $n ranks exited $?"; }
}
expect() { # OUT PATTERN COUNT: exactly COUNT lines match
  local n; n=$(grep -cE -- "$2" "$tmp/$1")
  [ "$n" -eq "$3" ] || { cat "$tmp/$1"; fail "$1: expected $3 line(s) matching '$2', got $n"; }
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(toy_mp_stages model_parallel_hpc)
for name in "${names[@]}"; do
  case $name in
  toy_mp_stages)
    run 2 mp2 toy_mp_stages
    expect mp2 "^rank 0: stage 0 of 2 \(net1.weight, net1.bias\), replica 0 of 1: .* all 20 samples .*: ok$" 1
    expect mp2 "^rank 1: stage 1 of 2 \(net2.weight, net2.bias\), replica 0 of 1: .* all 20 samples .*: ok$" 1
    run 4 mp4 toy_mp_stages
    expect mp4 "^rank [0-3]: stage [01] of 2 .*, replica [01] of 2: .* all 40 samples .*: ok$" 4
    expect mp4 "^rank [13]: replica [01]'s loss [0-9.]+ over 2 micro-batches$" 2 ;;
  model_parallel_hpc)
    run 4 hpc model_parallel_hpc --groups_size 2 --group_per_node 2 --samples 65536
    expect hpc "^rank [0-3]: replica [01] of 2, stage [01] of 2 \((head|tail)\), node 0 .*: ok$" 4
    expect hpc "^loss over all replicas: first .*: ok$" 1
    expect hpc "^replicas after 32 steps: head and tail identical on all 4 ranks: ok$" 1
    expect hpc "^stage [01]: idle [0-9.]+% of its steps, activations at most [1-9][0-9]* bytes" 2 ;;
  *) fail "unknown example $name" ;;
  esac
  echo "ok $name"
done
