#!/usr/bin/env bash
# Small allreduces when 2 ranks share one CPU (BENCHMARKS.md, "Collectives:
# ranks sharing a CPU"): float32 SUM between 2 local ranks, 8 B and 64 KiB,
# ddp-bench placed three ways, alternated for several rounds in one go:
#   taskset -c 0   both ranks may run only on CPU 0 (the affinity check
#                  sees it: waits spin briefly from the start);
#   unpinned       --bind none: left to the scheduler, which stacks them on
#                  one core when something else keeps the other busy (the
#                  waits find out);
#   --bind core    a CPU each (the case that must not get slower; ddp-bench's
#                  default since issue 20);
# and Open MPI (refs/mpi_allreduce.c) with both ranks on CPU 0
# (mpirun --bind-to core --cpu-set 0), at 8 B only: it spins for whole time
# slices there, and 2000 iterations take about 8 s.
# Prints every round's time per op and the medians.
# Usage: scripts/bench-oversubscribed.sh [ROUNDS (5)] [BUILD_DIR (build)]
#   REFS=/path/to/refs (default ../shared/refs, else ../../shared/refs, from
#   the repository root);
#   BEFORE=/path/to/another/build: its ddp-bench runs too, alternated with
#   this one (to compare two versions of the library in one go).
# Needs: a Release/RelWithDebInfo build of ddp-bench, Open MPI
# (scripts/install-deps.sh mpi); skips Open MPI when mpicc is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
build=${2:-build}
refs=${REFS:-../shared/refs}
[ -d "$refs" ] || [ -n "${REFS:-}" ] || refs=../../shared/refs # from a worktree one level down
out=$(mktemp -d /tmp/bench-oversubscribed.XXXXXX)
[ -x "$build/bin/ddp-bench" ] || { echo "no $build/bin/ddp-bench: scripts/build.sh release" >&2; exit 1; }
mpi=
if command -v mpicc >/dev/null && mpicc -O2 "$refs/mpi_allreduce.c" -o "$out/mpi_allreduce"; then
  mpi=$out/mpi_allreduce
else
  echo "(no Open MPI: scripts/install-deps.sh mpi; its row is left out)"
fi
versions=("this=$build")
[ -n "${BEFORE:-}" ] && versions+=("before=$BEFORE")

one() { # label bench size prefix... (BIND=core or none)
  local label=$1 bench=$2 size=$3
  shift 3
  local t
  t=$("$@" "$bench" allreduce --nproc 2 -b "$size" -e "$size" -n 2000 -w 20 -c 1 --json \
      --bind "${BIND:-none}" 2>/dev/null | grep -o '"time_us":[0-9.]*' | cut -d: -f2)
  echo "$label $size ${t:-failed}" | tee -a "$out/raw"
}

echo "load: $(uptime)"
for r in $(seq "$rounds"); do
  for v in "${versions[@]}"; do
    name=${v%%=*} dir=${v#*=}
    bench=$dir/bin/ddp-bench
    for size in 8 65536; do
      lib=LD_LIBRARY_PATH=$dir/lib # each build's own library
      BIND=none one "$name,taskset-c0" "$bench" "$size" taskset -c 0 env "$lib"
      BIND=none one "$name,unpinned" "$bench" "$size" env "$lib"
      BIND=core one "$name,bind-core" "$bench" "$size" env "$lib"
    done
  done
  if [ -n "$mpi" ]; then
    t=$(timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to core --cpu-set 0 -np 2 \
        "$mpi" 8 2>/dev/null | sed -n 's/.* us=\([0-9.]*\).*/\1/p')
    echo "openmpi,cpu-set0 8 ${t:-failed}" | tee -a "$out/raw"
  fi
done
echo "load: $(uptime)"
echo "medians (us per allreduce; raw in $out/raw):"
sort -k1,1 -k2,2n "$out/raw" | awk '
  { key = $1 " " $2; v[key] = v[key] " " $3; n[key]++ }
  END {
    for (k in v) {
      m = split(substr(v[k], 2), a, " ");
      for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
      med = m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2;
      printf "%-28s %9s B  median %10.2f  of%s\n", substr(k, 1, index(k, " ") - 1), substr(k, index(k, " ") + 1), med, v[k]
    }
  }' | sort
