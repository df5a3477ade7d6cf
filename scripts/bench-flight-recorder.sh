#!/usr/bin/env bash
# The flight recorder's cost (issue 27): issue 5's 8-byte allreduce with the
# ring on (DDP_FLIGHT_RECORDER_SIZE unset: 2000) and off (0), alternated
# round by round in the same go (which goes first alternates too), medians
# of the rounds. Also one rank alone (the self backend: nothing to wait for,
# so the group layer's own cost per call shows).
#   scripts/bench-flight-recorder.sh [ROUNDS] [BUILD]   (default 21, build)
# Prints each round's times and the medians (us per allreduce, slowest rank).
set -euo pipefail
rounds=${1:-21}
build=${2:-build}
bench=$build/bin/ddp-bench
[ -x "$bench" ] || { echo "no $bench: build it first" >&2; exit 2; }
iters=${ITERS:-20000}

one() { # NPROC SIZE-VAR -> time_us
  DDP_FLIGHT_RECORDER_SIZE=$2 "$bench" allreduce --nproc "$1" -b 8 -e 8 -n "$iters" -w 1000 -c 0 --json 2>/dev/null |
    sed -n 's/.*"time_us":\([0-9.]*\).*/\1/p'
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

for nproc in 2 1; do
  on=() off=()
  echo "ddp-bench allreduce --nproc $nproc -b 8 -e 8 -n $iters, $rounds rounds (on = 2000 records, off = 0):"
  for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then
      a=$(one "$nproc" 2000); b=$(one "$nproc" 0)
    else
      b=$(one "$nproc" 0); a=$(one "$nproc" 2000)
    fi
    on+=("$a") off+=("$b")
    printf '  round %2d: on %s us, off %s us\n' "$r" "$a" "$b"
  done
  mon=$(printf '%s\n' "${on[@]}" | median)
  moff=$(printf '%s\n' "${off[@]}" | median)
  awk -v a="$mon" -v b="$moff" -v n="$nproc" 'BEGIN { printf "  medians, %d rank%s: on %.3f us, off %.3f us, on/off %.3f (%+.1f ns)\n", n, (n > 1 ? "s" : ""), a, b, a / b, (a - b) * 1000 }'
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
