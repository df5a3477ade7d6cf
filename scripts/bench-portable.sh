#!/usr/bin/env bash
# What building libddp for any x86-64 costs (docs/install.md): one training
# step of the seed's ConvNet (bench_convnet: batch 100, one thread,
# Fashion-MNIST) from the native build (build/, -march=native) and from the
# portable build (build-portable/, -DDDP_NATIVE=OFF: baseline x86-64, the
# AVX-512 kernels chosen at run time), and the portable build with the
# generic kernels forced (DDP_CPU_KERNELS=generic: what a CPU without
# AVX-512 runs, on this CPU). The three alternate round by round in the same
# go. Per variant: the median of its rounds' samples/s, and the median CPU
# time of its runs (user + system seconds for the same fixed work, which
# time slices lost to other tasks do not inflate); ratios are to native.
#   scripts/bench-portable.sh [rounds=5] [steps=150]
# Needs build/bin/bench_convnet and build-portable/bin/bench_convnet
# (scripts/build.sh release; scripts/build.sh portable).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-150}
for b in build build-portable; do
  [ -x $b/bin/bench_convnet ] ||
    { echo "bench-portable: $b/bin/bench_convnet missing (scripts/build.sh release and portable)" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run() { # BUILD KERNELS: prints "samples/s cpu_s" of one run
  local TIMEFORMAT='%U %S' rate cpu
  { time DDP_CPU_KERNELS=$2 $1/bin/bench_convnet --steps "$steps" --repeats 1 >"$tmp/out"; } 2>"$tmp/time"
  rate=$(sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p' "$tmp/out")
  cpu=$(awk '{print $1 + $2}' "$tmp/time")
  echo "$rate $cpu"
}
declare -A rate cpu
variants=(native portable generic)
for r in $(seq "$rounds"); do
  line="round $r:"
  for v in "${variants[@]}"; do
    case $v in
      native) read -r s c < <(run build auto) ;;
      portable) read -r s c < <(run build-portable auto) ;;
      generic) read -r s c < <(run build-portable generic) ;;
    esac
    rate[$v]+="$s "; cpu[$v]+="$c "
    line+=" $v $s samples/s ${c} s CPU,"
  done
  echo "${line%,}" >&2
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
# shellcheck disable=SC2086 # the lists are space-separated numbers
for v in "${variants[@]}"; do
  eval "r_$v=$(median ${rate[$v]}) c_$v=$(median ${cpu[$v]})"
done
awk -v r="$rounds" -v rn="$r_native" -v rp="$r_portable" -v rg="$r_generic" \
    -v cn="$c_native" -v cp="$c_portable" -v cg="$c_generic" 'BEGIN {
  printf "convnet batch=100 threads=1, medians of %d rounds:\n", r
  printf "  native    %6.0f samples/s           %6.2f s CPU\n", rn, cn
  printf "  portable  %6.0f samples/s (%.3fx)  %6.2f s CPU (%.3fx native)\n", rp, rp / rn, cp, cp / cn
  printf "  generic   %6.0f samples/s (%.3fx)  %6.2f s CPU (%.3fx native)\n", rg, rg / rn, cg, cg / cn }'
