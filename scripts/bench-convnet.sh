#!/usr/bin/env bash
# ddp vs PyTorch on one training step of the seed's ConvNet (batch 100, one
# thread, Fashion-MNIST), measured in the same go: the runs alternate, each
# side's figure is the median of its rounds, and the ratio is ddp / PyTorch.
# Beside the ratio: the CPU model, ddp's kernel family, PyTorch's version and
# CPU capability, and ddp's step as a fraction of the core's FMA peak at its
# family's vector width (build/bin/bench_fma_peak, measured in the same go):
# the step's direct-convolution FLOPs per sample (16.40 MFLOP: conv1
# forward and dW 2 x 0.627, conv2 forward, dW and dX 3 x 5.018, the linear
# layer 3 x 0.031) x samples/s / peak.
#   scripts/bench-convnet.sh [rounds=5] [steps=150]
# Env: DDP_CPU_KERNELS (auto|generic|avx2|avx512) picks ddp's family;
# BENCH_PYTHON the Python whose torch is the reference (default
# /usr/bin/python3, Debian's python3-torch; /opt/torch-venv/bin/python for
# PyTorch 2.x, scripts/install-deps.sh refs); ATEN_CPU_CAPABILITY and
# ONEDNN_MAX_CPU_ISA reach PyTorch (avx2 and AVX2 hold PyTorch 2.x to AVX2 on
# an AVX-512 CPU: with DDP_CPU_KERNELS=avx2, a proxy for an AVX2-only CPU).
# BENCH_BUILD: the build whose programs run (default build; build-portable
# holds the AVX2 family to AVX2 encodings on an AVX-512 CPU, where the
# native build's *_avx2 functions may use AVX-512VL's).
# Needs BENCH_BUILD/bin/bench_convnet and bench_fma_peak (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-150}
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_ddp_convnet.py
py=${BENCH_PYTHON:-/usr/bin/python3}
bin=${BENCH_BUILD:-build}/bin
[ -x "$bin/bench_convnet" ] || { echo "bench-convnet: build first (scripts/build.sh)" >&2; exit 2; }
[ -f "$ref" ] || { echo "bench-convnet: $ref not found (set DDP_SHARED_DIR)" >&2; exit 2; }
"$py" -c "import torch" 2>/dev/null || { echo "bench-convnet: $py has no torch (apt-get install python3-torch, or BENCH_PYTHON)" >&2; exit 2; }

# The model name, and family and model (a VM's name may say only "AMD EPYC").
cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1) (family $(sed -n 's/^cpu family[[:space:]]*: //p' /proc/cpuinfo | head -n 1), model $(sed -n 's/^model[[:space:]]*: //p' /proc/cpuinfo | head -n 1))"
torch=$("$py" -c 'import torch
cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
print(torch.__version__, cap)' 2>/dev/null)
peak_line=""
[ -x "$bin/bench_fma_peak" ] && peak_line=$("$bin/bench_fma_peak" | sed -n 's/^fma_peak //p')
family=$(sed -n 's/.*family=\([a-z0-9]*\).*/\1/p' <<<"$peak_line")
peak=$(sed -n 's/.*gflops=\([0-9.]*\).*/\1/p' <<<"$peak_line")
echo "cpu: $cpu; ddp family: ${family:-?}; torch: $torch (ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-unset}, ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-unset}); load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

ours=() theirs=()
for r in $(seq "$rounds"); do
  o=$("$bin/bench_convnet" --steps "$steps" --repeats 1 | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p')
  t=$("$py" "$ref" --world 1 --steps "$steps" 2>/dev/null | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p')
  echo "round $r: ddp $o samples/s, torch $t samples/s" >&2
  ours+=("$o"); theirs+=("$t")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mo=$(median "${ours[@]}"); mt=$(median "${theirs[@]}")
awk -v o="$mo" -v t="$mt" -v r="$rounds" -v fam="${family:-?}" -v peak="${peak:-0}" \
    -v cpu="$cpu" -v torch="$torch" 'BEGIN {
  frac = peak > 0 ? sprintf("%.0f%% of the %.0f GFLOP/s FMA peak", 100 * o * 16.40128e6 / 1e9 / peak, peak) : "FMA peak not measured"
  printf "convnet batch=100 threads=1: ddp %.0f samples/s, torch %.0f samples/s, ratio %.2fx (median of %d rounds); ddp family %s, step at %s; cpu %s; torch %s\n", o, t, o / t, r, fam, frac, cpu, torch }'
