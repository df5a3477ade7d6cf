#!/usr/bin/env bash
# The main job, from a fresh Debian machine: installs what is needed, builds,
# and trains seed 001's ConvNet on Fashion-MNIST (SGD lr 0.01, momentum 0.9,
# batch 100, 3 epochs). Extra arguments go to ddp-train (see ddp-train --help),
# e.g. scripts/train.sh --epochs 1 --log train.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh build data
scripts/build.sh release >/dev/null
exec build/bin/ddp-train --model convnet --data /usr/share/datasets/fashion-mnist \
  --epochs 3 --batch-size 100 --optimizer sgd --lr 0.01 --momentum 0.9 --seed 2 "$@"
