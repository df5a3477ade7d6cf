#!/usr/bin/env bash
# Issue 42's mixed-precision checks on a GPU, one per call, for
# scripts/gpu-check.sh's (amp) section (docs/cuda.md, "Mixed precision";
# docs/mixed-precision.md). Each prints its table or verdict at the end of
# its output (gpu-check.sh keeps the tail in report.md) and exits 0 pass,
# 1 fail, 77 skip (no GPU: "no CUDA device" on stdout).
#
#   amp_parity  the machine's own PyTorch 2.x makes the CUDA-autocast
#       fixtures (scripts/make_autocast_fixtures.py --device cuda: the
#       seeds' shapes under torch.autocast("cuda", bf16 / fp16), TF32 and
#       reduced-precision reductions off), then test_cuda_autocast_parity
#       compares ddp's outputs (dtype, and values within 1 ulp of the output
#       dtype plus the float32 accumulation bound) and the chain's gradients
#   amp_speed   the ConvNet at batch 1024 (synthetic data on the device):
#       ddp fp32, ddp bf16 (conv on cuDNN's 16-bit path, and with
#       DDP_CUDA_CONV=im2col: conv on rounded float32 operands) and PyTorch
#       eager with torch.autocast bf16, in alternating rounds (ROUNDS,
#       default 3; each a separate process, one timed repeat of STEPS
#       steps); medians; Must show: ddp's better bf16 >= 1.3x ddp fp32 and
#       >= 1.3x PyTorch's autocast bf16 (both bars judged)
#   amp_mlp     mlp:4096x8 (10 -> 4096 x7 -> 5, 100.8 M weights) at batch
#       2048, ddp fp32 against bf16 (and tf32), with the matmul TFLOPS
#       reached (6 flops per weight per sample): reported, PASS when all ran
#   amp_scaler  ddp-train --precision fp16 --device cuda, 8 steps, an inf
#       injected at step 3 (DDP_TEST_INJECT_INF): exactly step 3 skipped,
#       the scale halved there (65536 -> 32768), nothing else skipped
#   amp_acc     the ConvNet 3 epochs on Fashion-MNIST on the GPU, fp32, bf16
#       and fp16 (with the scaler), seed 1 (more seeds: AMP_SEEDS="1 2 3"):
#       bf16 and fp16 mean test accuracy within 0.5 points of fp32's
#
# Usage: scripts/gpu-amp-steps.sh STEP DATA OUTDIR
#   GPU_AMP_DEVICE=cpu runs ddp's side of amp_scaler, amp_mlp (and, slowly,
#   amp_acc) on the CPU: a dry run of this script's logic without a GPU.
#   DDP_BIN_DIR: ddp-train, bench_convnet; DDP_TEST_DIR (default
#   $DDP_BIN_DIR/../tests): test_cuda_autocast_parity. OUTDIR keeps the
#   fixtures and each step's JSON lines (amp-STEP.jsonl).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
step=${1:?step}
data=${2:?data}
outdir=${3:?outdir}
bin=${DDP_BIN_DIR:?}
tests=${DDP_TEST_DIR:-$bin/../tests}
py=$(command -v "${GPU_CHECK_PYTHON:-python3}") || { echo "SKIP: no python3"; exit 77; }
mkdir -p "$outdir" || exit 2
jsonl=$outdir/amp-$step.jsonl
: >"$jsonl"
tmp=$(mktemp -d /tmp/gpu-amp.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
dev=${GPU_AMP_DEVICE:-cuda}
if [ "$dev" = cuda ] && ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "SKIP: no CUDA device (nvidia-smi lists no GPU)"
  exit 77
fi
# jnum KEY FILE: the number after "KEY": in FILE's last line holding it.
jnum() { grep "\"$1\"" "$2" 2>/dev/null | tail -n 1 | sed -n "s/.*\"$1\": *\([-0-9.eE+]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR] = $1} END {if (NR) print v[int((NR + 1) / 2)]}'; }

case $step in
amp_parity)
  fx=$outdir/fixtures
  mkdir -p "$fx"
  "$py" "$here/scripts/make_autocast_fixtures.py" --device cuda --out "$fx" || {
    rc=$?
    [ "$rc" = 77 ] && exit 77
    fail "making the CUDA fixtures (exit $rc)"
  }
  exe=$tests/test_cuda_autocast_parity
  [ -x "$exe" ] || fail "no $exe carried"
  DDP_AUTOCAST_CUDA_FIXTURES=$fx "$exe"
  ;;

amp_speed)
  rounds=${ROUNDS:-3} steps=${STEPS:-50}
  for r in $(seq 1 "$rounds"); do
    for impl in ddp_fp32 ddp_bf16 ddp_bf16_im2col torch_bf16; do
      case $impl in
        ddp_bf16_im2col) DDP_CUDA_CONV=im2col "$bin/bench_convnet" --device "$dev" --batch 1024 --steps "$steps" \
                 --warmup 10 --repeats 1 --precision bf16 --json >"$tmp/o" 2>&1 ;;
        ddp_*) "$bin/bench_convnet" --device "$dev" --batch 1024 --steps "$steps" --warmup 10 --repeats 1 \
                 --precision "${impl#ddp_}" --json >"$tmp/o" 2>&1 ;;
        torch_bf16) "$py" "$here/scripts/torch/gpu_convnet_step.py" --batch 1024 --rounds 1 --steps "$steps" \
                 --warmup 10 --autocast bf16 >"$tmp/o" 2>&1 ;;
      esac
      rc=$?
      cat "$tmp/o"
      [ "$rc" = 77 ] && exit 77
      [ "$rc" = 0 ] || fail "$impl round $r: exit $rc"
      key=samples_per_s
      [ "$impl" = torch_bf16 ] && key=samples_per_s_median
      v=$(jnum "$key" "$tmp/o")
      [ -n "$v" ] || fail "$impl round $r: no $key"
      echo "$v" >>"$tmp/$impl"
      printf '{"step": "amp_speed", "impl": "%s", "round": %d, "batch": 1024, "samples_per_s": %s}\n' \
        "$impl" "$r" "$v" >>"$jsonl"
    done
  done
  f32=$(median <"$tmp/ddp_fp32") b16c=$(median <"$tmp/ddp_bf16") b16i=$(median <"$tmp/ddp_bf16_im2col")
  tb16=$(median <"$tmp/torch_bf16")
  b16=$(printf '%s\n' "$b16c" "$b16i" | sort -g | tail -n 1) # ddp's best bf16, as (c) takes ddp's best
  echo ""
  echo "| ConvNet, batch 1024 (medians of $rounds alternating rounds) | samples/s |"
  echo "| --- | --- |"
  echo "| ddp fp32 (DDP_CUDA_CONV auto) | $f32 |"
  echo "| ddp bf16, conv through cuDNN in 16 bits | $b16c |"
  echo "| ddp bf16, DDP_CUDA_CONV=im2col (conv on rounded float32 operands) | $b16i |"
  echo "| PyTorch eager, torch.autocast bf16 | $tb16 |"
  v=$(awk -v b="$b16" -v f="$f32" -v t="$tb16" 'BEGIN {
    r1 = b / f; r2 = b / t
    printf "ddp bf16 / ddp fp32 = %.2fx (bar 1.3x), ddp bf16 / torch bf16 = %.2fx (bar 1.3x): %s\n",
      r1, r2, (r1 >= 1.3 && r2 >= 1.3) ? "PASS" : "FAIL" }')
  echo "$v"
  case $v in *PASS) exit 0 ;; *) exit 1 ;; esac
  ;;

amp_mlp)
  for p in fp32 bf16 tf32; do
    "$bin/bench_convnet" --device "$dev" --model mlp:4096x8 --batch 2048 --steps 20 --warmup 5 --repeats 3 \
      --precision "$p" --json >"$tmp/o" 2>&1
    rc=$?
    cat "$tmp/o"
    [ "$rc" = 77 ] && exit 77
    [ "$rc" = 0 ] || fail "mlp $p: exit $rc"
    sps=$(jnum samples_per_s "$tmp/o") tf=$(jnum tflops "$tmp/o")
    [ -n "$tf" ] || fail "mlp $p: no tflops"
    echo "$p $sps $tf" >>"$tmp/t"
    printf '{"step": "amp_mlp", "precision": "%s", "batch": 2048, "samples_per_s": %s, "tflops": %s}\n' \
      "$p" "$sps" "$tf" >>"$jsonl"
  done
  echo ""
  echo "| mlp:4096x8, batch 2048 | samples/s | TFLOPS | vs fp32 |"
  echo "| --- | --- | --- | --- |"
  awk 'NR == 1 {f = $2} {printf "| %s | %s | %s | %.2fx |\n", $1, $2, $3, $2 / f}' "$tmp/t"
  ;;

amp_scaler)
  DDP_TEST_INJECT_INF=3 "$bin/ddp-train" --model convnet --precision fp16 --device "$dev" --data "$data" \
    --epochs 1 --max-steps 8 --batch-size 100 --lr 0.01 --momentum 0.9 --seed 1 --log "$tmp/log.jsonl" --json
  rc=$?
  [ "$rc" = 77 ] && exit 77
  [ "$rc" = 0 ] || fail "ddp-train exit $rc"
  cp "$tmp/log.jsonl" "$jsonl"
  grep '"skipped"' "$tmp/log.jsonl" | sed 's/.*"step": \([0-9]*\),.*"loss_scale": \([0-9.e+]*\), "skipped": \([a-z]*\).*/\1 \2 \3/' >"$tmp/s"
  cat "$tmp/s"
  [ "$(wc -l <"$tmp/s")" -ge 8 ] || fail "expected 8 steps with a loss_scale in the log"
  awk '$3 == "true" {print $1}' "$tmp/s" | paste -sd' ' >"$tmp/sk"
  [ "$(cat "$tmp/sk")" = 3 ] || fail "skipped steps: '$(cat "$tmp/sk")', expected exactly step 3"
  s2=$(awk '$1 == 2 {print $2}' "$tmp/s") s3=$(awk '$1 == 3 {print $2}' "$tmp/s")
  awk -v a="$s2" -v b="$s3" 'BEGIN {exit !(a == 65536 && b == 32768)}' ||
    fail "scale at step 2 $s2, step 3 $s3: expected 65536 then 32768"
  echo "PASS: step 3 skipped (inf injected), scale 65536 -> 32768, no other step skipped"
  ;;

amp_acc)
  seeds=${AMP_SEEDS:-1}
  for p in fp32 bf16 fp16; do
    for s in $seeds; do
      "$bin/ddp-train" --model convnet --epochs 3 --batch-size 100 --lr 0.01 --momentum 0.9 --seed "$s" \
        --device "$dev" --precision "$p" --data "$data" --json >"$tmp/o" 2>&1
      rc=$?
      tail -n 3 "$tmp/o"
      [ "$rc" = 77 ] && exit 77
      [ "$rc" = 0 ] || fail "$p seed $s: exit $rc"
      acc=$(jnum test_accuracy "$tmp/o")
      [ -n "$acc" ] || fail "$p seed $s: no test_accuracy"
      echo "$acc" >>"$tmp/$p"
      printf '{"step": "amp_acc", "precision": "%s", "seed": %s, "test_accuracy": %s}\n' "$p" "$s" "$acc" >>"$jsonl"
    done
  done
  mean() { awk '{s += $1} END {printf "%.4f", s / NR}' "$1"; }
  f=$(mean "$tmp/fp32") b=$(mean "$tmp/bf16") h=$(mean "$tmp/fp16")
  echo ""
  echo "| ConvNet 3 epochs on the GPU, seeds $seeds | mean test accuracy |"
  echo "| --- | --- |"
  echo "| fp32 | $f |"
  echo "| bf16 | $b |"
  echo "| fp16 (GradScaler) | $h |"
  v=$(awk -v f="$f" -v b="$b" -v h="$h" 'BEGIN {
    db = 100 * (b - f); dh = 100 * (h - f)
    ok = db <= 0.5 && db >= -0.5 && dh <= 0.5 && dh >= -0.5
    printf "bf16 %+.2f points, fp16 %+.2f points against fp32 (bar 0.5): %s\n", db, dh, ok ? "PASS" : "FAIL" }')
  echo "$v"
  case $v in *PASS) exit 0 ;; *) exit 1 ;; esac
  ;;

*)
  echo "gpu-amp-steps.sh: unknown step '$step' (amp_parity, amp_speed, amp_mlp, amp_scaler, amp_acc)" >&2
  exit 2
  ;;
esac
