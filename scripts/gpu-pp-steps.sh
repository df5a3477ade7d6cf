#!/usr/bin/env bash
# Issue 39's pipeline on GPUs (ddp-train --pp with stages on GPUs, seed
# 000's model_parallel_hpc --device cuda), one step per call, for
# scripts/gpu-check.sh and for CTest's test_cuda_pipeline (docs/pipeline.md,
# "Stages on GPUs"). Two ranks share the one GPU as in gpu-dp-steps.sh:
# each its own NCCL_HOSTID (NCCL then takes them for two hosts and uses its
# socket transport), NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1.
#
#   pp1  the ConvNet (BatchNorm) as 2 stages split at layer2, 4 micro-batches
#        of 25, 10 steps of SGD with momentum: stages on the GPU, activations
#        and gradients by NCCL's send/recv, equal the same pipeline on the
#        CPU within docs/parallel.md's bound (compare_state.py --init: 1e-2
#        of each tensor's update), both ranks' gathered models identical
#   pp2  the same on ddp's own backend (DDP_BACKEND=ddp: the CUDA buffers
#        staged through pinned host memory, what runs where NCCL cannot),
#        against the same CPU pipeline
#   pp3  checkpoints of the GPU pipeline: 5 steps saved and resumed to 10
#        equal 10 straight, bit for bit (after two straight runs agree), and
#        the GPU pipeline's checkpoint loads in a CPU run (--init) giving the
#        same tensors exactly
#   pp4  model_parallel_hpc --device cuda under ddprun: 2 stages x 2
#        replicas (4 ranks on the one GPU), its own checks (layout, the loss
#        falling, replicas identical) all ok
#   all  pp1 .. pp4 in turn (CTest)
#
# Usage: scripts/gpu-pp-steps.sh STEP DATA   (DDP_BIN_DIR: ddp-train, ddprun,
#   model_parallel_hpc). GPU_PP_DEVICE=cpu runs the GPU side on the CPU (a
#   dry run of this script's logic where there is no GPU).
# Exit: 0 pass, 1 fail, 77 skip (no GPU: "no CUDA device" on stdout).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
step=${1:?step}

if [ "$step" = rank ]; then # ddprun's PROGRAM: a rank with its own NCCL_HOSTID
  shift
  export NCCL_HOSTID=ddp-gpu-pp-${LOCAL_RANK:?} NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
  exec "$@"
fi

data=${2:?data}
bin=${DDP_BIN_DIR:?}/ddp-train
ddprun=${DDP_BIN_DIR}/ddprun
mph=${DDP_BIN_DIR}/model_parallel_hpc
py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
tmp=$(mktemp -d /tmp/gpu-pp.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR DDP_TRACE_FILE
export DDP_TIMEOUT=${DDP_TIMEOUT:-60}
. "$here/tests/support/free_port.sh"

dev=${GPU_PP_DEVICE:-cuda}
# No GPU: say so the way gpu-check.sh recognises, and skip.
if ! timeout 60 "$bin" --model toy --device "$dev" --max-steps 1 --json >"$tmp/probe" 2>&1; then
  if grep -qi 'cuda\|gpu' "$tmp/probe"; then
    echo "SKIP: no CUDA device: $(tail -n 1 "$tmp/probe")"
    exit 77
  fi
  cat "$tmp/probe"
  fail "ddp-train --device $dev failed"
fi

[ -d "$data" ] || { echo "SKIP: no Fashion-MNIST at $data"; exit 77; }

# world2 TAG NCCL ARGS...: 2 ranks of ddp-train (rank r's output in
# TAG.out.r, TAG.err.r), each under a timeout; NCCL=1 gives each its own
# NCCL_HOSTID (two ranks sharing the GPU on nccl), 0 leaves it unset.
world2() {
  local tag=$1 nccl=$2 port r rc=0
  shift 2
  port=$(ddp_free_port) || fail "no free port"
  pids=()
  for r in 0 1; do
    local hostid=()
    [ "$nccl" = 1 ] && hostid=(NCCL_HOSTID=ddp-gpu-pp-$r NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1)
    env MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
      "${hostid[@]}" timeout 150 "$bin" "$@" >"$tmp/$tag.out.$r" 2>"$tmp/$tag.err.$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  grep -h 'training on' "$tmp/$tag.err.0" | head -n 1
  [ $rc -eq 0 ] || { tail -n 8 "$tmp/$tag".err.*; fail "$tag: a rank exited $rc"; }
}
small() { # a test set of 1000 images, so evaluations stay short
  [ -d "$tmp/small" ] || "$py" "$here/tests/support/fashion_small.py" "$data" "$tmp/small" 1000 >/dev/null ||
    fail "fashion_small.py"
  echo "$tmp/small"
}
# The pipeline both sides run: the ConvNet split at layer2 (its BatchNorm
# in stage 0, the classifier in stage 1), 4 micro-batches of 25.
conv() { echo --model convnet --data "$(small)" --seed 2 --lr 0.01 --momentum 0.9 --batch-size 100 \
  --pp 2 --split layer2 --microbatches 4 --workers 0; }
# The CPU pipeline's state after 10 steps (and the initial state), once.
cpu_reference() {
  [ -s "$tmp/cpu.0" ] && return
  "$bin" --model convnet --data "$(small)" --seed 2 --device cpu --epochs 0 --dump-state "$tmp/init" \
    >/dev/null 2>&1 || fail "the ConvNet's initial state"
  # shellcheck disable=SC2046 # conv's words
  DDP_BACKEND=ddp world2 cpu 0 $(conv) --device cpu --max-steps 10 --dump-state "$tmp/cpu.{rank}"
}
# against_cpu TAG: TAG's ranks agree and equal the CPU pipeline within the bound.
against_cpu() {
  cmp -s "$tmp/$1.0" "$tmp/$1.1" || fail "$1: the two ranks' gathered models differ"
  "$py" "$here/tests/train/compare_state.py" "$tmp/$1.0" "$tmp/cpu.0" --init "$tmp/init" ||
    fail "$1: the pipeline on $dev is not the CPU pipeline within docs/parallel.md's bound"
}

run_step() {
case $1 in
pp1)
  cpu_reference
  # shellcheck disable=SC2046
  world2 nccl 1 $(conv) --device "$dev" --max-steps 10 --dump-state "$tmp/nccl.{rank}"
  grep -h 'gradients over backend' "$tmp/nccl.err.0" | head -n 1
  against_cpu nccl
  echo "ok: pp1: 2 stages on $dev (activations by the group's send/recv) == the CPU pipeline after 10 steps; ranks identical"
  ;;
pp2)
  cpu_reference
  # shellcheck disable=SC2046
  DDP_BACKEND=ddp world2 staged 0 $(conv) --device "$dev" --max-steps 10 --dump-state "$tmp/staged.{rank}"
  against_cpu staged
  echo "ok: pp2: 2 stages on $dev over ddp's own backend (staged through pinned host memory) == the CPU pipeline"
  ;;
pp3)
  # shellcheck disable=SC2046
  {
    world2 a 1 $(conv) --device "$dev" --max-steps 10 --save "$tmp/a.safetensors" --dump-state "$tmp/a.{rank}"
    world2 a2 1 $(conv) --device "$dev" --max-steps 10 --save "$tmp/a2.safetensors"
    world2 b 1 $(conv) --device "$dev" --max-steps 5 --save "$tmp/b.safetensors"
    world2 c 1 $(conv) --device "$dev" --max-steps 10 --resume "$tmp/b.safetensors" --save "$tmp/c.safetensors"
  }
  same() { "$py" "$here/tests/train/st_compare.py" "$1.safetensors" "$2.safetensors" &&
    "$py" "$here/tests/train/st_compare.py" "$1.train.safetensors" "$2.train.safetensors"; }
  same "$tmp/a" "$tmp/a2" || fail "two straight pipeline runs on $dev differ: resume cannot be judged"
  same "$tmp/a" "$tmp/c" || fail "5 steps + --resume to 10 on $dev is not 10 straight, bit for bit"
  "$bin" --model convnet --data "$(small)" --seed 2 --device cpu --epochs 0 --init "$tmp/a.safetensors" \
    --dump-state "$tmp/a-cpu" >"$tmp/a-cpu.out" 2>&1 || { tail -n 5 "$tmp/a-cpu.out"; fail "a CPU run --init the GPU pipeline's checkpoint"; }
  "$py" "$here/tests/train/compare_state.py" "$tmp/a-cpu" "$tmp/a.0" --exact ||
    fail "the GPU pipeline's checkpoint loaded on the CPU is not its trained model"
  echo "ok: pp3: the pipeline on $dev resumes bit for bit; its checkpoint loads in a CPU run, every tensor equal"
  ;;
pp4)
  [ -x "$mph" ] || { echo "SKIP: no model_parallel_hpc carried"; exit 77; }
  [ -x "$ddprun" ] || { echo "SKIP: no ddprun carried"; exit 77; }
  timeout 240 "$ddprun" --nproc-per-node 4 "$here/scripts/gpu-pp-steps.sh" rank "$mph" --groups_size 2 \
    --group_per_node 2 --batch_size 256 --samples 16384 --max_steps 40 --device "$dev" >"$tmp/mph.out" 2>&1
  rc=$?
  grep -v '^\[' "$tmp/mph.out" | tail -n 12
  [ $rc -eq 0 ] || fail "model_parallel_hpc --device $dev exited $rc"
  grep -q FAIL "$tmp/mph.out" && fail "model_parallel_hpc --device $dev: a check failed"
  grep -q "head and tail identical on all 4 ranks: ok" "$tmp/mph.out" || fail "model_parallel_hpc: no replica check"
  echo "ok: pp4: model_parallel_hpc --device $dev, 2 stages x 2 replicas: its checks ok"
  ;;
*) echo "gpu-pp-steps: unknown step '$1'" >&2; exit 2 ;;
esac
}

if [ "$step" = all ]; then
  for s in pp1 pp2 pp3 pp4; do run_step "$s"; done
else
  run_step "$step"
fi
