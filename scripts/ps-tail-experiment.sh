#!/usr/bin/env bash
# Issue 36: is async's lead over ssp:2 (ConvNet, 1 epoch, 1 server + 2
# trainers) its tail, the steps the slowest trainer makes alone after the
# first reached the final evaluation? Each run writes the server's model at
# the moment the first trainer stops stepping (DDP_PS_SNAPSHOT, docs/ps.md
# "Staleness, measured"), and that model is evaluated on its own
# (`ddp-train --init SNAP --epochs 0`): "before" is the model before the
# tail, "after" the run's own final accuracy. Modes are alternated within
# each seed so that load drifts hit every mode alike; the tail (steps the
# slowest made after the first stopped) and the share of gradients that
# missed no update come from DDP_PS_STALENESS=1. In sync, before == after
# (the check that the snapshot is evaluated as the run evaluates).
# SNAPSHOT_STEP=N takes the snapshot when the slowest trainer finished step
# N instead (DDP_PS_SNAPSHOT_STEP; the epoch has 300 steps per trainer):
# the control, what the last 300 - N steps bring where there is no tail.
# usage: scripts/ps-tail-experiment.sh [BUILD_DIR]
#   SEEDS (default "1 2 3"), MODES ("async ssp:2 sync"), LR (0.01),
#   MOMENTUM (0.9), EPOCHS (1), SNAPSHOT_STEP (0: the first stop) override.
set -uo pipefail
build=${1:-build}
bin=$build/bin
seeds=${SEEDS:-"1 2 3"}
modes=${MODES:-"async ssp:2 sync"}
lr=${LR:-0.01}
momentum=${MOMENTUM:-0.9}
epochs=${EPOCHS:-1}
snapshot_step=${SNAPSHOT_STEP:-0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "lr $lr momentum $momentum epochs $epochs snapshot_step $snapshot_step; load before: $(cat /proc/loadavg); $(nproc) CPUs; $(date -u +%FT%TZ)"
printf "%-5s %-8s %5s %7s %9s %8s\n" seed mode tail "fresh%" before% after%
declare -A sb sa
for seed in $seeds; do
  for mode in $modes; do
    rm -f "$tmp/snap.safetensors"
    DDP_PS_STALENESS=1 DDP_PS_SNAPSHOT="$tmp/snap.safetensors" \
      DDP_PS_SNAPSHOT_STEP="$snapshot_step" timeout 1800 \
      "$bin/ddprun" --nproc-per-node 3 "$bin/ddp-train" --model convnet --epochs "$epochs" \
      --lr "$lr" --momentum "$momentum" --param-servers 1 --ps-mode "$mode" --seed "$seed" \
      --json >"$tmp/out" 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
    "$bin/ddp-train" --model convnet --init "$tmp/snap.safetensors" --epochs 0 --seed "$seed" \
      --json >"$tmp/eval" 2>"$tmp/eval.err" || { tail "$tmp/eval.err"; exit 1; }
    row=$(python3 - "$tmp/out" "$tmp/err" "$tmp/eval" <<'PY'
import json, re, sys
after = json.loads(open(sys.argv[1]).read().splitlines()[-1])["test_accuracy"]
before = json.loads(open(sys.argv[3]).read().splitlines()[-1])["test_accuracy"]
err = open(sys.argv[2]).read()
m = re.search(r"staleness in updates over (\d+) pushes:(.*) \(max", err)
bins = dict((k.lstrip(">="), int(v)) for k, v in (b.split(":") for b in m.group(2).split()))
lo, hi = map(int, re.search(r"clocks spanned (\d+)\.\.(\d+)", err).groups())
print(f"{hi-lo} {100*bins.get('0', 0)/int(m.group(1)):.1f} {100*before:.2f} {100*after:.2f}")
PY
)
    read -r tail fresh before after <<<"$row"
    printf "%-5s %-8s %5s %7s %9s %8s\n" "$seed" "$mode" "$tail" "$fresh" "$before" "$after"
    sb[$mode]=$(python3 -c "print(${sb[$mode]:-0} + $before)")
    sa[$mode]=$(python3 -c "print(${sa[$mode]:-0} + $after)")
  done
done
n=$(echo $seeds | wc -w)
for mode in $modes; do
  python3 -c "print('mean %-8s before %.2f after %.2f' % ('$mode', ${sb[$mode]} / $n, ${sa[$mode]} / $n))"
done
echo "load after: $(cat /proc/loadavg)"
