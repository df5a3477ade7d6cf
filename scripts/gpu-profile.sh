#!/usr/bin/env bash
# Where ddp's ConvNet step spends its GPU time, kernel by kernel: Nsight
# Compute (ncu, which runs the kernels one at a time) over 160 kernels of
# bench_convnet --device cuda after its warm-up, at batch 100 and 1024,
# summed per kernel and per kind (batch norm, cuBLAS, im2col/col2im, cuDNN,
# pooling). Runs on the GPU machine from the repository root with
# .gpu-carry/ (scripts/gpu-prepare.sh), like scripts/gpu-check.sh; about
# 15 s. Output: OUTDIR/ncu_b*.csv (ncu's raw table) and the summary on
# stdout. Usage: bash scripts/gpu-profile.sh [OUTDIR]   (default $OUT, else /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
b=$(mktemp -d /tmp/gpu-profile.XXXXXX)
trap 'rm -rf "$b"' EXIT
tar -C "$b" -xJf .gpu-carry/bundle.tar.xz
export LD_LIBRARY_PATH=$b/libs:$b/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
[ -n "$ncu" ] || { echo "gpu-profile: no ncu here" >&2; exit 77; }
for batch in 100 1024; do
  timeout 120 "$ncu" --csv --metrics gpu__time_duration.sum --launch-skip 150 --launch-count 160 \
    "$b/bin/bench_convnet" --device cuda --data synthetic --batch "$batch" --steps 6 --warmup 6 \
    --repeats 1 >"$out/ncu_b$batch.csv" 2>"$out/ncu_b$batch.err"
done
python3 - "$out" <<'PY'
import collections, csv, sys
KINDS = [("batch norm", ("channel_partials", "dx_planes", "backward_channel", "stats_var", "stats_mean",
                         "channel_parts", "channel_sums_add")),
         ("im2col/col2im/permute", ("im2col", "col2im", "permute")),
         ("cuDNN conv", ("xmma_fprop", "xmma_dgrad", "wgrad", "implicit_convolve", "op_generic_tensor")),
         ("cuBLAS gemm", ("gemm", "sgemm", "splitK")),
         ("pooling", ("pool",))]
for batch in (100, 1024):
    rows = list(csv.reader(l for l in open(f"{sys.argv[1]}/ncu_b{batch}.csv") if l.startswith('"')))
    h = rows[0]
    ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}
    per, kind = collections.Counter(), collections.Counter()
    for r in rows[1:]:
        us = float(r[vi].replace(",", "")) * scale[r[ui]]
        per[r[ki][:80]] += us
        kind[next((k for k, keys in KINDS if any(x in r[ki] for x in keys)), "other")] += us
    total = sum(per.values())
    print(f"batch {batch}: {len(rows) - 1} kernels, {total:.0f} us (ncu runs them one at a time)")
    print("  by kind: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in kind.most_common()))
    for name, us in per.most_common(12):
        print(f"  {us:9.1f} us  {name}")
PY
