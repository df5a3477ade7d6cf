#!/usr/bin/env bash
# Data-parallel training speed, ddp against PyTorch DDP, measured in the same
# go: seed 001's ConvNet on Fashion-MNIST, batch 100 per rank, one thread per
# rank, SGD lr 0.01 momentum 0.9, at world 1 and world 2.
#   ddp:     ddprun --nproc-per-node W ddp-train --model convnet --workers 0 --max-steps S+10 ... --json
#   PyTorch: /usr/bin/python3 torch_ddp_convnet.py --world W --steps S (gloo)
# Both report samples/s of all ranks together over S steps after 10 warm-up
# steps (ddp-train's steady_samples_per_s; the reference's own warm-up).
# Within a round each side runs its worlds back to back; the order of the
# sides alternates every round, that of the worlds every two rounds. Each
# figure is the median of its rounds.
# Prints the ratio ddp / PyTorch per world and each side's scaling efficiency
# (world-2 samples/s / (2 x world-1 samples/s)), with the machine's load.
# Each round also runs two independent world-1 ddp trainings side by side
# ("pair"): their summed samples/s is what two processes get from this
# machine with no communication at all (shared caches, memory bandwidth,
# the hypervisor), the ceiling for any world-2 run; the script prints each
# side's world 2 against it too. Last, how long ddp's ranks were preempted
# (ready to run, their CPU held by another task: the machine's daemons) per
# step at each world: at world 2 each such wait stalls both ranks.
#   scripts/bench-ddp.sh [rounds=5] [steps=200]
# Env: DDP_SHARED_DIR (where refs/ is; default ../shared), BENCH_WORLDS ("1 2"),
# BENCH_DDPRUN_OPTS (ddprun options for ddp's runs, e.g. "--bind none"),
# BENCH_DDP_COMPARE (ddprun options of a third side, "ddp-alt", run in every
# round beside the other two and reported as ddp / ddp-alt per world: e.g.
# BENCH_DDP_COMPARE="--bind none" weighs the default placement against none).
# The scaling figure: every round's samples/s per side and world go to
# BENCH_OUT/scaling.tsv (side, world, samples_per_s, round), which ddp-plot
# draws as BENCH_OUT/scaling.svg: samples/s and efficiency against world
# size, the sides side by side (medians as bars, each round a dot; needs
# world 1 among the worlds). BENCH_OUT defaults to build/bench-ddp.
# BENCH_PYTHON: the Python whose torch is the reference (default
# /usr/bin/python3, Debian's python3-torch; e.g. /opt/torch-venv/bin/python
# for PyTorch 2.x). DDP_CPU_KERNELS reaches ddp's ranks; ATEN_CPU_CAPABILITY
# and ONEDNN_MAX_CPU_ISA reach PyTorch's (e.g. avx2 and AVX2 to hold it to
# AVX2 on an AVX-512 CPU).
# BENCH_BUILD: the build whose programs run (default build; build-portable
# holds the AVX2 family to AVX2 encodings on an AVX-512 CPU).
# Needs build/bin/{ddprun,ddp-train,ddp-plot} (scripts/build.sh), python3-torch
# and the Fashion-MNIST package (scripts/install-deps.sh data).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-200}
worlds=(${BENCH_WORLDS:-1 2})
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_ddp_convnet.py
die() { echo "bench-ddp: $*" >&2; exit 2; }
bin=${BENCH_BUILD:-build}/bin
[ -x "$bin/ddprun" ] && [ -x "$bin/ddp-train" ] && [ -x "$bin/ddp-plot" ] ||
  die "build first (scripts/build.sh)"
out_dir=${BENCH_OUT:-build/bench-ddp}
mkdir -p "$out_dir" || die "cannot create $out_dir"
table=$out_dir/scaling.tsv
printf 'side\tworld\tsamples_per_s\tround\n' >"$table"
[ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR to the folder holding refs/)"
py=${BENCH_PYTHON:-/usr/bin/python3}
"$py" -c "import torch" 2>/dev/null || die "needs python3-torch (apt-get install python3-torch)"
cores=$(nproc)
for w in "${worlds[@]}"; do
  [ "$w" -le "$cores" ] || echo "bench-ddp: note: world $w on $cores cores oversubscribes" >&2
done

# --workers 0: batches are gathered inline at every world, as the reference's
# DataLoader (num_workers=0) does. ddp-train's default gives world 1 a loader
# thread on the core world 2 needs for its second rank (and the pair below
# two threads each on two cores), which would compare unlike work.
# ddp-train's summary also says how long its ranks were kept from their CPUs
# by other tasks (steady_preempted_ms_per_rank): what the machine's daemons
# cost a synchronous step, which every rank waits out.
ddp_run() { # W -> "samples/s preempted_ms_all_ranks step_ms"
  timeout 900 "$bin/ddprun" ${DDPRUN_OPTS:-${BENCH_DDPRUN_OPTS:-}} --nproc-per-node "$1" "$bin/ddp-train" --model convnet \
    --batch-size 100 --threads 1 --workers 0 --lr 0.01 --momentum 0.9 --seed 1 \
    --max-steps $((steps + 10)) --json 2>/dev/null | tail -n 1 | /usr/bin/python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
p = d["steady_preempted_ms_per_rank"]
print(d["steady_samples_per_s"], "nan" if None in p else sum(p), d["steady_step_phases"]["step_ms"])' 2>/dev/null
}
ddpalt_run() { DDPRUN_OPTS="$BENCH_DDP_COMPARE" ddp_run "$1"; }
torch_run() { # W -> samples/s
  timeout 900 "$py" "$ref" --world "$1" --steps "$steps" --threads 1 --batch 100 \
    --port $((20000 + RANDOM % 20000)) 2>/dev/null | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p'
}
pair_run() { # -> summed samples/s of two independent world-1 ddp runs at once
  local a b
  ddp_run 1 >"$pair_tmp.a" &
  ddp_run 1 >"$pair_tmp.b"
  wait
  a=$(cut -d' ' -f1 "$pair_tmp.a"); b=$(cut -d' ' -f1 "$pair_tmp.b")
  [ -n "$a" ] && [ -n "$b" ] && awk -v a="$a" -v b="$b" 'BEGIN { print a + b }'
}
pair_tmp=$(mktemp); trap 'rm -f "$pair_tmp" "$pair_tmp".a "$pair_tmp".b' EXIT
side_name() { # the figure's name for a side
  case $1 in ddp) echo ddp ;; torch) echo PyTorch ;; ddpalt) echo "ddp ($BENCH_DDP_COMPARE)" ;; esac
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

declare -A runs last
echo "load before: $(uptime | sed 's/.*load average/load average/')" >&2
for r in $(seq "$rounds"); do
  # Each side runs its worlds back to back, so that a round's own
  # efficiency compares runs seconds apart; which side goes first
  # alternates every round, and the order of the worlds every two rounds.
  if (( r % 2 )); then sides=(ddp torch); else sides=(torch ddp); fi
  if [ -n "${BENCH_DDP_COMPARE:-}" ]; then # three sides: each goes first every third round
    all=(ddp ddpalt torch); sides=("${all[@]:$((r % 3))}" "${all[@]:0:$((r % 3))}")
  fi
  if (( (r + 1) / 2 % 2 )); then order=("${worlds[@]}"); else
    order=(); for (( i = ${#worlds[@]} - 1; i >= 0; i-- )); do order+=("${worlds[i]}"); done
  fi
  for side in "${sides[@]}"; do
    for w in "${order[@]}"; do
      read -r v preempted step_ms <<<"$("${side}_run" "$w")"
      [ -n "$v" ] || die "round $r: the $side run at world $w gave no figure"
      runs[$side.$w]+="$v "
      last[$side.$w]=$v
      printf '%s\t%s\t%s\t%s\n' "$(side_name "$side")" "$w" "$v" "$r" >>"$table"
      note=""
      if [ -n "${preempted:-}" ] && [ "$preempted" != nan ]; then
        runs[preempted.$w]+="$preempted "
        runs[preempted_pct.$w]+="$(awk -v p="$preempted" -v s="$step_ms" 'BEGIN { print 100 * p / s }') "
        note=" (ranks preempted $preempted ms a step of $step_ms)"
      fi
      echo "round $r world $w: $side $v samples/s$note" >&2
    done
  done
  if [[ " ${worlds[*]} " == *" 1 "* && " ${worlds[*]} " == *" 2 "* ]]; then
    # This round's own efficiency: each side's two worlds ran back to
    # back, so slow drifts of the machine cancel.
    for side in ddp torch; do
      runs[eff.$side]+="$(awk -v a="${last[$side.1]}" -v b="${last[$side.2]}" 'BEGIN { print 100 * b / (2 * a) }') "
    done
  fi
  if [[ " ${worlds[*]} " == *" 2 "* ]]; then
    v=$(pair_run)
    [ -n "$v" ] || die "round $r: the independent pair gave no figure"
    runs[pair]+="$v "
    echo "round $r: two independent world-1 ddp runs at once: $v samples/s together" >&2
  fi
done
echo "load after: $(uptime | sed 's/.*load average/load average/')" >&2

declare -A med
for key in "${!runs[@]}"; do med[$key]=$(median ${runs[$key]}); done
echo "ConvNet on Fashion-MNIST, batch 100 per rank, 1 thread per rank, $steps steps, median of $rounds rounds ($cores cores)"
printf '%-6s %14s %14s %8s\n' world "ddp samples/s" "torch samples/s" ratio
for w in "${worlds[@]}"; do
  awk -v w="$w" -v o="${med[ddp.$w]}" -v t="${med[torch.$w]}" \
    'BEGIN { printf "%-6s %14.0f %14.0f %7.2fx\n", w, o, t, o / t }'
done
if [ -n "${BENCH_DDP_COMPARE:-}" ]; then
  for w in "${worlds[@]}"; do
    awk -v w="$w" -v o="${med[ddp.$w]}" -v a="${med[ddpalt.$w]}" -v opts="${BENCH_DDPRUN_OPTS:-(defaults)}" \
      -v alt="$BENCH_DDP_COMPARE" -v ro="${runs[ddp.$w]}" -v ra="${runs[ddpalt.$w]}" \
      'BEGIN { printf "world %s: ddprun %s %.0f samples/s, ddprun %s %.0f samples/s: ratio %.3f (rounds: %s/ %s)\n", w, opts, o, alt, a, o / a, ro, ra }'
  done
fi
if [ -n "${med[ddp.1]:-}" ] && [ -n "${med[ddp.2]:-}" ]; then
  awk -v o1="${med[ddp.1]}" -v o2="${med[ddp.2]}" -v t1="${med[torch.1]}" -v t2="${med[torch.2]}" \
    'BEGIN { printf "scaling efficiency 1 -> 2: ddp %.1f%%, torch %.1f%%\n", 100 * o2 / (2 * o1), 100 * t2 / (2 * t1) }'
  echo "scaling efficiency, median of the rounds' own: ddp ${med[eff.ddp]}%, torch ${med[eff.torch]}% (rounds: ddp ${runs[eff.ddp]}; torch ${runs[eff.torch]})"
  awk -v o1="${med[ddp.1]}" -v o2="${med[ddp.2]}" -v t2="${med[torch.2]}" -v p="${med[pair]}" \
    'BEGIN { printf "machine ceiling (two independent world-1 runs at once): %.0f samples/s = %.1f%% of 2 x world 1; world 2 reaches ddp %.1f%%, torch %.1f%% of it\n", p, 100 * p / (2 * o1), 100 * o2 / p, 100 * t2 / p }'
fi
for w in "${worlds[@]}"; do
  [ -n "${med[preempted.$w]:-}" ] || continue
  awk -v w="$w" -v p="${med[preempted.$w]}" -v q="${med[preempted_pct.$w]}" \
    'BEGIN { printf "ddp world %s: its ranks waited for a CPU held by another task %.3f ms a step together (%.2f%% of a step; medians)\n", w, p, q }'
done
if [[ " ${worlds[*]} " == *" 1 "* ]]; then
  "$bin/ddp-plot" scaling "$table" -o "$out_dir/scaling.svg" \
    --title "ConvNet, batch 100 per rank: median of $rounds rounds, $steps steps ($cores cores)" ||
    die "ddp-plot could not draw $table"
  echo "scaling figure: $out_dir/scaling.svg (from $table)"
else
  echo "scaling figure: none (its efficiency needs world 1 among BENCH_WORLDS); runs in $table"
fi
