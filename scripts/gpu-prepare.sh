#!/usr/bin/env bash
# Prepares .gpu-carry/, what scripts/gpu-check.sh needs on the GPU machine
# besides the repository (docs/cuda.md, "Checking on a GPU"). Runs here, on
# the development machine, after a release build with CUDA; copies, never
# builds. The GPU machine has CUDA 13.0, python3 with PyTorch and no network,
# and the working tree travels there with at most 64 MiB in all, so the carry
# holds only:
#   bundle.tar.xz   the CUDA tests (build/tests/test_cuda_*, test_nccl_*), ddp-train,
#                   ddprun, ddp-bench, ddp-hpo, mnist_ddp and model_parallel_hpc
#                   (issue 39's data-parallel and pipeline steps and tools),
#                   bench_convnet and toy_mp_devices when built, libddp.so*,
#                   and the shared libraries they load that are neither the
#                   C runtime nor CUDA's (OpenBLAS, gfortran, cmocka, ...),
#                   compressed (OpenBLAS alone is 35 MiB, 4 compressed);
#   data/fashion-mnist/  the four IDX files, already gzip'd;
#   manifest.txt    what is in it, where it came from, and the CUDA sonames
#                   the binaries need ("cuda_soname libcublas.so.13"), which
#                   gpu-check.sh looks for there (/usr/local/cuda, the pip
#                   nvidia-* packages of its python3);
#   cpu-runs/       with --cpu-runs: ddp-train's --json summaries of the
#                   ConvNet trained 3 epochs on the CPU for seeds 1 2 3 (about
#                   a minute each on a free core), and the settings used, for
#                   gpu-check's accuracy comparison. Kept across later runs
#                   without the flag.
# Fails when the carry exceeds GPU_CARRY_MAX_MIB (default 60) or the carry
# and the rest of the working tree exceed the 64 MiB that travels.
# Usage: scripts/gpu-prepare.sh [--cpu-runs]
#   GPU_BUILD_DIR (default build) is the build copied from; DDP_DATA (default
#   /usr/share/datasets/fashion-mnist) the data.
set -euo pipefail
cd "$(dirname "$0")/.."

build=${GPU_BUILD_DIR:-build}
data_src=${DDP_DATA:-/usr/share/datasets/fashion-mnist}
max_mib=${GPU_CARRY_MAX_MIB:-60}
travel_mib=64
carry=.gpu-carry
cpu_runs=0
seeds=(1 2 3)
# The accuracy check's settings (scripts/check-accuracy.sh's): seed and
# device are added per run.
train_settings="--model convnet --epochs 3 --batch-size 100 --lr 0.01 --momentum 0.9"

for arg in "$@"; do
  case $arg in
    --cpu-runs) cpu_runs=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-prepare: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "gpu-prepare: $*" >&2; exit 1; }
[ -d "$build/bin" ] || die "$build/bin missing: build the release build first (scripts/build.sh)"
[ -d "$data_src" ] || die "$data_src missing (scripts/install-deps.sh data, or set DDP_DATA)"

stage=$(mktemp -d /tmp/gpu-prepare.XXXXXX)
trap 'rm -rf "$stage"' EXIT
b=$stage/bundle
mkdir -p "$b/bin" "$b/tests" "$b/lib" "$b/libs" "$carry/data/fashion-mnist"

# What travels of the build: the CUDA tests and the named tools only.
elves=()
for name in ddp-train ddprun ddp-bench ddp-hpo mnist_ddp model_parallel_hpc bench_convnet toy_mp_devices; do
  if [ -x "$build/bin/$name" ]; then
    cp -p "$build/bin/$name" "$b/bin/"
    elves+=("$b/bin/$name")
  fi
done
for exe in "$build"/tests/test_cuda_* "$build"/tests/test_nccl_*; do
  if [ ! -f "$exe" ] || [ ! -x "$exe" ]; then continue; fi
  cp -p "$exe" "$b/tests/"
  elves+=("$b/tests/$(basename "$exe")")
done
for so in "$build"/lib/libddp.so*; do
  [ -e "$so" ] || continue
  cp -P "$so" "$b/lib/"
  [ -L "$so" ] || elves+=("$b/lib/$(basename "$so")")
done
[ ${#elves[@]} -gt 0 ] || die "nothing to carry in $build (no ddp-train, no test_cuda_*)"
# The copies travel without their debug information (symbols stay, so
# backtraces still name functions): it is most of their size, and the tree
# plus the carry must fit the 64 MiB that travel.
if command -v strip >/dev/null; then
  strip --strip-debug "${elves[@]}"
fi

# The libraries they load. The C runtime and the compiler's are on every
# Linux (the GPU machine's glibc is at least as new: manifest's glibc_needed);
# CUDA's must be the GPU machine's own (its driver's CUDA 13.0): only their
# sonames are recorded. Everything else is copied (ldd lists the transitive
# ones too).
is_system() {
  case $1 in
    linux-vdso.so.* | ld-linux* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libresolv.so.* | libutil.so.* | libgcc_s.so.* | libstdc++.so.*) return 0 ;;
  esac
  return 1
}
is_cuda() {
  case $1 in
    libcuda.so* | libcudart* | libcublas* | libcudnn* | libnvrtc* | libnvJitLink* | libcufft* | \
      libcurand* | libcusparse* | libcusolver* | libnccl* | libnvToolsExt* | libnvidia-*) return 0 ;;
  esac
  case $2 in /usr/local/cuda*) return 0 ;; esac
  return 1
}
declare -A copied=() cuda_sonames=()
for f in "${elves[@]}"; do
  # ldd: "\tlibfoo.so.1 => /path/libfoo.so.1 (0x...)" or "=> not found".
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    case $name in libddp.so*) continue ;; esac
    is_system "$name" && continue
    if is_cuda "$name" "$path"; then
      cuda_sonames[$name]=1
      continue
    fi
    [ "$path" != not ] || die "$(basename "$f") needs $name, which is not found here either"
    if [ -z "${copied[$name]:-}" ]; then
      cp -L "$path" "$b/libs/$name"
      copied[$name]=$path
    fi
  done < <(ldd "$f" 2>/dev/null)
done

glibc_needed=""
if command -v objdump >/dev/null; then
  glibc_needed=$(for f in "${elves[@]}" "$b"/libs/*; do [ -f "$f" ] && objdump -T "$f" 2>/dev/null; done |
    grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1) || true
fi

# The bundle is compressed again only when its contents changed (xz on
# OpenBLAS takes a while on two shared cores).
(cd "$b" && find . -type f -print0 | sort -z | xargs -0 sha256sum) >"$stage/contents"
if [ -f "$carry/bundle.tar.xz" ] && [ -f "$carry/bundle.contents" ] &&
  cmp -s "$stage/contents" "$carry/bundle.contents"; then
  echo "gpu-prepare: bundle unchanged"
else
  echo "gpu-prepare: compressing the bundle ($(du -sh "$b" | cut -f1) of binaries and libraries)"
  tar -C "$b" -cf - . | xz -6 -T2 >"$carry/bundle.tar.xz.tmp"
  mv "$carry/bundle.tar.xz.tmp" "$carry/bundle.tar.xz"
  cp "$stage/contents" "$carry/bundle.contents"
fi

# Fashion-MNIST, as ddp-train and the tests read it (IDX, gzip'd or not).
for stem in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  src=""
  for cand in "$data_src/$stem.gz" "$data_src/$stem"; do [ -f "$cand" ] && src=$cand && break; done
  [ -n "$src" ] || die "$data_src has no ${stem}[.gz]"
  dst=$carry/data/fashion-mnist/$(basename "$src")
  cmp -s "$src" "$dst" || cp "$src" "$dst"
done

# The CPU side of the accuracy comparison, made here where CPUs are free.
ddp_train_sha=$( [ -x "$build/bin/ddp-train" ] && sha256sum "$build/bin/ddp-train" | cut -d' ' -f1 || echo none)
if [ "$cpu_runs" = 1 ]; then
  [ -x "$build/bin/ddp-train" ] || die "--cpu-runs needs $build/bin/ddp-train"
  device_arg=""
  grep -q -- '--device' <<<"$("$build/bin/ddp-train" --help 2>&1)" && device_arg="--device cpu"
  rm -rf "$carry/cpu-runs"
  mkdir -p "$carry/cpu-runs"
  for s in "${seeds[@]}"; do
    echo "gpu-prepare: CPU run, seed $s: ddp-train $train_settings --seed $s $device_arg"
    t0=$SECONDS
    # shellcheck disable=SC2086 # the settings are words
    "$build/bin/ddp-train" $train_settings --seed "$s" $device_arg --data "$data_src" --json \
      >"$stage/cpu$s.out" 2>"$stage/cpu$s.err" ||
      { tail -n 20 "$stage/cpu$s.err" >&2; die "the CPU run of seed $s failed"; }
    tail -n 1 "$stage/cpu$s.out" >"$carry/cpu-runs/seed-$s.json"
    echo "gpu-prepare:   $(sed -n 's/.*"test_accuracy": *\([0-9.]*\).*/test accuracy \1/p' \
      "$carry/cpu-runs/seed-$s.json") in $((SECONDS - t0)) s"
  done
  {
    echo "settings $train_settings"
    echo "seeds ${seeds[*]}"
    echo "ddp_train_sha256 $ddp_train_sha"
    echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ($(nproc) cores)"
  } >"$carry/cpu-runs/settings"
fi

{
  echo "# .gpu-carry, made by scripts/gpu-prepare.sh; read by scripts/gpu-check.sh"
  echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (working tree modified)')"
  echo "build $build ($(sed -n 's/^CMAKE_BUILD_TYPE:STRING=//p' "$build/CMakeCache.txt" 2>/dev/null)," \
    "CUDA $(compgen -G "$build/CMakeFiles/*/CMakeCUDACompiler.cmake" >/dev/null && echo yes || echo no))"
  echo "glibc_needed ${glibc_needed:-unknown}"
  (cd "$b" && find bin tests lib -mindepth 1 | sort | sed 's/^/file /')
  for name in $(printf '%s\n' "${!copied[@]}" | sort); do echo "lib $name ${copied[$name]}"; done
  for name in $(printf '%s\n' "${!cuda_sonames[@]}" | sort); do echo "cuda_soname $name"; done
  (cd "$carry/data" && find . -type f | sort | sed 's|^\./|data |')
  echo "ddp_train_sha256 $ddp_train_sha"
  if [ -f "$carry/cpu-runs/settings" ]; then
    runs=("$carry"/cpu-runs/seed-*.json)
    echo "cpu_runs ${#runs[@]} ($(sed -n 's/^made //p' "$carry/cpu-runs/settings"))"
  else
    echo "cpu_runs none (scripts/gpu-prepare.sh --cpu-runs makes them)"
  fi
} >"$carry/manifest.txt"

# Sizes: the carry, and the carry with what else travels (tracked files and
# untracked ones git does not ignore).
carry_bytes=$(du -sb "$carry" | cut -f1)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard |
  xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "gpu-prepare: $carry: $(mib "$carry_bytes") MiB (bundle $(mib "$(stat -c %s "$carry/bundle.tar.xz")")," \
  "data $(mib "$(du -sb "$carry/data" | cut -f1)")); with the working tree $(mib $((carry_bytes + tree_bytes))) MiB" \
  "of the $travel_mib that travel"
echo "gpu-prepare: carried: $(ls "$b/tests" | wc -l) CUDA tests, bin: $(ls "$b/bin" | tr '\n' ' ')libs: $(ls "$b/libs" | tr '\n' ' ')"
need_cuda="${!cuda_sonames[*]}"
echo "gpu-prepare: CUDA libraries to find there: ${need_cuda:-none (the build has no CUDA)}"
[ "$carry_bytes" -le $((max_mib * 1048576)) ] || die "$carry is over $max_mib MiB"
[ $((carry_bytes + tree_bytes)) -le $((travel_mib * 1048576)) ] ||
  die "$carry and the working tree are over the $travel_mib MiB that travel"
