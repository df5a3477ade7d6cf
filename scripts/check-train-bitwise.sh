#!/usr/bin/env bash
# ddp-train against another revision's ddp-train, bit for bit: builds REV's
# ddp-train in a temporary worktree (release build), runs both over a
# matrix of options (toy, headtail, ConvNet and convnet-3 with momentum,
# Adam, Adadelta + StepLR, periodic evaluation, early stopping) at world 1
# and world 2 (ddprun, --sync-bn), and compares every rank's --dump-state
# byte for byte, the --json summary and the --log lines without their
# timings, and stderr without its rates. For a change that must not change
# training (issue 21: the loop moved into src/train/).
# With SPEED_ROUNDS=N it then times both in the same go: the ConvNet, batch
# 100 per rank, --workers 0, 10 warm-up + 150 steps, steady_samples_per_s,
# world 1 and 2, the two sides alternating within each round (who goes
# first alternating too); prints the medians and new / old.
# Usage: [SPEED_ROUNDS=5] scripts/check-train-bitwise.sh REV   (e.g. HEAD~1; a few minutes)
# Needs the current release build (scripts/build.sh) and Fashion-MNIST.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/check-train-bitwise.sh REV}
new=$PWD/build/bin/ddp-train
ddprun=$PWD/build/bin/ddprun
[ -x "$new" ] || { echo "check-train-bitwise: build first (scripts/build.sh)" >&2; exit 2; }
work=$(mktemp -d)
cleanup() { git worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
git worktree add --detach "$work/src" "$rev" >/dev/null
echo "building $rev's ddp-train in $work ..." >&2
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$work/build" -j "$(nproc)" --target ddp-train >/dev/null
old=$work/build/bin/ddp-train
export DDP_TIMEOUT=60
configs=(
  "toy|--model toy --epochs 2 --seed 3 --lr 0.05 --momentum 0.9 --batch-size 16"
  "headtail|--model headtail --epochs 1 --samples 4096 --seed 5 --batch-size 64 --optimizer adam --lr 0.001"
  "convnet|--model convnet --max-steps 40 --seed 2 --momentum 0.9 --eval-every 15"
  "convnet-3|--model convnet-3 --activation tanh --optimizer adadelta --lr 1.0 --scheduler step --step-size 1 --gamma 0.7 --max-steps 30"
  "toy-patience|--model toy --epochs 6 --seed 1 --patience 1 --eval-every 20 --lr 0.2"
)
summary() { python3 -c 'import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
for k in ("samples_per_s", "steady_samples_per_s", "steady_step_phases", "steady_preempted_ms_per_rank"):
    d.pop(k, None)
print(json.dumps(d, sort_keys=True))' "$1"; }
log_lines() { python3 -c 'import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(json.dumps({k: v for k, v in d.items() if not k.endswith("_ms") and k != "samples_per_s"}, sort_keys=True))' "$1"; }
failed=0
for c in "${configs[@]}"; do
  name=${c%%|*}
  read -r -a args <<<"${c#*|}"
  for world in 1 2; do
    for side in old new; do
      bin=$old; [ $side = new ] && bin=$new
      rm -f "$work/$side".*
      if [ $world = 1 ]; then
        timeout 600 "$bin" "${args[@]}" --json --dump-state "$work/$side.state.0" --log "$work/$side.log" \
          >"$work/$side.out" 2>"$work/$side.err" || { tail -n 3 "$work/$side.err"; echo "FAIL: $name: $side run"; exit 1; }
      else
        timeout 600 "$ddprun" --nproc-per-node 2 "$bin" "${args[@]}" --sync-bn --json \
          --dump-state "$work/$side.state.{rank}" --log "$work/$side.log" \
          >"$work/$side.out" 2>"$work/$side.err" || { tail -n 3 "$work/$side.err"; echo "FAIL: $name: $side run"; exit 1; }
      fi
    done
    what=()
    for ((r = 0; r < world; r++)); do cmp -s "$work/old.state.$r" "$work/new.state.$r" || what+=("rank $r's state"); done
    [ "$(summary "$work/old.out")" = "$(summary "$work/new.out")" ] || what+=("the --json summary")
    [ "$(log_lines "$work/old.log")" = "$(log_lines "$work/new.log")" ] || what+=("the --log lines")
    sed -E 's/[0-9]+ samples\/s//; s/ETA [0-9:-]+//' "$work/old.err" >"$work/old.err.plain"
    sed -E 's/[0-9]+ samples\/s//; s/ETA [0-9:-]+//' "$work/new.err" >"$work/new.err.plain"
    cmp -s "$work/old.err.plain" "$work/new.err.plain" || what+=("stderr")
    if [ ${#what[@]} -eq 0 ]; then
      echo "ok $name at world $world: bitwise the same ($(summary "$work/new.out" | cut -c1-90)...)"
    else
      echo "FAIL: $name at world $world: ${what[*]} differ"
      failed=1
    fi
  done
done
[ $failed = 0 ] || exit 1
rounds=${SPEED_ROUNDS:-0}
[ "$rounds" -gt 0 ] || exit 0
speed() { # BIN WORLD: steady samples/s
  timeout 600 "$ddprun" --nproc-per-node "$2" "$1" --model convnet --workers 0 --max-steps 160 \
    --momentum 0.9 --seed 2 --json 2>/dev/null | tail -n 1 |
    python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["steady_samples_per_s"])'
}
declare -A runs
for ((k = 1; k <= rounds; k++)); do
  line="round $k:"
  for world in 1 2; do
    order=(old new); [ $((k % 2)) = 0 ] && order=(new old)
    for side in "${order[@]}"; do
      bin=$old; [ $side = new ] && bin=$new
      v=$(speed "$bin" "$world")
      runs[$side.$world]+="$v "
      line+=" world $world $side $v"
    done
  done
  echo "$line samples/s" >&2
done
for world in 1 2; do
  python3 - "$world" "${runs[old.$world]}" "${runs[new.$world]}" <<'PY'
import statistics, sys
world, old, new = sys.argv[1], [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
mo, mn = statistics.median(old), statistics.median(new)
print(f"world {world}: old {mo:.0f} samples/s, new {mn:.0f} samples/s, new/old {mn / mo:.3f} "
      f"(medians of {len(old)}; old {min(old):.0f}-{max(old):.0f}, new {min(new):.0f}-{max(new):.0f})")
PY
done
