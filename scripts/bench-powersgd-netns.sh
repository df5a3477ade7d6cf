#!/usr/bin/env bash
# PowerSGD against plain allreduce on a rate-limited link (issue 41's speed
# figure): two network namespaces joined by a veth pair shaped with tbf to
# RATE Mbit/s each way (tests/support/netns_pair.sh), one ddp-train rank in
# each (they reach each other over TCP through the shaped link), the
# ConvNet on Fashion-MNIST (or MODEL on the synthetic data when the data
# set is missing or MODEL is given), batch 100 per rank, SGD momentum, one
# thread per rank. Two sides alternate round by round (the first side
# moves each round):
#   allreduce: --comm-hook allreduce
#   powersgd:  --comm-hook powersgd:RANK --powersgd-start 2
# Each run reports its steady per-step time (steady_step_phases.step_ms,
# after the 10 warm-up steps); the table gives each side's median over the
# rounds and the ratio allreduce / powersgd (> 1: PowerSGD is faster).
# (The bytes per step are docs/parallel.md's closed form, checked by
# tests/parallel/test_powersgd.c.)
#   scripts/bench-powersgd-netns.sh [rounds=3] [steps=60] [rate_mbit=100] [rank=4] [model=convnet]
# Needs root, `ip netns` and `tc`; every namespace is removed on exit (also
# on Ctrl-C). About rounds x 2 x (steps + 10) steps: ~3 minutes with the
# defaults on an idle machine.
set -uo pipefail
cd "$(dirname "$0")/.."
skip() { echo "bench-powersgd-netns: SKIP: $*"; exit 77; }
fail() { echo "bench-powersgd-netns: $*" >&2; exit 1; }
rounds=${1:-3}
steps=${2:-60}
rate=${3:-100}
rank=${4:-4}
model=${5:-convnet}
[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null && command -v tc >/dev/null || skip "needs ip and tc (iproute2)"
bin=$(pwd)/${DDP_BIN_DIR:-build/bin}
[ -x "$bin/ddp-train" ] || fail "build first (scripts/build.sh)"
data=(--data /usr/share/datasets/fashion-mnist)
[ "$model" = convnet ] && [ -d /usr/share/datasets/fashion-mnist ] || data=()
tmp=$(mktemp -d)
. tests/support/netns_pair.sh
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  netns_pair_down
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
netns_pair_up psgd 10.97.0 "$rate"
port=29631
run() { # TAG ARGS... -> step_ms of rank 0's steady phases
  local tag=$1; shift
  port=$((port + 1))
  local common=(--model "$model" "${data[@]}" --batch-size 100 --lr 0.01 --momentum 0.9 --seed 1
                --threads 1 --workers 0 --max-steps $((steps + 10)) --json "$@")
  for r in 0 1; do
    local ns=$nsA
    [ $r = 1 ] && ns=$nsB
    ip netns exec "$ns" env MASTER_ADDR=10.97.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=$r \
      LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 DDP_TIMEOUT=300 timeout 900 "$bin/ddp-train" "${common[@]}" \
      >"$tmp/$tag.out$r" 2>"$tmp/$tag.err$r" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  [ $rc = 0 ] || { tail -n 5 "$tmp/$tag".err*; fail "$tag failed"; }
  tail -n 1 "$tmp/$tag.out0" |
    python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["steady_step_phases"]["step_ms"])'
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -A runs
sides=(allreduce powersgd)
echo "load before: $(uptime | sed 's/.*load average/load average/')" >&2
for r in $(seq "$rounds"); do
  order=("${sides[@]:$((r % 2))}" "${sides[@]:0:$((r % 2))}")
  for side in "${order[@]}"; do
    if [ "$side" = allreduce ]; then v=$(run "ar$r" --comm-hook allreduce) || exit 1
    else v=$(run "ps$r" --comm-hook "powersgd:$rank" --powersgd-start 2) || exit 1; fi
    runs[$side]+="$v "
    echo "round $r: $side $v ms/step" >&2
  done
done
echo "load after: $(uptime | sed 's/.*load average/load average/')" >&2
ar=$(median ${runs[allreduce]})
ps=$(median ${runs[powersgd]})
echo "world 2 over a ${rate} Mbit/s link (tbf, two network namespaces), $model, batch 100 per rank,"
echo "$steps steady steps x $rounds rounds (medians of ms/step):"
printf '  %-14s %10s\n' side ms/step
printf '  %-14s %10.2f\n' allreduce "$ar" "powersgd:$rank" "$ps"
printf '  ratio allreduce / powersgd: %.2f (> 1: PowerSGD faster per step)\n' \
  "$(echo "$ar / $ps" | bc -l)"
