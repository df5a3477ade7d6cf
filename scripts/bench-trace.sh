#!/usr/bin/env bash
# The timeline's cost (issue 27: at most 2 % of a step): ddp-train's ConvNet,
# one process, PAIRS pairs of runs alternating tracing on (--trace) and off,
# the order within a pair alternating too. Each run's figure is its steady
# step time (--json steady_step_phases.step_ms: the mean step without the
# first 10). Prints each pair, the medians and their ratio, and the load
# average before and after (2 shared vCPUs here: the load is the noise).
#
# usage: scripts/bench-trace.sh [BUILD_DIR] [PAIRS] [STEPS]
#   BUILD_DIR  a build with bin/ddp-train (default build)
#   PAIRS      pairs of runs (default 7)
#   STEPS      --max-steps of each run (default 110: 100 steady steps)
set -euo pipefail
build=${1:-build}
pairs=${2:-7}
steps=${3:-110}
bin=$build/bin/ddp-train
[ -x "$bin" ] || { echo "no $bin: build ddp-train first" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_TRACE_FILE

# run on|off: prints the steady step time in ms.
run() {
  local args=(--model convnet --max-steps "$steps" --workers 0 --threads 1 --json)
  [ "$1" = on ] && args+=(--trace "$tmp/trace.json")
  "$bin" "${args[@]}" 2>/dev/null | tail -1 |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["steady_step_phases"]["step_ms"])'
}

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
on=() off=()
for ((i = 0; i < pairs; i++)); do
  if ((i % 2 == 0)); then a=$(run on); b=$(run off); else b=$(run off); a=$(run on); fi
  on+=("$a") off+=("$b")
  echo "pair $((i + 1)): on $a ms, off $b ms"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "${on[*]}" "${off[*]}" <<'PY'
import statistics, sys
on = [float(x) for x in sys.argv[1].split()]
off = [float(x) for x in sys.argv[2].split()]
ratios = [a / b for a, b in zip(on, off)]
print("median step: on %.3f ms, off %.3f ms: on/off %.4f (median of the pairs' ratios %.4f)"
      % (statistics.median(on), statistics.median(off),
         statistics.median(on) / statistics.median(off), statistics.median(ratios)))
PY
