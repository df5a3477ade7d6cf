#!/usr/bin/env bash
# Issue 39's data-parallel checks on a GPU, one per call, for
# scripts/gpu-check.sh (steps n2..n4; docs/cuda.md, "Checking on a GPU").
# Two ranks share the one GPU: each has its own NCCL_HOSTID (NCCL then takes
# them for two hosts and uses its socket transport), NCCL_SOCKET_IFNAME=lo,
# NCCL_IB_DISABLE=1, as test_nccl_ops does. Ranks are started by hand with
# torchrun's variables (n2, n4) or by ddprun through this script's `rank`
# mode, which sets the rank's NCCL_HOSTID and records its pid (n3).
#
#   n2  ConvNet --sync-bn, 10 steps: 2 ranks x batch 50 on the GPU end with
#       the same state on both ranks and within docs/parallel.md's bound
#       (compare_state.py --init: 1e-2 of each tensor's update) of 1 rank
#       x batch 100 on the GPU
#   n2acc  3 epochs at world 2 (2 x 50, --sync-bn): test accuracy >= 89 %
#   n3kill rank 1 SIGKILLed during training (ddprun --may-fail 1): rank 0
#       fails within 10 s, its error naming rank 1
#   n3stop rank 1 SIGSTOPped: the job ends by its timeout (DDP_TIMEOUT=8)
#       with the flight recorder's verdict naming rank 1
#   n4  --save / --resume on the GPU: 20 steps + resume to 40 = 40 straight,
#       bit for bit (model and training state; a straight run repeated
#       first shows the GPU run itself is reproducible); the GPU checkpoint
#       loads with strict=True in PyTorch (tests/io/torch_interop.py, when
#       the safetensors package is there) and in a CPU run (--init, --resume)
#   n6numa  the rank's CPUs near its GPU: ddp-train's decision (DDP_DEBUG=info)
#       and what sysfs says of the GPU's node
#   n7mnist mnist_ddp --device cuda at world 2 on NCCL: its checks say ok
#   n8hpo   ddp-hpo --objective convnet --device cuda, a worker of 2 ranks
#   (the pipeline's stages on the GPU, once n9pp here: scripts/gpu-pp-steps.sh)
#   n5  ddp-bench allreduce --device cuda (NCCL) vs PyTorch's all_reduce
#       (scripts/torch/allreduce_bench.py), world 2, 1-64 MiB, alternating
#       rounds: torch time / ddp time >= 0.95 at every size
#
# Usage: scripts/gpu-dp-steps.sh STEP DATA   (DDP_BIN_DIR: ddp-train, ddprun, ddp-bench)
#   GPU_DP_DEVICE=cpu runs the same steps on the CPU (a dry run of this
#   script's logic where there is no GPU; n2acc takes minutes there).
# Exit: 0 pass, 1 fail, 77 skip (no GPU: "no CUDA device" on stdout).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
step=${1:?step}

if [ "$step" = rank ]; then # ddprun's PROGRAM: rank mode
  shift
  export NCCL_HOSTID=ddp-gpu-check-${LOCAL_RANK:?} NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1
  [ -n "${GPU_DP_PIDS:-}" ] && echo $$ >"$GPU_DP_PIDS.$LOCAL_RANK"
  exec "$@"
fi

data=${2:?data}
bin=${DDP_BIN_DIR:?}/ddp-train
ddprun=${DDP_BIN_DIR}/ddprun
py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
tmp=$(mktemp -d /tmp/gpu-dp.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR
export DDP_TIMEOUT=${DDP_TIMEOUT:-60}
. "$here/tests/support/free_port.sh"

dev=${GPU_DP_DEVICE:-cuda}
# No GPU: say so the way gpu-check.sh recognises, and skip.
if ! "$bin" --model toy --device "$dev" --max-steps 1 --json >"$tmp/probe" 2>&1; then
  if grep -qi 'cuda\|gpu' "$tmp/probe"; then
    echo "SKIP: no CUDA device: $(tail -n 1 "$tmp/probe")"
    exit 77
  fi
  cat "$tmp/probe"
  fail "ddp-train --device $dev failed"
fi

# world2 TAG ARGS...: 2 ranks of ddp-train on the GPU, sharing it, each
# exiting 0 (rank r's output in TAG.out.r, TAG.err.r).
world2() {
  local tag=$1 port r rc=0
  shift
  port=$(ddp_free_port) || fail "no free port"
  pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
      NCCL_HOSTID=ddp-gpu-check-$r NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
      "$bin" "$@" >"$tmp/$tag.out.$r" 2>"$tmp/$tag.err.$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  grep -h 'training on' "$tmp/$tag.err.0" | head -n 1
  [ $rc -eq 0 ] || { tail -n 8 "$tmp/$tag".err.*; fail "$tag: a rank exited $rc"; }
}
# world2_prog TAG PROGRAM ARGS...: as world2, for another program.
world2_prog() {
  local tag=$1 prog=$2 port r rc=0
  shift 2
  port=$(ddp_free_port) || fail "no free port"
  pids=()
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
      NCCL_HOSTID=ddp-gpu-check-$r NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
      "$prog" "$@" >"$tmp/$tag.out.$r" 2>"$tmp/$tag.err.$r" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  [ $rc -eq 0 ] || { tail -n 8 "$tmp/$tag".err.* "$tmp/$tag".out.*; fail "$tag: a rank exited $rc"; }
}
field() { "$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])[sys.argv[2]])' "$@"; }
small() { # a test set of 1000 images, so evaluations stay short
  "$py" "$here/tests/support/fashion_small.py" "$data" "$tmp/small" 1000 >/dev/null || fail "fashion_small.py"
  echo "$tmp/small"
}

case $step in
n2)
  d=$(small)
  conv=(--model convnet --data "$d" --seed 2 --lr 0.01 --sync-bn --json)
  "$bin" "${conv[@]}" --device cpu --epochs 0 --dump-state "$tmp/init" >/dev/null 2>&1 ||
    fail "the ConvNet's initial state"
  world2 conv "${conv[@]}" --device "$dev" --max-steps 10 --batch-size 50 --dump-state "$tmp/conv.{rank}"
  "$bin" "${conv[@]}" --device "$dev" --max-steps 10 --batch-size 100 --dump-state "$tmp/single" \
    >"$tmp/single.out" 2>"$tmp/single.err" || { tail -n 5 "$tmp/single.err"; fail "the 1-rank GPU run"; }
  cmp -s "$tmp/conv.0" "$tmp/conv.1" || fail "the two ranks' states differ"
  "$py" "$here/tests/train/compare_state.py" "$tmp/conv.0" "$tmp/single" --init "$tmp/init" ||
    fail "2 x 50 on the GPU is not 1 x 100 within docs/parallel.md's bound"
  echo "ok: 2 ranks x 50 (--sync-bn, GPU) == 1 rank x 100 (GPU) after 10 steps; ranks identical"
  ;;
n2acc)
  world2 acc --model convnet --data "$data" --seed 1 --epochs 3 --batch-size 50 --lr 0.01 \
    --momentum 0.9 --sync-bn --device "$dev" --json
  acc=$(field "$tmp/acc.out.0" test_accuracy) || fail "no test_accuracy"
  sps=$(field "$tmp/acc.out.0" samples_per_s)
  echo "world 2 on one GPU: test accuracy $acc after 3 epochs, $sps samples/s"
  "$py" -c "import sys; sys.exit(0 if float('$acc') >= 0.89 else 1)" || fail "accuracy $acc < 0.89"
  ;;
n3kill | n3stop)
  [ -x "$ddprun" ] || { echo "SKIP: no ddprun carried"; exit 77; }
  d=$(small)
  how=KILL timeout_s=60 bar=10
  [ "$step" = n3stop ] && how=STOP timeout_s=8 bar=30
  export GPU_DP_PIDS=$tmp/pid
  DDP_TIMEOUT=$timeout_s timeout 120 "$ddprun" --nproc-per-node 2 --may-fail 1 --grace-period 2 \
    "$here/scripts/gpu-dp-steps.sh" rank "$bin" --model convnet --data "$d" --seed 1 --epochs 20 \
    --batch-size 50 --lr 0.01 --device "$dev" --log "$tmp/train.log" >"$tmp/job.out" 2>&1 &
  job=$!
  pids=("$job")
  for _ in $(seq 1 600); do grep -q '"loss"' "$tmp/train.log" 2>/dev/null && break; sleep 0.1; done
  [ -s "$tmp/pid.1" ] || { tail -n 20 "$tmp/job.out"; fail "rank 1 never started"; }
  grep -q '"loss"' "$tmp/train.log" 2>/dev/null || { tail -n 20 "$tmp/job.out"; fail "training never started"; }
  t0=$(date +%s.%N)
  kill -"$how" "$(cat "$tmp/pid.1")"
  wait "$job"
  rc=$?
  pids=()
  secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  [ "$how" = STOP ] && kill -9 "$(cat "$tmp/pid.1")" 2>/dev/null
  tail -n 25 "$tmp/job.out"
  echo "rank 1 SIG$how: the job ended after $secs s with exit $rc"
  [ $rc -ne 0 ] || fail "the job exited 0 with rank 1 gone"
  awk -v s="$secs" -v b="$bar" 'BEGIN {exit !(s <= b)}' || fail "it took $secs s (bar $bar s)"
  if [ "$how" = KILL ]; then
    grep -i 'error' "$tmp/job.out" | grep -q 'rank 1' || fail "rank 0's error does not name rank 1"
  else
    grep -q 'flight recorder' "$tmp/job.out" || fail "no flight recorder verdict"
    sed -n '/flight recorder/,$p' "$tmp/job.out" | grep -q 'rank 1' || fail "the verdict does not name rank 1"
  fi
  ;;
n4)
  d=$(small)
  run=(--model convnet --data "$d" --seed 3 --lr 0.01 --momentum 0.9 --batch-size 100 --device "$dev")
  g() { "$bin" "${run[@]}" "$@" >>"$tmp/n4.out" 2>&1 || { tail -n 5 "$tmp/n4.out"; fail "ddp-train $*"; }; }
  same() { "$py" "$here/tests/train/st_compare.py" "$1.safetensors" "$2.safetensors" &&
    "$py" "$here/tests/train/st_compare.py" "$1.train.safetensors" "$2.train.safetensors"; }
  g --max-steps 40 --save "$tmp/a.safetensors"
  g --max-steps 40 --save "$tmp/a2.safetensors"
  same "$tmp/a" "$tmp/a2" || fail "two straight GPU runs differ: the GPU run is not reproducible, so resume cannot be judged"
  g --max-steps 20 --save "$tmp/b1.safetensors"
  g --max-steps 40 --resume "$tmp/b1.safetensors" --save "$tmp/b2.safetensors"
  same "$tmp/a" "$tmp/b2" || fail "20 steps + resume to 40 differs from 40 straight on the GPU"
  echo "ok: --resume on the GPU is bit-identical (model and training state)"
  "$bin" --model convnet --data "$d" --device cpu --init "$tmp/a.safetensors" --epochs 0 --json \
    >"$tmp/cpu.out" 2>&1 || { tail -n 5 "$tmp/cpu.out"; fail "a CPU run cannot --init from the GPU checkpoint"; }
  "$bin" "${run[@]/"$dev"/cpu}" --max-steps 30 --resume "$tmp/b1.safetensors" >"$tmp/cpu2.out" 2>&1 ||
    { tail -n 5 "$tmp/cpu2.out"; fail "a CPU run cannot --resume the GPU checkpoint"; }
  echo "ok: a CPU run loads the GPU checkpoint (--init: test accuracy $(field "$tmp/cpu.out" test_accuracy); --resume)"
  if "$py" -c 'import torch, safetensors' 2>/dev/null; then
    "$py" "$here/tests/io/torch_interop.py" check "$tmp/a.safetensors" || fail "PyTorch's strict load"
    echo "ok: PyTorch loads the GPU checkpoint with strict=True"
  else
    echo "note: no torch + safetensors in $py: PyTorch's strict load not checked"
  fi
  ;;
n5)
  # ddp-bench allreduce --device cuda (NCCL) against PyTorch's all_reduce,
  # both at world 2 on the one GPU, float32 sum from 1 MiB to 64 MiB,
  # alternating rounds (who goes first alternating too); per size the
  # medians' ratio torch time / ddp time must be >= 0.95.
  [ -x "$ddprun" ] && [ -x "${DDP_BIN_DIR}/ddp-bench" ] || { echo "SKIP: no ddprun or ddp-bench carried"; exit 77; }
  "$py" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null ||
    { echo "SKIP: no PyTorch with CUDA in $py"; exit 77; }
  rounds=${GPU_DP_ROUNDS:-2}
  ddp_round() {
    DDP_TIMEOUT=60 timeout 90 "$ddprun" --nproc-per-node 2 "$here/scripts/gpu-dp-steps.sh" rank \
      "${DDP_BIN_DIR}/ddp-bench" allreduce --device cuda -b 1M -e 64M -n 20 -w 5 --json \
      >"$tmp/ddp.$1" 2>"$tmp/ddp.err.$1" || { tail -n 8 "$tmp/ddp.err.$1"; fail "ddp-bench round $1"; }
  }
  torch_round() {
    timeout 120 "$py" "$here/scripts/torch/allreduce_bench.py" -b 1M -e 64M -n 20 -w 5 \
      >"$tmp/torch.$1" 2>"$tmp/torch.err.$1" || { tail -n 8 "$tmp/torch.err.$1"; fail "torch round $1"; }
  }
  for k in $(seq 1 "$rounds"); do
    if [ $((k % 2)) = 1 ]; then ddp_round "$k"; torch_round "$k"; else torch_round "$k"; ddp_round "$k"; fi
  done
  grep -h '^# NCCL' "$tmp"/ddp.err.* | head -n 1
  "$py" - "$tmp" "$rounds" <<'PY' || fail "ddp's allreduce below 0.95x PyTorch's at some size"
import json, statistics, sys
tmp, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):
    out = {}
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            if "time_us" in r:
                out[r["size"]] = r["time_us"]
    return out
ddp = [rows("%s/ddp.%d" % (tmp, k)) for k in range(1, rounds + 1)]
torch = [rows("%s/torch.%d" % (tmp, k)) for k in range(1, rounds + 1)]
ok = True
print("| size | ddp us (median) | torch us (median) | torch / ddp |")
print("| --- | --- | --- | --- |")
for size in sorted(torch[0]):
    d = statistics.median(r[size] for r in ddp)
    t = statistics.median(r[size] for r in torch)
    ratio = t / d
    ok = ok and ratio >= 0.95
    print("| %d | %.1f | %.1f | %.3f%s |" % (size, d, t, ratio, "" if ratio >= 0.95 else " (below 0.95)"))
sys.exit(0 if ok else 1)
PY
  ;;
n6numa)
  # The rank's threads on the CPUs near its GPU (docs/cuda.md, "CPUs near
  # the GPU"): the decision ddp-train logs at DDP_DEBUG=info, and what the
  # machine says (the GPU's numa_node and local_cpulist in sysfs).
  DDP_DEBUG=info "$bin" --model toy --device "$dev" --max-steps 1 --json >"$tmp/numa.out" 2>"$tmp/numa.err" ||
    { tail -n 5 "$tmp/numa.err"; fail "ddp-train --device $dev"; }
  line=$(grep -m1 -E 'near GPU|near the GPU|CPUs left as they are' "$tmp/numa.err")
  [ -n "$line" ] || { tail -n 5 "$tmp/numa.err"; fail "no decision about the CPUs near the GPU logged"; }
  echo "ddp-train: $line"
  for busid in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | head -n 1); do
    b=$(echo "$busid" | tr 'A-F' 'a-f' | sed 's/^0000\(....:\)/\1/')
    echo "sysfs $b: numa_node $(cat /sys/bus/pci/devices/"$b"/numa_node 2>&1), local_cpulist" \
      "$(cat /sys/bus/pci/devices/"$b"/local_cpulist 2>&1); this shell's CPUs $(taskset -pc $$ 2>/dev/null | sed 's/.*: //')"
  done
  ;;
n7mnist)
  # Seed 001 on NCCL: mnist_ddp --device cuda at world 2 (the one GPU
  # shared, NCCL_HOSTID per rank), 100 steps: the test set counted once
  # over the ranks and the loss falling ("ok"), the group on nccl.
  prog=${DDP_BIN_DIR}/mnist_ddp
  [ -x "$prog" ] || { echo "SKIP: no mnist_ddp carried"; exit 77; }
  world2_prog mnist "$prog" --device "$dev" --max-steps 100 --lr 0.01 --eval-samples 1000 --data "$data"
  grep -h 'Training complete\|accuracy' "$tmp/mnist.out.0"
  grep -q 'backend nccl' "$tmp/mnist.out.0" || fail "mnist_ddp's group is not on nccl"
  grep -q '(each counted once: yes): ok$' "$tmp/mnist.out.0" || fail "mnist_ddp's checks"
  ;;
n8hpo)
  # Seed 002 on the GPU: ddp-hpo --objective convnet --device cuda, one
  # worker of 2 ranks on the GPU (shared), 2 short generations.
  prog=${DDP_BIN_DIR}/ddp-hpo
  [ -x "$prog" ] || { echo "SKIP: no ddp-hpo carried"; exit 77; }
  world2_prog hpo "$prog" --objective convnet --device "$dev" --ranks-per-worker 2 --generations 2 \
    --epochs 1 --max-steps 30 --train-samples 3000 --val-samples 500 --data "$data"
  tail -n 4 "$tmp/hpo.out.0"
  grep -q '(loss inf)' "$tmp/hpo.err.0" && { tail -n 5 "$tmp/hpo.err.0"; fail "an individual's loss was inf"; }
  echo "ok: ddp-hpo's convnet worker trained on the GPU at 2 ranks"
  ;;
*) echo "gpu-dp-steps: unknown step '$step'" >&2; exit 2 ;;
esac
