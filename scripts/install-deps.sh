#!/usr/bin/env bash
# Installs the Debian packages ddp needs, only those missing (apt-get update runs
# only when something must be installed). Groups: build (compiler, CMake,
# OpenBLAS, zlib, cmocka), data (Fashion-MNIST), test (extra tools the test
# suite uses), fuzz (clang with libFuzzer, for scripts/fuzz.sh), mpi (Open MPI:
# libopenmpi-dev, which the build finds for the MPI backend, src/comm/mpi/;
# mpirun for its tests and tests/launch/test_mpirun.sh, the reference in
# scripts/bench-collectives.sh and scripts/bench-mpi.sh), slurm (Debian's Slurm 22.05 controller, node
# daemon and client commands, for the single-node test cluster of
# scripts/slurm-cluster.sh; the packages' systemd units start only when
# /etc/slurm/slurm.conf exists, which nothing here writes), refs (the
# reference environment: one virtual environment in /opt/torch-venv, made
# with Debian's python3, holding the pins of scripts/requirements-refs.txt
# (PyTorch 2.x, numpy, safetensors, tensorboard, Propulate, mpi4py) from the
# package index; rebuilt only when its stamp differs from those pins, so a
# second run returns at once; fails, saying so, when pip cannot install them).
# Usage: scripts/install-deps.sh [build] [data] [test] [fuzz] [mpi] [slurm] [refs]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

declare -A GROUPS_PKGS=(
  [build]="build-essential cmake pkg-config libopenblas-dev zlib1g-dev libcmocka-dev"
  [data]="dataset-fashion-mnist"
  [test]="python3 python3-numpy python3-torch iproute2 procps"
  [fuzz]="clang"
  [mpi]="openmpi-bin libopenmpi-dev"
  [slurm]="slurmctld slurmd slurm-client"
  [refs]="python3 python3-venv openmpi-bin libopenmpi-dev"
)

want=()
for group in "${@:-build}"; do
  pkgs=${GROUPS_PKGS[$group]:-}
  if [ -z "$pkgs" ]; then
    echo "install-deps: unknown group '$group' (expected: ${!GROUPS_PKGS[*]})" >&2
    exit 2
  fi
  for p in $pkgs; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      want+=("$p")
    fi
  done
done

install_packages() {
  [ ${#want[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "install-deps: installing ${want[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
}

# The reference environment. Its stamp holds the Python it was made with and
# the pins it holds; it is written last, after every package imported, so a
# build that failed halfway is redone. Tests and scripts find the Python
# through DDP_TORCH_PY (default /opt/torch-venv/bin/python).
refs_venv() {
  local venv=/opt/torch-venv python=/usr/bin/python3 req=$here/requirements-refs.txt
  local stamp=$venv/.ddp-refs-stamp sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  local want_stamp
  want_stamp=$("$python" --version 2>&1; grep -v '^#' "$req")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ] && "$venv/bin/python" -c '' 2>/dev/null; then
    return 0
  fi
  if [ -e "$venv" ] && ! [ -f "$venv/pyvenv.cfg" ]; then
    echo "install-deps: $venv exists and is no virtual environment; move it away first" >&2
    return 1
  fi
  echo "install-deps: building the reference environment in $venv (scripts/requirements-refs.txt;" \
    "a few GB from the package index on a fresh machine)" >&2
  $sudo rm -rf "$venv"
  $sudo "$python" -m venv "$venv"
  if ! $sudo "$venv/bin/pip" install -q --progress-bar off -r "$req"; then
    echo "install-deps: pip could not install scripts/requirements-refs.txt into $venv" \
      "(is the package index reachable?); the tests that need it will skip" >&2
    return 1
  fi
  # mpi4py's wheel finds an MPI library at run time: it must be Debian's
  # Open MPI, the one mpirun starts.
  if ! "$venv/bin/python" -c '
import numpy, safetensors, tensorboard, propulate, torch, torch.distributed
from mpi4py import MPI
assert int(torch.__version__.split(".")[0]) >= 2, torch.__version__
assert "Open MPI" in MPI.Get_library_version(), MPI.Get_library_version()
' >/dev/null; then
    echo "install-deps: the reference environment in $venv was installed but does not import" >&2
    return 1
  fi
  printf '%s\n' "$want_stamp" | $sudo tee "$stamp" >/dev/null
  echo "install-deps: reference environment ready: $venv/bin/python" \
    "($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))" >&2
}

install_packages
for group in "${@:-build}"; do
  if [ "$group" = refs ]; then refs_venv; fi
done
