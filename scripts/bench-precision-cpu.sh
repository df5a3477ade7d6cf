#!/usr/bin/env bash
# bf16 (and fp16) against fp32 on the CPU for issue 42's "On each CPU seen,
# bf16 against fp32, with the instruction set used": the seed's ConvNet
# training step (bench_convnet: batch 100, one thread, Fashion-MNIST), the
# precisions alternating round by round in the same go, each precision's
# figure the median of its rounds, the ratio low / fp32 (above 1: faster
# than fp32). Prints the CPU, ddp's kernel family and the low-precision
# path's instructions (vdpbf16ps where the CPU has AVX512_BF16), and the
# load average: run it on a quiet machine (timings under load are not
# figures: memory-bound passes suffer most, and the low precisions have
# more of them).
#   scripts/bench-precision-cpu.sh [rounds=3] [steps=150] [repeats=3] [precisions="bf16"]
# A precision "bf16-f32conv" is bf16 with DDP_CONV_BF16=0: the
# convolutions on the float32 kernels with rounded operands instead of the
# vdpbf16ps ones (docs/tensor.md, "bfloat16 convolutions"), to show their part.
# Env: DDP_CPU_KERNELS (auto|generic|avx2|avx512) picks the family;
# BENCH_BUILD the build whose bench_convnet runs (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-150}
repeats=${3:-3}
read -r -a lows <<<"${4:-bf16}"
bin=${BENCH_BUILD:-build}/bin
[ -x "$bin/bench_convnet" ] || { echo "bench-precision-cpu: build first (scripts/build.sh)" >&2; exit 2; }
cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) (family $(sed -n 's/^cpu family[[:space:]]*: //p' /proc/cpuinfo | head -n 1), model $(sed -n 's/^model[[:space:]]*: //p' /proc/cpuinfo | head -n 1))"
bf16=$(grep -qw avx512_bf16 /proc/cpuinfo && echo yes || echo no)
echo "cpu: $cpu; avx512_bf16: $bf16; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A rates
for r in $(seq "$rounds"); do
  for p in fp32 "${lows[@]}"; do
    env=()
    pp=$p
    [ "$p" = bf16-f32conv ] && env=(DDP_CONV_BF16=0) && pp=bf16
    out=$(env ${env[@]+"${env[@]}"} "$bin/bench_convnet" --steps "$steps" --repeats "$repeats" --precision "$pp")
    rate=$(sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p' <<<"$out")
    [ "$r" = 1 ] && echo "$p: $(sed -n 's/^CPU kernel family: //p' <<<"$out")"
    echo "round $r: $p $rate samples/s"
    rates[$p]="${rates[$p]:-} $rate"
  done
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m32=$(median "${rates[fp32]}")
for p in "${lows[@]}"; do
  m=$(median "${rates[$p]}")
  awk -v p="$p" -v m="$m" -v f="$m32" -v r="$rounds" -v s="$steps" 'BEGIN {
    printf "convnet batch=100 threads=1 steps=%d: %s %.0f samples/s, fp32 %.0f samples/s, %s/fp32 %.3fx (medians of %d alternating rounds)\n", s, p, m, f, p, m / f, r }'
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
