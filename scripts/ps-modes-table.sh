#!/usr/bin/env bash
# Issue 36: test accuracy of the ConvNet after EPOCHS epochs (default 1) on
# Fashion-MNIST with 1 server + 2 trainers, in sync, async and ssp:2, seeds
# 1 2 3 run in the same go (modes alternated within each seed), with the
# server's staleness counts (DDP_PS_STALENESS=1): the share of gradients
# that missed no update, the most steps / updates any gradient was behind,
# and how many steps the slowest trainer made alone at the end (the span of
# the clocks when the first trainer reached the final evaluation).
# async and ssp depend on timing: the load average is printed before and
# after; a table from a loaded machine says so.
# usage: scripts/ps-modes-table.sh [BUILD_DIR]   (SEEDS, EPOCHS, MODES override)
set -uo pipefail
build=${1:-build}
bin=$build/bin
epochs=${EPOCHS:-1}
seeds=${SEEDS:-"1 2 3"}
modes=${MODES:-"sync async ssp:2"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "load before: $(cat /proc/loadavg); $(nproc) CPUs; $(date -u +%FT%TZ)"
printf "%-5s %-7s %8s %10s %9s %11s %10s\n" seed mode acc% "fresh%" max_steps max_updates alone_end
declare -A sum
for seed in $seeds; do
  for mode in $modes; do
    DDP_PS_STALENESS=1 timeout 1800 "$bin/ddprun" --nproc-per-node 3 "$bin/ddp-train" \
      --model convnet --epochs "$epochs" --lr 0.01 --momentum 0.9 --param-servers 1 \
      --ps-mode "$mode" --seed "$seed" --json >"$tmp/out" 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
    row=$(python3 - "$tmp/out" "$tmp/err" <<'PY'
import json, re, sys
acc = json.loads(open(sys.argv[1]).read().splitlines()[-1])["test_accuracy"]
err = open(sys.argv[2]).read()
def hist(kind):
    m = re.search(r"staleness in %s over (\d+) pushes:(.*) \(max (\d+)\)" % kind, err)
    bins = dict((k.lstrip(">="), int(v)) for k, v in (b.split(":") for b in m.group(2).split()))
    return int(m.group(1)), bins, int(m.group(3))
n, upd, max_upd = hist("updates")
_, _, max_steps = hist("steps")
lo, hi = map(int, re.search(r"clocks spanned (\d+)\.\.(\d+)", err).groups())
print(f"{100*acc:.2f} {100*upd.get('0', 0)/n:.1f} {max_steps} {max_upd} {hi-lo}")
PY
)
    read -r acc fresh ms mu alone <<<"$row"
    printf "%-5s %-7s %8s %10s %9s %11s %10s\n" "$seed" "$mode" "$acc" "$fresh" "$ms" "$mu" "$alone"
    sum[$mode]=$(python3 -c "print(${sum[$mode]:-0} + $acc)")
  done
done
n=$(echo $seeds | wc -w)
for mode in $modes; do python3 -c "print('mean %-7s %.2f' % ('$mode', ${sum[$mode]} / $n))"; done
echo "load after: $(cat /proc/loadavg)"
