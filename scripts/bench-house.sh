#!/usr/bin/env bash
# Speed of this build against another revision's, for changes that must not
# change speed (the house issues: layer boundaries, backends as folders, the
# asynchronous backend interface). Builds REV's benchmarks in a temporary
# worktree (release), then alternates the two builds round by round (who goes
# first alternating too) over:
#   convnet      bench_convnet: the seeds' ConvNet training step, batch 100,
#                one thread, samples/s (higher is better)
#   8B, 1M, 64M  ddp-bench allreduce at world 2 (processes, shared memory),
#                float32 sum, microseconds per op (lower is better)
#   rpc          bench_rpc: rpc_sync round trip of 8 bytes, microseconds
# and prints each one's medians and new/old (for times, old/new: > 1 means
# the new build is faster), as the ratio of the medians and as the median of
# each round's own ratio. Run on a quiet machine (load under 1.5).
# Usage: scripts/bench-house.sh REV [ROUNDS=5]   (needs scripts/build.sh release)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/bench-house.sh REV [ROUNDS]}
rounds=${2:-5}
new=$PWD/build/bin
[ -x "$new/ddp-bench" ] || { echo "bench-house: build first (scripts/build.sh release)" >&2; exit 2; }
work=$(mktemp -d)
cleanup() { git worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
git worktree add --detach "$work/src" "$rev" >/dev/null
echo "building $rev's benchmarks in $work ..." >&2
cmake -S "$work/src" -B "$work/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$work/build" -j "$(nproc)" --target bench_convnet ddp-bench bench_rpc >/dev/null
old=$work/build/bin
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), load $(cut -d' ' -f1-3 /proc/loadavg)" >&2

measure() { # BINDIR WHAT: one number
  local bin=$1
  case $2 in
    convnet) timeout 600 "$bin/bench_convnet" --steps 60 --warmup 10 --repeats 1 --json |
               python3 -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["samples_per_s"])' ;;
    8B|1M|64M)
      local size=${2%B}; local iters=20000
      [ "$2" = 1M ] && iters=2000
      [ "$2" = 64M ] && iters=20
      timeout 600 "$bin/ddp-bench" allreduce --nproc 2 -b "$size" -e "$size" -n "$iters" -w 50 -c 0 --json |
        python3 -c 'import json, sys; print(json.loads(sys.stdin.read().splitlines()[-1])["time_us"])' ;;
    rpc) timeout 600 "$bin/bench_rpc" --sizes 8 --iters 2000 | sed -n 's/.* us=\([0-9.]*\).*/\1/p' | tail -n 1 ;;
  esac
}

whats=(convnet 8B 1M 64M rpc)
declare -A runs
for ((k = 1; k <= rounds; k++)); do
  line="round $k:"
  for what in "${whats[@]}"; do
    order=(old new); [ $((k % 2)) = 0 ] && order=(new old)
    for side in "${order[@]}"; do
      dir=$old; [ $side = new ] && dir=$new
      v=$(measure "$dir" "$what")
      runs[$side.$what]+="$v "
      line+=" $what/$side=$v"
    done
  done
  echo "$line" >&2
done
for what in "${whats[@]}"; do
  python3 - "$what" "${runs[old.$what]}" "${runs[new.$what]}" <<'PY'
import statistics, sys
what, old, new = sys.argv[1], [float(v) for v in sys.argv[2].split()], [float(v) for v in sys.argv[3].split()]
mo, mn = statistics.median(old), statistics.median(new)
# A round's two runs are seconds apart, so its own ratio cancels the slow
# drifts of a shared VM (the cores' cache sharing, neighbours): the median
# of those is the steadier figure.
if what == "convnet":
    paired = statistics.median(n / o for o, n in zip(old, new))
    print(f"{what:8s} old {mo:9.1f} samples/s  new {mn:9.1f} samples/s  new/old {mn / mo:.3f}, "
          f"per round {paired:.3f} (medians of {len(old)}; old {min(old):.1f}-{max(old):.1f}, "
          f"new {min(new):.1f}-{max(new):.1f})")
else:
    paired = statistics.median(o / n for o, n in zip(old, new))
    print(f"{what:8s} old {mo:9.2f} us         new {mn:9.2f} us         old/new {mo / mn:.3f}, "
          f"per round {paired:.3f} (medians of {len(old)}; old {min(old):.2f}-{max(old):.2f}, "
          f"new {min(new):.2f}-{max(new):.2f})")
PY
done
