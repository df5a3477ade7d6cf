#!/usr/bin/env bash
# The tools' GPU options on a machine without a GPU (issue 39): what each
# refuses, before any work starts, saying why and what to do; and
# ddp-train --pp with stages on a GPU no longer refused by the pipeline
# (only by the missing device). On a machine
# with a GPU the refusals that need its absence are skipped (scripts/
# gpu-check.sh runs the GPU paths there).
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR
export DDP_TIMEOUT=60
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# expect_refusal NAME PATTERN CMD...: exit status 2 and PATTERN on stderr.
expect_refusal() {
  local name=$1 pattern=$2
  shift 2
  timeout 60 "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc -eq 2 ] || fail "$name: exit $rc, expected 2: $(cat "$tmp/err")"
  grep -Eq -- "$pattern" "$tmp/err" || fail "$name: stderr lacks /$pattern/: $(cat "$tmp/err")"
  echo "ok: $name: $(head -1 "$tmp/err")"
}

# Every tool rejects a device that is no device, naming the spellings.
expect_refusal "mnist_ddp --device tpu" 'device "tpu": expected cpu, cuda or cuda:N' \
  "$bin/mnist_ddp" --device tpu
expect_refusal "ddp-hpo --device tpu" 'expected cpu, cuda or cuda:N' \
  "$bin/ddp-hpo" --objective convnet --device tpu
expect_refusal "model_parallel_hpc --device tpu" 'expected cpu, cuda or cuda:N' \
  "$bin/model_parallel_hpc" --device tpu
# ddp-hpo's --device is convnet's.
expect_refusal "ddp-hpo sphere --device cuda" 'applies to --objective convnet' \
  "$bin/ddp-hpo" --objective sphere --device cuda

if [ ! -e /dev/nvidia0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  expect_refusal "mnist_ddp --device cuda (no GPU)" 'no CUDA device here .*run with --device cpu' \
    "$bin/mnist_ddp" --device cuda
  expect_refusal "ddp-hpo --device cuda (no GPU)" 'no CUDA device here .*run with --device cpu' \
    "$bin/ddp-hpo" --objective convnet --device cuda
  expect_refusal "model_parallel_hpc --device cuda (no GPU)" 'no CUDA device here .*run with --device cpu' \
    "$bin/model_parallel_hpc" --device cuda
else
  echo "note: a GPU is here: the no-GPU refusals are not checked"
fi

# ddp-train --pp 2 --device cuda:0 under ddprun: accepted by the pipeline
# (stages on GPUs, issue 39), so without a GPU what stops it is the
# device's own refusal, naming the device, not the pipeline's
# (DDP_BACKEND=ddp keeps the group on the CPU). With a GPU, gpu-pp-steps.sh
# and test_cuda_pipeline run it.
if [ ! -e /dev/nvidia0 ] && ! nvidia-smi -L >/dev/null 2>&1; then
  DDP_BACKEND=ddp DDP_GPU_AFFINITY=off timeout 120 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-train" \
    --model toy --samples 256 --batch-size 16 --epochs 1 --pp 2 --device cuda:0 >"$tmp/pp.out" 2>"$tmp/pp.err"
  rc=$?
  [ $rc -ne 0 ] || fail "ddp-train --pp 2 --device cuda:0 succeeded without a GPU"
  grep -q "pipeline: stages on" "$tmp/pp.err" && fail "the pipeline still refuses GPUs: $(cat "$tmp/pp.err")"
  grep -Eq "cuda:0: (CUDA is unavailable|.*no CUDA)|no CUDA device|this build has no CUDA" "$tmp/pp.err" ||
    fail "ddp-train --pp --device cuda without a GPU: not the device's refusal: $(cat "$tmp/pp.err")"
  echo "ok: ddp-train --pp 2 --device cuda:0 accepted by the pipeline; refused for want of the device"
fi
echo "PASS"
