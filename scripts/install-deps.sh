#!/usr/bin/env bash
# Installs the Debian packages ddp needs, only those missing (apt-get update runs
# only when something must be installed). Groups: build (compiler, CMake,
# OpenBLAS, zlib, cmocka), data (Fashion-MNIST), test (extra tools the test
# suite uses), fuzz (clang with libFuzzer, for scripts/fuzz.sh), mpi (Open MPI:
# mpirun for tests/launch/test_mpirun.sh, the reference in
# scripts/bench-collectives.sh), slurm (Debian's Slurm 22.05 controller, node
# daemon and client commands, for the single-node test cluster of
# scripts/slurm-cluster.sh; the packages' systemd units start only when
# /etc/slurm/slurm.conf exists, which nothing here writes).
# Usage: scripts/install-deps.sh [build] [data] [test] [fuzz] [mpi] [slurm]
set -euo pipefail

declare -A GROUPS_PKGS=(
  [build]="build-essential cmake pkg-config libopenblas-dev zlib1g-dev libcmocka-dev"
  [data]="dataset-fashion-mnist"
  [test]="python3 python3-numpy python3-torch iproute2 procps"
  [fuzz]="clang"
  [mpi]="openmpi-bin libopenmpi-dev"
  [slurm]="slurmctld slurmd slurm-client"
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

[ ${#want[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "install-deps: installing ${want[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${want[@]}" >/dev/null
