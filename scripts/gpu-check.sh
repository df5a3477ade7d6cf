#!/usr/bin/env bash
# The GPU checks of issue 26 (docs/cuda.md, "Checking on a GPU"), run on the
# GPU machine from the repository root with .gpu-carry/ present (made here by
# scripts/gpu-prepare.sh), in at most 5 minutes:
#   (a) every carried CUDA test (test_cuda_*): PASS, FAIL or SKIP (exit 77);
#   (b) the PyTorch reference step, scripts/torch/gpu_convnet_step.py, at
#       batch 100 and 1024 (eager, deterministic cuDNN, CUDA graph);
#   (c) ddp's own step, bench_convnet --device cuda, at the same batches,
#       eager and replayed as a CUDA graph (--cuda-graph), each with the
#       convolution as im2col + cuBLAS and as cuDNN (DDP_CUDA_CONV), and the
#       speed bars against PyTorch's eager step on ddp's best (>= 2x at 100,
#       >= 1x at 1024; at 100 the goal, 5x, reported beside it);
#   (e) the ToyMpModel across devices, toy_mp_devices, when built;
#   (d) the ConvNet trained 3 epochs on the GPU (ddp-train --device cuda) for
#       seeds 1 2 3, against the CPU runs carried (mean within 0.5 points),
#       and seed 1 again with --cuda-graph against its eager GPU run.
# (d) runs last of these: it is the longest and gets whatever time is left.
# (amp) Issue 42's mixed precision (scripts/gpu-amp-steps.sh: CUDA-autocast
#   parity against the machine's PyTorch, the ConvNet bf16 speed bars, the
#   4096-wide MLP's TFLOPS, the GradScaler skipping an injected inf, the
#   accuracy) comes after every other section, with what time is left, each
#   step skipping when there is none; GPU_CHECK_ONLY=amp runs the
#   environment and the (amp) section alone, within the same budget.
# Issue 39's steps (NCCL) come first, in its priority order, under (n):
#   (n1) test_nccl_ops: NCCL accepts two ranks on one GPU with distinct
#        NCCL_HOSTID (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1), and every
#        operation over NCCL at world 1 and 2, every dtype and reduce op,
#        equals the closed-form (CPU) results; the same ranks without
#        NCCL_HOSTID are refused naming both;
#   (n2) ConvNet --sync-bn, 2 ranks x 50 on the GPU vs 1 x 100, 10 steps,
#        within docs/parallel.md's bound; (n2acc) 3 epochs at world 2 >= 89 %;
#   (n3kill, n3stop) rank 1 SIGKILLed: rank 0 fails within 10 s naming it;
#        SIGSTOPped: the job ends by its timeout with the flight recorder's
#        verdict naming it;
#   (n4) --resume on the GPU bit-identical; the GPU checkpoint loads in
#        PyTorch (strict=True) and in a CPU run
#   (scripts/gpu-dp-steps.sh, each under its own timeout);
#   (n5) ddp-bench allreduce --device cuda against PyTorch's all_reduce
#        over NCCL, alternating rounds, >= 0.95x from 1 MiB up;
#   (n6numa) the rank's CPUs near its GPU (ddp-train's decision, sysfs);
#   (n7mnist) mnist_ddp --device cuda at world 2 on NCCL; (n8hpo) ddp-hpo
#        --objective convnet --device cuda, a worker of 2 ranks;
#   (n9pp1..n9pp4) the pipeline's stages on the GPU (scripts/gpu-pp-steps.sh):
#        over NCCL and staged, each == the CPU pipeline; resume bit for bit;
#        model_parallel_hpc --device cuda.
# n1's test_nccl_ops includes batch_isend_irecv on NCCL (a 16 MiB ring that
# completes only when the batch is grouped by ncclGroupStart/End).
# libnccl.so.2 is the machine's own (the loader's cache, /usr/local/cuda*,
# the python3's nvidia/nccl/lib): found here and given as DDP_NCCL_LIBRARY.
# Each step has its own timeout inside the whole budget (GPU_CHECK_BUDGET,
# default 440 s: 8 minutes with the unpacking), and is appended to OUTDIR/report.md as soon as it ends, its
# output to OUTDIR/gpu-check.log and its measurements to
# OUTDIR/results.jsonl, so a run cut short still leaves what it did. The last
# line of report.md counts the steps passed, failed and skipped; the exit
# status is 0 only when none failed. Where there is no GPU every GPU step
# reports skipped.
# Usage: bash scripts/gpu-check.sh [OUTDIR]   (default $OUT, else a new temp dir)
#   GPU_CHECK_PYTHON (default python3) runs the PyTorch step.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo=$(pwd)
t_start=$SECONDS
budget=${GPU_CHECK_BUDGET:-440}
py=${GPU_CHECK_PYTHON:-python3}
carry=$repo/.gpu-carry

out=${1:-${OUT:-}}
[ -n "$out" ] || out=$(mktemp -d /tmp/gpu-check.XXXXXX)
mkdir -p "$out" || { echo "gpu-check: cannot make $out" >&2; exit 2; }
out=$(cd "$out" && pwd)
report=$out/report.md
log=$out/gpu-check.log
results=$out/results.jsonl
: >"$report"
: >"$log"
: >"$results"
work=$(mktemp -d /tmp/gpu-check-work.XXXXXX)
data_link=""
cleanup() {
  [ -n "$data_link" ] && rm -f "$data_link"
  rm -rf "$work"
}
trap cleanup EXIT

passed=0 failed=0 skipped=0
# say LINE...: to the report and to stdout (the device tool's output tail).
say() { printf '%s\n' "$@" | tee -a "$report"; }
elapsed() { echo $((SECONDS - t_start)); }
left() { echo $((budget - (SECONDS - t_start))); }
# Each phase ends by its share of the budget (phase_end, seconds from the
# start), so that one hung test cannot starve the others; time a phase
# leaves unused goes to the next ones.
phase_end=$budget
phase() { phase_end=$((budget * $1 / 100)); }
summary() {
  say "" "Summary: $passed passed, $failed failed, $skipped skipped in $(elapsed) s (budget ${budget} s)${1:-}"
}
step_pid="" step_name=""
interrupted() {
  if [ -n "$step_pid" ]; then
    kill -TERM "$step_pid" 2>/dev/null
    wait "$step_pid" 2>/dev/null
    cat "$out/step-running.log" >>"$log" 2>/dev/null && rm -f "$out/step-running.log"
  fi
  summary " (interrupted${step_pid:+ during $step_name})"
  exit 130
}
trap interrupted INT TERM
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", b - a}'; }
json_str() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  '; }
# jnum KEY FILE: the number after "KEY": in FILE's last line holding it.
jnum() { grep "\"$1\"" "$2" 2>/dev/null | tail -n 1 | sed -n "s/.*\"$1\": *\([-0-9.eE+]*\).*/\1/p"; }

# record NAME STATUS SECONDS DETAIL [TAILFILE]: one step's result.
record() {
  local name=$1 status=$2 secs=$3 detail=$4 tailfile=${5:-}
  case $status in # NOTE: a figure for information (a goal), counted nowhere
    PASS) passed=$((passed + 1)) ;;
    FAIL) failed=$((failed + 1)) ;;
    SKIP) skipped=$((skipped + 1)) ;;
  esac
  say "- **$name**: $status ($secs s)${detail:+: $detail}"
  if [ -n "$tailfile" ] && [ -s "$tailfile" ]; then
    {
      echo '  ```text'
      tail -n 12 "$tailfile" | cut -c1-300 | sed 's/^/  /'
      echo '  ```'
    } >>"$report"
  fi
  printf '{"step": "%s", "status": "%s", "seconds": %s, "detail": "%s"}\n' \
    "$name" "$status" "$secs" "$(json_str "$detail")" >>"$results"
}

gpu_present=0
# A test killed by its timeout still shows what it printed up to then.
line_buffered=()
command -v stdbuf >/dev/null && line_buffered=(stdbuf -oL -eL)
nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && gpu_present=1

# run_step NAME WANT_S CMD...: runs CMD under a timeout of WANT_S seconds, or
# less when its phase or the budget has less left (SKIP, not run, when that
# is under 5 s); its output goes to the log and to $work/step.out. Sets
# step_rc, step_secs, step_status (PASS on 0, SKIP on 77 or on a failure
# saying "no CUDA" where there is no GPU, else FAIL) and step_detail; the
# caller records.
run_step() {
  local name=$1 want=$2
  shift 2
  local t
  t=$(($(left) - 5))
  [ $((phase_end - $(elapsed))) -lt "$t" ] && t=$((phase_end - $(elapsed)))
  [ "$want" -lt "$t" ] && t=$want
  : >"$work/step.out"
  if [ "$t" -lt 5 ]; then
    step_rc=-1 step_secs=0 step_status=SKIP step_detail="not run: no time left in its share of the ${budget} s budget"
    return
  fi
  printf '\n===== %s (timeout %d s, at %d s) =====\n$ %s\n' "$name" "$t" "$(elapsed)" "$*" >>"$log"
  echo "gpu-check: $name (timeout $t s)"
  local t0
  t0=$(now)
  # The running step writes to $out/step-running.log: a run killed from
  # outside leaves it there; otherwise it joins gpu-check.log. In the
  # background, so that an interrupt reaches the trap at once.
  step_name=$name
  timeout -k 5 "$t" "${line_buffered[@]}" "$@" </dev/null >"$out/step-running.log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  step_rc=$?
  step_pid=""
  step_secs=$(secs "$t0" "$(now)")
  cat "$out/step-running.log" >>"$log"
  mv "$out/step-running.log" "$work/step.out"
  echo "===== $name: exit $step_rc after $step_secs s" >>"$log"
  step_detail=""
  case $step_rc in
    0) step_status=PASS ;;
    77) step_status=SKIP
      step_detail=$(grep -v '^{' "$work/step.out" | grep -m1 -i 'no CUDA\|skip' | cut -c1-200)
      [ -n "$step_detail" ] || step_detail=$(tail -n 1 "$work/step.out" | cut -c1-200) ;;
    124 | 137) step_status=FAIL step_detail="timed out after $t s" ;;
    *) step_status=FAIL step_detail="exit $step_rc" ;;
  esac
  if [ "$step_status" = FAIL ] && [ "$gpu_present" = 0 ] &&
    grep -qi 'no CUDA\|CUDA driver\|no GPU' "$work/step.out"; then
    step_status=SKIP
    step_detail="no GPU here: $(grep -m1 -i 'no CUDA\|CUDA driver\|no GPU' "$work/step.out" | cut -c1-200)"
  fi
}
# step NAME WANT_S CMD...: run_step, then record with the output's tail.
step() {
  local name=$1
  run_step "$@"
  record "$name" "$step_status" "$step_secs" "$step_detail" "$work/step.out"
}

say "# gpu-check report" "" "$(date -u +'%Y-%m-%d %H:%M:%S UTC') on $(hostname), repository at $(git rev-parse \
  --short HEAD 2>/dev/null || echo '(no git)'), output in $out" ""

# ---- The carry: unpack the bundle, find CUDA's libraries, the data.
if [ ! -f "$carry/bundle.tar.xz" ] || [ ! -f "$carry/manifest.txt" ]; then
  say "" "No .gpu-carry/bundle.tar.xz here: run scripts/gpu-prepare.sh first and carry .gpu-carry."
  failed=1
  summary ""
  exit 1
fi
bundle=$work/bundle
mkdir -p "$bundle"
# tar -J needs the xz program, which a minimal image may lack; python's
# tarfile reads xz itself.
if command -v xz >/dev/null; then
  tar -C "$bundle" -xJf "$carry/bundle.tar.xz"
else
  "$py" -c 'import sys, tarfile
t = tarfile.open(sys.argv[1])
t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))' \
    "$carry/bundle.tar.xz" "$bundle"
fi || { say "" "Could not unpack $carry/bundle.tar.xz"; failed=1; summary ""; exit 1; }
bin=$bundle/bin
data=$carry/data/fashion-mnist

# CUDA's libraries: the machine's own, found by the loader's cache, in
# /usr/local/cuda*, or in the pip nvidia-* packages of its python3.
cuda_dirs=()
cuda_found=()
cuda_missing=()
# One python3 start (importing torch takes seconds) answers all: lines
# "python V", "torch ...", "nvidia DIR" for the pip nvidia-* packages'
# folders, "torchlib DIR".
py_facts=$(timeout 120 "$py" - 2>&1 <<'PY'
import os, sys
print("python", sys.version.split()[0])
try:
    import nvidia
    for d in nvidia.__path__:
        print("nvidia", d)
except ImportError:
    pass
try:
    import torch
    c = torch.cuda.is_available()
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(),
          "device", torch.cuda.get_device_name(0) if c else "none")
    print("torchlib", os.path.join(os.path.dirname(torch.__file__), "lib"))
except Exception as e:
    print("torch", "unavailable:", type(e).__name__, e)
PY
)
py_nvidia=$(sed -n 's/^nvidia //p' <<<"$py_facts")
py_torch_lib=$(sed -n 's/^torchlib //p' <<<"$py_facts")
for so in $(sed -n 's/^cuda_soname //p' "$carry/manifest.txt"); do
  case $so in libcuda.so*) continue ;; esac # the driver's own, always the machine's
  hit=$(ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s {print $NF; exit}')
  if [ -z "$hit" ]; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
      /usr/local/cuda-*/lib64 /usr/local/cuda-*/lib /usr/local/cuda-*/targets/x86_64-linux/lib \
      $py_nvidia $py_torch_lib; do
      [ -d "$d" ] || continue
      hit=$(find "$d/" -maxdepth 4 -name "$so" 2>/dev/null | head -n 1) # "/": through a link
      [ -n "$hit" ] && break
    done
    [ -n "$hit" ] && cuda_dirs+=("$(readlink -f "$(dirname "$hit")")")
  fi
  if [ -n "$hit" ]; then cuda_found+=("$so -> $(readlink -f "$hit")"); else cuda_missing+=("$so"); fi
done
ddp_ld=$bundle/libs:$bundle/lib
for d in "${cuda_dirs[@]}"; do
  case ":$ddp_ld:" in *":$d:"*) ;; *) ddp_ld=$ddp_ld:$d ;; esac
done
# NCCL is loaded at run time (docs/comm.md, "The NCCL backend"): the
# machine's own libnccl.so.2, named to ddp by DDP_NCCL_LIBRARY.
nccl_lib=$(ldconfig -p 2>/dev/null | awk '$1 == "libnccl.so.2" {print $NF; exit}')
if [ -z "$nccl_lib" ]; then
  for d in $py_nvidia /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $py_torch_lib; do
    [ -d "$d" ] || continue
    nccl_lib=$(find "$d/" -maxdepth 4 -name libnccl.so.2 2>/dev/null | head -n 1)
    [ -n "$nccl_lib" ] && break
  done
fi
ddp_ld=$ddp_ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Our binaries get the carried libraries; python3 (PyTorch) keeps its own.
ddp_env=(env LD_LIBRARY_PATH="$ddp_ld" DDP_SOURCE_DIR="$repo" DDP_BIN_DIR="$bin")
[ -n "$nccl_lib" ] && ddp_env+=(DDP_NCCL_LIBRARY="$(readlink -f "$nccl_lib")" DDP_TEST_NCCL="$(readlink -f "$nccl_lib")")
ddp() { "${ddp_env[@]}" "$@"; }

# Tests read Fashion-MNIST where Debian puts it; as root, point that path at
# the carried copy when the machine has none.
fm=/usr/share/datasets/fashion-mnist
data_note="$fm exists here"
if [ ! -e "$fm" ]; then
  if mkdir -p "$(dirname "$fm")" 2>/dev/null && ln -s "$data" "$fm" 2>/dev/null; then
    data_link=$fm
    data_note="$fm linked to the carried copy for this run"
  else
    data_note="$fm absent and not writable: tests that read it skip"
  fi
fi

# ---- The environment.
{
  echo "## Environment"
  echo '```text'
  echo "system: $(uname -srm); $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"); $(ldd --version 2>/dev/null | head -n 1)"
  echo "cpus: $(nproc); glibc the binaries need: $(sed -n 's/^glibc_needed //p' "$carry/manifest.txt")"
  if command -v nvidia-smi >/dev/null; then
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -n 4)"
  else
    echo "gpu: none (no nvidia-smi)"
  fi
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
  echo "nvcc: $([ -n "$nvcc" ] && "$nvcc" --version | tail -n 2 | tr '\n' ' ' || echo 'not found')"
  echo "python: $(command -v "$py" || echo "$py: not found") $(sed -n 's/^python //p' <<<"$py_facts")"
  echo "torch: $(sed -n 's/^torch //p' <<<"$py_facts")"
  echo "carry: $(sed -n 's/^made /made /p; s/^git /git /p; s/^build /build /p' "$carry/manifest.txt" | paste -sd ';' | sed 's/;/; /g')"
  echo "CUDA libraries found: ${cuda_found[*]:-(none needed)}"
  [ ${#cuda_missing[@]} -gt 0 ] && echo "CUDA libraries NOT found: ${cuda_missing[*]}"
  echo "LD_LIBRARY_PATH for ddp: $ddp_ld"
  if [ -n "$nccl_lib" ]; then echo "NCCL for ddp: $(readlink -f "$nccl_lib")"
  else echo "NCCL for ddp: none found (the nccl steps fail saying so)"; fi
  echo "data: $data_note"
  probe=$(ls "$bundle"/tests/test_cuda_* 2>/dev/null | head -n 1)
  [ -n "$probe" ] || probe=$bin/ddp-train
  if [ -e "$probe" ]; then
    echo "ldd $(basename "$probe"):"
    ddp ldd "$probe" 2>&1 | sed 's/ (0x[0-9a-f]*)$//'
  fi
  echo '```'
} | tee -a "$report"
{
  echo "===== environment"
  nvidia-smi 2>&1
  cat "$carry/manifest.txt"
} >>"$log"

# ---- (amp) Issue 42: mixed precision (scripts/gpu-amp-steps.sh), defined
# here, run after (d) (or alone with GPU_CHECK_ONLY=amp). Output under
# $out/amp/ (the fixtures, each step's JSON lines).
amp_section() {
  say "" "## (amp) Mixed precision on the GPU (issue 42)"
  phase 100
  # NAME:WANT:NEED: a step runs with up to WANT seconds, and only when NEED
  # are left (less could not finish it: SKIP, saying so, not a timeout).
  local amp_step name want need
  for amp_step in amp_parity:90:40 amp_scaler:60:20 amp_speed:150:60 amp_mlp:90:30 amp_acc:300:150; do
    IFS=: read -r name want need <<<"$amp_step"
    if [ $(($(left) - 5)) -lt "$need" ]; then
      record "$name" SKIP 0 "not run: $(($(left) - 5)) s left of the ${budget} s budget, it needs ${need} s (GPU_CHECK_ONLY=amp runs this section alone)"
      continue
    fi
    step "$name" "$want" "${ddp_env[@]}" DDP_TEST_DIR="$bundle/tests" \
      GPU_CHECK_PYTHON="$py" bash scripts/gpu-amp-steps.sh "$name" "$data" "$out/amp"
  done
}
if [ "${GPU_CHECK_ONLY:-}" = amp ]; then
  amp_section
  summary " (GPU_CHECK_ONLY=amp)"
  [ "$failed" -eq 0 ]
  exit
fi

# ---- (n) Issue 39: NCCL, in its priority order, until 85% of the budget
# (the steps' timeouts add up to more: the later ones get what is left).
say "" "## (n) NCCL (issue 39)"
phase 85
nccl_tests=()
for exe in "$bundle"/tests/test_nccl_*; do [ -x "$exe" ] && nccl_tests+=("$exe"); done
for exe in "${nccl_tests[@]}"; do
  step "$(basename "$exe")" 120 "${ddp_env[@]}" "$exe"
  ver=$(grep -m1 '^NCCL ' "$work/step.out" 2>/dev/null)
  [ -n "$ver" ] && say "  - $ver"
done
[ ${#nccl_tests[@]} -gt 0 ] || record "nccl tests" SKIP 0 "no test_nccl_* carried (the build has no NCCL backend)"
# Data parallelism on the GPU (two ranks sharing it), in the issue's order.
if [ -x "$bin/ddp-train" ]; then
  for dp_step in n2:70 n2acc:100 n3kill:45 n3stop:60 n4:70; do
    step "${dp_step%%:*}" "${dp_step#*:}" "${ddp_env[@]}" bash scripts/gpu-dp-steps.sh "${dp_step%%:*}" "$data"
  done
else
  record "n2..n4" SKIP 0 "no ddp-train carried"
fi
# n5: ddp's allreduce against PyTorch's, both over NCCL, alternating rounds.
if [ -x "$bin/ddp-bench" ]; then
  step n5 120 "${ddp_env[@]}" bash scripts/gpu-dp-steps.sh n5 "$data" # the table in its tail
else
  record n5 SKIP 0 "no ddp-bench carried"
fi
# The rest of issue 39's build, after its measurements: the CPUs near the
# GPU, the seeds' tools on the GPU, then the pipeline on GPUs (n9).
if [ -x "$bin/ddp-train" ]; then
  for tool_step in n6numa:30 n7mnist:90 n8hpo:90; do
    step "${tool_step%%:*}" "${tool_step#*:}" "${ddp_env[@]}" bash scripts/gpu-dp-steps.sh "${tool_step%%:*}" "$data"
  done
else
  record "n6..n8" SKIP 0 "no ddp-train carried"
fi
# (n9) The pipeline with its stages on the GPU (scripts/gpu-pp-steps.sh):
# n9pp1 NCCL's send/recv between two ranks sharing the GPU == the CPU
# pipeline (docs/parallel.md's bound); n9pp2 the same staged through pinned
# host memory (ddp's own backend); n9pp3 resume bit for bit, the checkpoint
# loaded in a CPU run; n9pp4 model_parallel_hpc --device cuda (seed 000).
# Each under its own timeout; skipped ("no time left") once the budget is spent.
if [ -x "$bin/ddp-train" ]; then
  for pp_step in pp1:90 pp2:60 pp3:120 pp4:90; do
    step "n9${pp_step%%:*}" "${pp_step#*:}" "${ddp_env[@]}" bash scripts/gpu-pp-steps.sh "${pp_step%%:*}" "$data"
  done
else
  record "n9pp1..n9pp4" SKIP 0 "no ddp-train carried"
fi

# ---- (a) The CUDA tests, until 45% of the budget.
say "" "## (a) CUDA tests"
# Each test may take up to 60 s, less what keeps 10 s for each one after it
# (but never under 20 s): a hung test leaves the others their turn.
phase 45
tests=()
for exe in "$bundle"/tests/test_cuda_*; do [ -x "$exe" ] && tests+=("$exe"); done
ntests=${#tests[@]}
for i in "${!tests[@]}"; do
  want=$((phase_end - $(elapsed) - 10 * (ntests - i - 1)))
  [ "$want" -gt 60 ] && want=60
  [ "$want" -lt 20 ] && want=20
  step "$(basename "${tests[$i]}")" "$want" "${ddp_env[@]}" "${tests[$i]}"
done
[ "$ntests" -gt 0 ] || record "cuda tests" SKIP 0 "no test_cuda_* carried (the build has none)"

# ---- (b) PyTorch's step.
say "" "## (b) PyTorch eager reference (TF32 off, synthetic data on the device)"
phase 55
if command -v "$py" >/dev/null; then
  run_step torch_convnet_step 90 env PYTHONUNBUFFERED=1 "$py" scripts/torch/gpu_convnet_step.py \
    --batch 100 1024 --deterministic --cuda-graph
  grep '^{"impl": "torch"' "$work/step.out" >>"$results"
  record torch_convnet_step "$step_status" "$step_secs" "$step_detail"
  if grep -q '"samples_per_s_median"' "$work/step.out"; then
    {
      echo ""
      echo "| variant | batch | samples/s (median) | step µs | rounds |"
      echo "| --- | --- | --- | --- | --- |"
      grep '"samples_per_s_median"' "$work/step.out" | sed -n \
        's/.*"variant": "\([a-z]*\)", "batch": \([0-9]*\), "samples_per_s_rounds": \[\([^]]*\)\], "samples_per_s_median": \([0-9.]*\), "step_us_median": \([0-9.]*\).*/| \1 | \2 | \4 | \5 | \3 |/p'
    } | tee -a "$report"
    grep '"error"' "$work/step.out" | sed -n \
      's/.*"variant": "\([a-z]*\)", "batch": \([0-9]*\), "error": "\(.*\)"}$/- torch \1 at batch \2 failed: \3/p' |
      cut -c1-300 | tee -a "$report"
  elif [ -s "$work/step.out" ]; then
    { echo '  ```text'; tail -n 12 "$work/step.out" | sed 's/^/  /'; echo '  ```'; } >>"$report"
  fi
else
  record torch_convnet_step SKIP 0 "no $py here"
fi
torch_sps() { # BATCH: PyTorch's eager median at BATCH, if measured
  grep '"variant": "eager", "batch": '"$1"',' "$results" | sed -n 's/.*"samples_per_s_median": \([0-9.]*\).*/\1/p' | tail -n 1
}

# ---- (c) ddp's step, and the speed bars.
say "" "## (c) ddp's GPU step (bench_convnet --device cuda)"
phase 72
if [ ! -x "$bin/bench_convnet" ]; then
  record bench_convnet SKIP 0 "no bench_convnet carried"
elif ! grep -q -- '--device' <<<"$(ddp "$bin/bench_convnet" --help 2>&1)"; then
  record bench_convnet SKIP 0 "skipped: bench_convnet has no --device yet"
else
  graph=""
  grep -q -- '--cuda-graph' <<<"$(ddp "$bin/bench_convnet" --help 2>&1)" && graph=1
  # Each batch: eager and CUDA graph, each with both convolutions (the
  # backend's switch, DDP_CUDA_CONV); batch 1024 with fewer steps (a step
  # is ten times longer) to keep the eight runs within about 30 s.
  for batch in 100 1024; do
    steps=200 repeats=5
    [ "$batch" = 1024 ] && steps=100 repeats=3
    for conv in im2col cudnn auto; do
      for variant in plain ${graph:+graph}; do
        extra=()
        [ "$variant" = graph ] && extra=(--cuda-graph)
        name=bench_convnet_b${batch}_${conv}${graph:+_$variant}
        run_step "$name" 40 env DDP_CUDA_CONV="$conv" "${ddp_env[@]}" "$bin/bench_convnet" --device cuda \
          --data synthetic --batch "$batch" --steps "$steps" --warmup 20 --repeats "$repeats" --json "${extra[@]}"
        sps=$(jnum samples_per_s "$work/step.out")
        # cuDNN absent from this build or machine: not ddp's step failing.
        if [ "$step_status" = FAIL ] && [ "$conv" = cudnn ] && [ -z "$sps" ] &&
          grep -qi 'cudnn.*\(unavailable\|not built\|not available\|not found\|without\)' "$work/step.out"; then
          step_status=SKIP
          step_detail="no cuDNN: $(grep -m1 -i 'cudnn' "$work/step.out" | cut -c1-200)"
        fi
        if [ "$step_status" = PASS ] && [ -z "$sps" ]; then
          step_status=FAIL step_detail="no samples_per_s in its --json output"
        fi
        # The convolution bench_convnet reports, when it does ("conv"), else the one asked.
        impl=$(grep '"samples_per_s"' "$work/step.out" | tail -n 1 | sed -n 's/.*"conv": *"\([^"]*\)".*/\1/p')
        [ -n "$sps" ] && step_detail="${step_detail:+$step_detail; }$sps samples/s (DDP_CUDA_CONV=$conv${impl:+, ran $impl})"
        [ -n "$sps" ] && printf '{"impl": "ddp", "variant": "%s", "batch": %s, "conv": "%s", "samples_per_s_median": %s}\n' \
          "$variant" "$batch" "$conv" "$sps" >>"$results"
        record "$name" "$step_status" "$step_secs" "$step_detail" "$work/step.out"
      done
    done
    theirs=$(torch_sps "$batch")
    # ddp's best per mode, then the bar on the better of the two modes.
    best_of() { # VARIANT: ddp's best figure of that mode at this batch
      grep '^{"impl": "ddp", "variant": "'"$1"'", "batch": '"$batch"',' "$results" |
        sed -n 's/.*"samples_per_s_median": \([0-9.]*\).*/\1/p' | sort -g | tail -n 1
    }
    best_plain=$(best_of plain) best_graph=$(best_of graph)
    best=$(printf '%s\n' "$best_plain" "$best_graph" | grep . | sort -g | tail -n 1)
    bar=1.0
    [ "$batch" = 100 ] && bar=2.0
    if [ -z "$best" ] || [ -z "$theirs" ]; then
      record "speed_b$batch" SKIP 0 "needs both ddp's and PyTorch's figure (ddp '${best}', torch '${theirs}')"
    else
      ratio=$(awk -v o="$best" -v t="$theirs" 'BEGIN {printf "%.2f", o / t}')
      st=$(awk -v r="$ratio" -v b="$bar" 'BEGIN {print (r >= b) ? "PASS" : "FAIL"}')
      modes="eager ${best_plain:-none}"
      [ -n "$graph" ] && modes="$modes, CUDA graph ${best_graph:-none}"
      record "speed_b$batch" "$st" 0 "ddp's best $best / torch eager $theirs samples/s = ${ratio}x (bar ${bar}x; $modes)"
      if [ "$batch" = 100 ]; then
        goal=$(awk -v r="$ratio" 'BEGIN {print (r >= 5) ? "met" : "not met"}')
        record goal_b100 NOTE 0 "the issue's goal, 5x PyTorch eager at batch 100: ${ratio}x, $goal"
      fi
    fi
  done
fi

# ---- (e) ToyMpModel across devices.
say "" "## (e) ToyMpModel, net1 on cuda:0 and net2 on cpu (toy_mp_devices)"
phase 78
if [ -x "$bin/toy_mp_devices" ]; then
  step toy_mp_devices 30 "${ddp_env[@]}" "$bin/toy_mp_devices"
else
  record toy_mp_devices SKIP 0 "no toy_mp_devices carried (not built yet)"
fi

# ---- (d) Training accuracy, GPU against the CPU runs carried.
say "" "## (d) ConvNet, 3 epochs on Fashion-MNIST: GPU against CPU"
phase 100
settings="--model convnet --epochs 3 --batch-size 100 --lr 0.01 --momentum 0.9"
seeds="1 2 3"
cpu_dir=$carry/cpu-runs
if [ -f "$cpu_dir/settings" ]; then
  settings=$(sed -n 's/^settings //p' "$cpu_dir/settings")
  seeds=$(sed -n 's/^seeds //p' "$cpu_dir/settings")
  made_with=$(sed -n 's/^ddp_train_sha256 //p' "$cpu_dir/settings")
  carried=$(sha256sum "$bin/ddp-train" 2>/dev/null | cut -d' ' -f1)
  [ "$made_with" = "$carried" ] ||
    say "Note: the CPU runs were made by another ddp-train than the one carried (rerun gpu-prepare.sh --cpu-runs)."
fi
if [ ! -x "$bin/ddp-train" ]; then
  record accuracy SKIP 0 "no ddp-train carried"
elif ! grep -q -- '--device' <<<"$(ddp "$bin/ddp-train" --help 2>&1)"; then
  record accuracy SKIP 0 "skipped: ddp-train has no --device yet"
else
  gpu_acc=() cpu_acc=()
  read -r -a seed_list <<<"$seeds"
  nseeds=${#seed_list[@]}
  graph_seed=${seed_list[0]}
  graph_train=""
  grep -q -- '--cuda-graph' <<<"$(ddp "$bin/ddp-train" --help 2>&1)" && graph_train=1
  nleft=$((nseeds + ${graph_train:-0}))
  eager_graph_seed=""
  for s in "${seed_list[@]}"; do
    want=$(( ($(left) - 5) / nleft ))
    nleft=$((nleft - 1))
    # shellcheck disable=SC2086 # the settings are words
    run_step "train_seed$s" "$want" "${ddp_env[@]}" "$bin/ddp-train" $settings --seed "$s" --device cuda \
      --data "$data" --json
    acc=$(jnum test_accuracy "$work/step.out")
    sps=$(jnum samples_per_s "$work/step.out")
    if [ "$step_status" = PASS ] && [ -z "$acc" ]; then
      step_status=FAIL step_detail="no test_accuracy in its --json output"
    fi
    cpu=$(jnum test_accuracy "$cpu_dir/seed-$s.json")
    [ -n "$acc" ] && step_detail="${step_detail:+$step_detail; }GPU accuracy $acc, ${sps} samples/s${cpu:+, CPU $cpu}"
    [ -n "$acc" ] && gpu_acc+=("$acc")
    [ -n "$acc" ] && [ -n "$cpu" ] && cpu_acc+=("$cpu")
    [ "$s" = "$graph_seed" ] && eager_graph_seed=$acc
    grep '"test_accuracy"' "$work/step.out" | tail -n 1 | sed "s/^{/{\"impl\": \"ddp-train\", \"device\": \"cuda\", \"seed\": $s, /" >>"$results"
    record "train_seed$s" "$step_status" "$step_secs" "$step_detail" "$work/step.out"
  done
  if [ ${#gpu_acc[@]} -lt "$nseeds" ]; then
    record accuracy SKIP 0 "only ${#gpu_acc[@]} of $nseeds GPU runs finished"
  elif [ ${#cpu_acc[@]} -lt "$nseeds" ]; then
    record accuracy SKIP 0 "no CPU runs carried (gpu-prepare.sh --cpu-runs); GPU accuracies: ${gpu_acc[*]}"
  else
    verdict=$(printf '%s\n' "${gpu_acc[@]}" "--" "${cpu_acc[@]}" | awk '
      $1 == "--" {cpu = 1; next}
      {if (cpu) {c += $1; nc++} else {g += $1; ng++}}
      END {d = 100 * (g / ng - c / nc); printf "%s GPU mean %.2f%%, CPU mean %.2f%%, difference %+.2f points (bar 0.5)\n",
        (d <= 0.5 && d >= -0.5) ? "PASS" : "FAIL", 100 * g / ng, 100 * c / nc, d}')
    record accuracy "${verdict%% *}" 0 "${verdict#* }"
  fi
  # The same training with the step replayed as a CUDA graph (its full
  # batches; the last of each epoch and evaluation eager): the same
  # kernels, so the eager GPU run's accuracy, ideally to the last digit.
  if [ -z "$graph_train" ]; then
    record "train_seed${graph_seed}_graph" SKIP 0 "skipped: ddp-train has no --cuda-graph yet"
  else
    s=$graph_seed
    # shellcheck disable=SC2086 # the settings are words
    run_step "train_seed${s}_graph" $(($(left) - 5)) "${ddp_env[@]}" "$bin/ddp-train" $settings --seed "$s" \
      --device cuda --cuda-graph --data "$data" --json
    acc=$(jnum test_accuracy "$work/step.out")
    sps=$(jnum samples_per_s "$work/step.out")
    cpu=$(jnum test_accuracy "$cpu_dir/seed-$s.json")
    if [ "$step_status" = PASS ] && [ -z "$acc" ]; then
      step_status=FAIL step_detail="no test_accuracy in its --json output"
    fi
    if [ "$step_status" = PASS ] && [ -n "$eager_graph_seed" ]; then
      d=$(awk -v a="$acc" -v b="$eager_graph_seed" 'BEGIN {printf "%+.2f", 100 * (a - b)}')
      step_status=$(awk -v d="$d" 'BEGIN {print (d <= 0.5 && d >= -0.5) ? "PASS" : "FAIL"}')
      same=""
      [ "$acc" = "$eager_graph_seed" ] && same=", identical"
      step_detail="CUDA graph accuracy $acc, ${sps} samples/s; eager GPU $eager_graph_seed ($d points$same, bar 0.5)${cpu:+; CPU $cpu}"
    elif [ -n "$acc" ]; then
      step_detail="${step_detail:+$step_detail; }CUDA graph accuracy $acc, ${sps} samples/s (no eager GPU run to compare)${cpu:+; CPU $cpu}"
    fi
    grep '"test_accuracy"' "$work/step.out" | tail -n 1 | sed "s/^{/{\"impl\": \"ddp-train\", \"device\": \"cuda\", \"seed\": $s, /" >>"$results"
    record "train_seed${s}_graph" "$step_status" "$step_secs" "$step_detail" "$work/step.out"
  fi
fi

# ---- (amp) Issue 42 (defined above): what time is left.
amp_section

summary ""
[ "$failed" -eq 0 ]
