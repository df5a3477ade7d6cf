#!/usr/bin/env bash
# The seeds' data-parallel programs in examples/, each under ddprun with 2
# ranks (a timeout on every run), each checked by what it prints:
#   ddp_basic       the gradient is the mean of the ranks' gradients, replicas equal
#   toydata_ddp     the sampler's shards cover the data once, the loss falls
#   mnist_ddp       the test set is counted once over the ranks, the loss falls
#   ddp_checkpoint  rank 0's saved parameters are what every rank loads
#   train_api       the trainer's C API: a callback stops both ranks at step 60
#   hpo_ddp         seed 002's tutorial: a search whose individuals train data-parallel
# Usage: test_examples_ddp.sh [NAME...] (default: all that are built).
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
[ -x "$bin/ddprun" ] || fail "$bin/ddprun is not built"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR
export DDP_TIMEOUT=60
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() { # NAME ARGS...: 2 ranks; output in $tmp/NAME
  local name=$1; shift
  timeout 180 "$bin/ddprun" --nproc-per-node 2 "$bin/$name" "$@" >"$tmp/$name" 2>&1 \
    || { tail -n 20 "$tmp/$name"; fail "$name exited $?"; }
}
expect() { # NAME PATTERN [COUNT]
  local n; n=$(grep -cE -- "$2" "$tmp/$1")
  [ "$n" -ge "${3:-1}" ] || { cat "$tmp/$1"; fail "$1: expected ${3:-1} line(s) matching '$2', got $n"; }
}

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(ddp_basic toydata_ddp mnist_ddp ddp_checkpoint train_api hpo_ddp)
for name in "${names[@]}"; do
  case $name in
  ddp_basic)
    run ddp_basic
    expect ddp_basic "^rank [01]: loss [0-9.]+; gradient = mean of the 2 ranks' gradients \(max diff 0\); replicas after the step: identical .*: ok$" 2 ;;
  toydata_ddp)
    run toydata_ddp --samples 65536 --epochs 2
    expect toydata_ddp "^sampler: the 2 ranks' shards of every epoch hold each of the 65536 samples once \(plus 0 padding repeats\): yes$"
    expect toydata_ddp "^loss over all ranks: first .*: ok$" ;;
  mnist_ddp)
    data=/usr/share/datasets/fashion-mnist
    if [ ! -e "$data/t10k-labels-idx1-ubyte.gz" ] && [ ! -e "$data/t10k-labels-idx1-ubyte" ]; then
      echo "note: $data is not installed (install-deps.sh data): mnist_ddp not run"; continue
    fi
    run mnist_ddp --max-steps 20 --lr 0.01 --eval-samples 1001
    expect mnist_ddp "over 1001 samples \(each counted once: yes\): ok$" ;;
  train_api)
    data=/usr/share/datasets/fashion-mnist
    if [ ! -e "$data/t10k-labels-idx1-ubyte.gz" ] && [ ! -e "$data/t10k-labels-idx1-ubyte" ]; then
      echo "note: $data is not installed (install-deps.sh data): train_api not run"; continue
    fi
    # The step callback asks to stop after 60 steps: both ranks stop there
    # and the result says why; the ConvNet has learnt something by then.
    run train_api 60
    expect train_api "^step 50: loss [0-9.]+, [0-9]+ samples/s$"
    expect train_api "^trained 60 steps on 2 rank\(s\), stopped by callback: test accuracy ([6-9][0-9]|100)\.[0-9]+%" ;;
  hpo_ddp)
    data=/usr/share/datasets/fashion-mnist
    if [ ! -e "$data/t10k-labels-idx1-ubyte.gz" ] && [ ! -e "$data/t10k-labels-idx1-ubyte" ]; then
      echo "note: $data is not installed (install-deps.sh data): hpo_ddp not run"; continue
    fi
    # Seed 002's tutorial: 1 worker of 2 ranks, 3 individuals, each trained
    # data-parallel; rank 0 names the best with a finite loss.
    run hpo_ddp 3 2
    expect hpo_ddp "^3 individuals on island 0; best: conv_layers=[0-9]+ activation=(relu|sigmoid|tanh) lr=[0-9.e-]+ gamma=[0-9.]+, loss [0-9]+\.[0-9]+ \(worker 0, generation [0-2]\)$" ;;
  ddp_checkpoint)
    run ddp_checkpoint
    expect ddp_checkpoint "^rank [01]: loaded rank 0's checkpoint: .*: ok$" 2 ;;
  *) fail "unknown example $name" ;;
  esac
  echo "ok $name"
done
