#!/usr/bin/env bash
# Checkpoints between ddp and PyTorch 2.x with the safetensors package, both
# from the reference environment: $DDP_TORCH_PY (default
# /opt/torch-venv/bin/python; scripts/install-deps.sh refs builds it):
#  - ddp-train --save's state dict has exactly ConvNet().state_dict()'s names,
#    dtypes and shapes, loads with load_state_dict(strict=True), and PyTorch's
#    test accuracy with it equals ddp-train's within 0.1 percentage point;
#  - a state dict PyTorch saved with DDP's "module." prefix loads into ddp
#    (ddp-train --init ... --epochs 0) with the same accuracy within 0.1 point.
# Skips (77) without that Python (PyTorch 2.x, numpy, safetensors) or
# Fashion-MNIST.
set -euo pipefail
bin=${DDP_BIN_DIR:?}/ddp-train
here=$(cd "$(dirname "$0")" && pwd)
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
version=$("$py" -c "import numpy, safetensors, torch; print(torch.__version__)" 2>/dev/null) || version=
case "$version" in
[2-9].*) echo "torch $version at $py" ;;
*) echo "SKIP: no PyTorch 2.x with numpy and safetensors at $py (scripts/install-deps.sh refs builds it; DDP_TORCH_PY to use another)"; exit 77 ;;
esac
[ -e /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ] || { echo "SKIP: no Fashion-MNIST"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { "$py" -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])[sys.argv[1]])' "$1"; }
close() { "$py" -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print("ddp %.4f torch %.4f" % (a, b)); sys.exit(abs(a - b) > 0.001)' "$1" "$2"; }

out=$("$bin" --model convnet --max-steps 30 --momentum 0.9 --seed 5 --save "$tmp/ddp.safetensors" --json 2>/dev/null)
ddp_acc=$(field test_accuracy <<<"$out")
torch_acc=$("$py" "$here/torch_interop.py" check "$tmp/ddp.safetensors")
close "$ddp_acc" "$torch_acc" || { echo "FAIL: ddp's checkpoint in PyTorch: accuracy differs"; exit 1; }

torch_acc=$("$py" "$here/torch_interop.py" write "$tmp/torch.safetensors")
out=$("$bin" --model convnet --epochs 0 --init "$tmp/torch.safetensors" --json 2>/dev/null)
ddp_acc=$(field test_accuracy <<<"$out")
close "$ddp_acc" "$torch_acc" || { echo "FAIL: PyTorch's state dict in ddp: accuracy differs"; exit 1; }
echo "ok"
