#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs what is needed, builds,
# and trains seed 001's ConvNet on Fashion-MNIST data-parallel over this
# machine's cores: ddprun starts one ddp-train per core (one thread each),
# each trains on its shard of every epoch with batch 100, and the gradients
# are averaged across the ranks (SGD lr 0.01, momentum 0.9, 3 epochs).
# Extra arguments go to ddp-train (see ddp-train --help), e.g.
#   scripts/train.sh --epochs 1 --log train.jsonl
# DDP_NPROC sets the number of processes (default: the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh build data
scripts/build.sh release >/dev/null
nproc=${DDP_NPROC:-$(nproc)}
exec build/bin/ddprun --nproc-per-node "$nproc" build/bin/ddp-train --model convnet \
  --data /usr/share/datasets/fashion-mnist --epochs 3 --batch-size 100 --optimizer sgd \
  --lr 0.01 --momentum 0.9 --seed 2 "$@"
