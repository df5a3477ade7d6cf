#!/usr/bin/env bash
# Launch time: from starting the launcher to all N workers past a barrier,
# ddprun (tests/launch/launch_worker: ddp_init_process_group env:// + barrier)
# against torchrun (bench/launch_barrier.py: init_process_group gloo env:// +
# barrier), measured alternately in one go; the median of RUNS runs of each
# and their ratio. Also the wall time until the launcher exits.
#   usage: scripts/bench-launch.sh [RUNS=7] [NPROC=8]
# torchrun is the one beside the reference environment's Python, $DDP_TORCH_PY
# (default /opt/torch-venv/bin/python, PyTorch 2.x; scripts/install-deps.sh
# refs builds it): Debian's torch 1.13 torchrun fails under Python 3.11.
# Without it the torchrun side is skipped, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-7}
nproc=${2:-8}
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
torchrun=$(dirname "$py")/torchrun
ddprun=build/bin/ddprun
worker=build/tests/launch_worker
[ -x "$ddprun" ] && [ -x "$worker" ] || { echo "bench-launch: build first (scripts/build.sh release)" >&2; exit 1; }
have_torch=1
if ! [ -x "$torchrun" ] || ! "$py" -c 'import torch.distributed' 2>/dev/null; then
  echo "bench-launch: SKIP torchrun: no PyTorch 2.x torchrun beside $py (scripts/install-deps.sh refs builds it); measuring ddprun only" >&2
  have_torch=0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One run: prints "<to all past the barrier, s> <to exit, s>".
measure() { # OUT CMD...
  local out=$1
  shift
  local t0 t1
  t0=$(date +%s.%N)
  "$@" >"$out" 2>"$out.err" || { cat "$out.err" >&2; echo "bench-launch: $* failed" >&2; exit 1; }
  t1=$(date +%s.%N)
  local n
  n=$(grep -o 'past_barrier [0-9.]*' "$out" | wc -l)
  [ "$n" -eq "$nproc" ] || { cat "$out" "$out.err" >&2; echo "bench-launch: $n of $nproc workers passed the barrier" >&2; exit 1; }
  grep -o 'past_barrier [0-9.]*' "$out" | awk -v t0="$t0" -v t1="$t1" '{ if ($2 > m) m = $2 } END { printf "%.4f %.4f\n", m - t0, t1 - t0 }'
}
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

echo "bench-launch: $nproc workers, $runs runs each, alternating; load: $(uptime | sed 's/.*load average: //')"
: >"$tmp/ddp"
: >"$tmp/torch"
for i in $(seq "$runs"); do
  measure "$tmp/o" timeout 60 "$ddprun" --nproc-per-node "$nproc" "$worker" --print-time >>"$tmp/ddp"
  if [ $have_torch = 1 ]; then
    measure "$tmp/o" timeout 120 env OMP_NUM_THREADS=1 "$torchrun" --standalone --nproc-per-node "$nproc" \
      bench/launch_barrier.py >>"$tmp/torch"
  fi
done
d_bar=$(cut -d' ' -f1 "$tmp/ddp" | median)
d_exit=$(cut -d' ' -f2 "$tmp/ddp" | median)
printf "ddprun   : all %d past the barrier in %.4f s (median), exited in %.4f s\n" "$nproc" "$d_bar" "$d_exit"
if [ $have_torch = 1 ]; then
  t_bar=$(cut -d' ' -f1 "$tmp/torch" | median)
  t_exit=$(cut -d' ' -f2 "$tmp/torch" | median)
  version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  printf "torchrun : all %d past the barrier in %.4f s (median), exited in %.4f s (torch %s)\n" "$nproc" "$t_bar" "$t_exit" "$version"
  awk -v a="$t_bar" -v b="$d_bar" -v c="$t_exit" -v d="$d_exit" \
    'BEGIN { printf "ratio    : ddprun %.1fx faster to the barrier, %.1fx faster to exit\n", a / b, c / d }'
fi
