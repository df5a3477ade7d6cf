#!/usr/bin/env bash
# The parameter server's measurements (issue 25; BENCHMARKS.md, "Parameter server").
#
# stragglers: 1 server + 3 trainers on a test model whose step is a fixed sleep
#   (toy, --step-sleep-ms 20: the 2 cores are not what limits), 200 steps per
#   trainer; the servers' rate (trainers' steps per second while every trainer
#   steps) for sync, ssp:2 and async, undisturbed and with
#     one-transient  trainer 0 pauses 40 ms after a step with probability 0.1
#     all-transient  every trainer does so with probability 0.05
#     one-half       trainer 0 at half speed (sleeps 40 ms)
#   ROUNDS rounds (default 3), scenarios and modes interleaved; medians, and
#   each as a fraction of the same mode's undisturbed median.
# throughput: the ConvNet (batch 100, 300 steps) with 1 server + 1 trainer in
#   sync against data parallelism at world 2, alternated round by round
#   (ROUNDS), steady samples/s (after the first 10 steps) and the step's
#   phases of the trainer / rank 0; the ratio of medians.
#
# usage: scripts/bench-ps.sh [stragglers|throughput|all] [BUILD_DIR]
set -uo pipefail
what=${1:-all}
build=${2:-build}
bin=$build/bin
rounds=${ROUNDS:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=1

stragglers() {
  local scenarios=(none "one-transient:--straggler 0:pause:0.1:40"
                   "all-transient:--straggler all:pause:0.05:40" "one-half:--straggler 0:half")
  : >"$tmp/stragglers.txt"
  for ((r = 1; r <= rounds; r++)); do
    for sc in "${scenarios[@]}"; do
      local name=${sc%%:*} extra=
      [ "$name" != "$sc" ] && extra=${sc#*:}
      for mode in sync ssp:2 async; do
        # shellcheck disable=SC2086
        timeout 300 "$bin/ddprun" --nproc-per-node 4 "$bin/ddp-train" --model toy --samples 9600 \
          --batch-size 16 --epochs 1 --step-sleep-ms 20 --param-servers 1 --ps-mode "$mode" $extra \
          >/dev/null 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
        rate=$(sed -n 's/.*; \([0-9.]*\) steps\/s while all trained.*/\1/p' "$tmp/err")
        echo "$name $mode $rate" | tee -a "$tmp/stragglers.txt"
      done
    done
  done
  python3 - "$tmp/stragglers.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
med = {}
for name, mode, rate in rows:
    med.setdefault((name, mode), []).append(float(rate))
med = {k: statistics.median(v) for k, v in med.items()}
modes = ["sync", "ssp:2", "async"]
print("| scenario | " + " | ".join(modes) + " |")
print("|---|" + "---|" * len(modes))
for name in ["none", "one-transient", "all-transient", "one-half"]:
    cells = []
    for m in modes:
        v, base = med[(name, m)], med[("none", m)]
        cells.append(f"{v:.1f}" + ("" if name == "none" else f" ({100 * v / base:.0f} %)"))
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
}

throughput() {
  : >"$tmp/tp.txt"
  local common=(--model convnet --batch-size 100 --max-steps 300 --lr 0.01 --momentum 0.9 --json)
  for ((r = 1; r <= rounds; r++)); do
    for cfg in ps dp; do
      if [ $cfg = ps ]; then
        timeout 600 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-train" "${common[@]}" \
          --param-servers 1 --ps-mode sync >"$tmp/out" 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
      else
        timeout 600 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-train" "${common[@]}" \
          >"$tmp/out" 2>"$tmp/err" || { tail "$tmp/err"; exit 1; }
      fi
      echo "$cfg $(tail -n 1 "$tmp/out")" | tee -a "$tmp/tp.txt" | cut -c1-160
    done
  done
  python3 - "$tmp/tp.txt" <<'PY'
import json, statistics, sys
runs = {"ps": [], "dp": []}
for line in open(sys.argv[1]):
    cfg, js = line.split(" ", 1)
    runs[cfg].append(json.loads(js))
def med(cfg, key):
    return statistics.median(r[key] for r in runs[cfg])
def phase(cfg, key):
    return statistics.median(r["steady_step_phases"][key] for r in runs[cfg])
ps, dp = med("ps", "steady_samples_per_s"), med("dp", "steady_samples_per_s")
print(f"steady samples/s (median of {len(runs['ps'])}): ps sync 1+1 {ps:.0f}, data parallel world 2 {dp:.0f}; ratio {ps / dp:.3f}")
pairs = [a["steady_samples_per_s"] / b["steady_samples_per_s"] for a, b in zip(runs["ps"], runs["dp"])]
print(f"ratio per round: {', '.join(f'{x:.3f}' for x in pairs)}")
keys = ["load_ms", "forward_ms", "backward_compute_ms", "backward_comm_ms", "optimizer_ms", "step_ms", "preempted_ms"]
print("| phase (ms, median) | ps trainer | dp rank 0 |")
print("|---|---|---|")
for k in keys:
    print(f"| {k} | {phase('ps', k):.3f} | {phase('dp', k):.3f} |")
PY
}

case $what in
  stragglers) stragglers ;;
  throughput) throughput ;;
  all) stragglers; throughput ;;
  *) echo "usage: scripts/bench-ps.sh [stragglers|throughput|all] [BUILD_DIR]" >&2; exit 2 ;;
esac
