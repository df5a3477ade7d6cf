#!/usr/bin/env bash
# Sharded checkpoints (ddp-train --sharded-checkpoint, ddp-ckpt consolidate),
# real processes with torchrun's variables set by hand:
#  - ZeRO-2 at 4 ranks saved sharded at an epoch's end, resumed at 2 ranks
#    with ZeRO-1 and saved sharded again, resumed at 3 ranks with ZeRO-2:
#    the final checkpoint bit-identical (both files) to a run without ZeRO
#    stopped and resumed the same way with ordinary checkpoints;
#  - plain data parallelism (no ZeRO) resumes from the sharded directory to
#    the same state as from the ordinary checkpoint;
#  - ddp-ckpt consolidate gives the ordinary checkpoint's model tensors, and
#    (with PyTorch 2.x and Fashion-MNIST) the ConvNet's consolidated file
#    loads in PyTorch with strict=True and gives ddp-train's test accuracy
#    within 0.1 point;
#  - a second save into the directory leaves only its own shards; a
#    truncated shard or a shard of another save is refused naming the file,
#    and ddp-ckpt's usage errors exit 2.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
ckpt=${DDP_BIN_DIR:?}/ddp-ckpt
here=$(cd "$(dirname "$0")" && pwd)
py=$(command -v python3) || skip "no python3 to compare the files"
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT DDP_STORE_ADDR \
  SLURM_PROCID SLURM_STEP_NUM_TASKS OMPI_COMM_WORLD_SIZE PMI_SIZE
export DDP_TIMEOUT=60
. "$here/../support/train_ranks.sh"
same() { "$py" "$here/st_compare.py" "$1" "$2" || fail "$1 and $2 differ"; }

# --- across world sizes and stages ----------------------------------------------
# 1024 samples, batch 16: an epoch is 16 steps at 4 ranks, 32 at 2, 22 at 3.
# A per-rank batch of 16 at every world (--elastic-batch per-rank): the
# default keeps the global batch, which 3 ranks cannot divide from 4 x 16.
ck=(--model toy --seed 7 --batch-size 16 --elastic-batch per-rank --optimizer adam --lr 0.01 --weight-decay 1e-4)
world 4 s1 "${ck[@]}" --epochs 1 --zero 2 --sharded-checkpoint --save "$tmp/s1"
[ "$(ls "$tmp/s1" | wc -l)" = 5 ] || fail "4 ranks wrote $(ls "$tmp/s1" | wc -l) files, not 4 shards and the metadata"
world 2 s2 "${ck[@]}" --epochs 2 --zero 1 --sharded-checkpoint --resume "$tmp/s1" --save "$tmp/s2"
world 3 s3 "${ck[@]}" --epochs 3 --zero 2 --resume "$tmp/s2" --save "$tmp/s3.safetensors"
world 4 u1 "${ck[@]}" --epochs 1 --save "$tmp/u1.safetensors"
world 2 u2 "${ck[@]}" --epochs 2 --resume "$tmp/u1.safetensors" --save "$tmp/u2.safetensors"
world 3 u3 "${ck[@]}" --epochs 3 --resume "$tmp/u2.safetensors" --save "$tmp/u3.safetensors"
same "$tmp/s3.safetensors" "$tmp/u3.safetensors"
same "$tmp/s3.train.safetensors" "$tmp/u3.train.safetensors"
echo "ok: sharded ZeRO-2 x4 -> ZeRO-1 x2 -> ZeRO-2 x3 == the unsharded chain, bit for bit"

world 2 p2 "${ck[@]}" --epochs 2 --resume "$tmp/s1" --save "$tmp/p2.safetensors"
same "$tmp/p2.safetensors" "$tmp/u2.safetensors"
same "$tmp/p2.train.safetensors" "$tmp/u2.train.safetensors"
echo "ok: plain data parallelism resumes from the shards as from the ordinary checkpoint"

# The default keeps the global batch at a new world (elastic rounds): from
# shards as from the ordinary checkpoint, 4 x 16 become 2 x 32.
g=(--model toy --seed 7 --batch-size 16 --optimizer adam --lr 0.01)
world 4 g1 "${g[@]}" --epochs 1 --sharded-checkpoint --save "$tmp/g1"
world 4 h1 "${g[@]}" --epochs 1 --save "$tmp/h1.safetensors"
world 2 g2 "${g[@]}" --epochs 2 --resume "$tmp/g1" --save "$tmp/g2.safetensors"
world 2 h2 "${g[@]}" --epochs 2 --resume "$tmp/h1.safetensors" --save "$tmp/h2.safetensors"
same "$tmp/g2.safetensors" "$tmp/h2.safetensors"
same "$tmp/g2.train.safetensors" "$tmp/h2.train.safetensors"
echo "ok: the global batch kept at a new world, from shards as from the ordinary checkpoint"

"$ckpt" consolidate "$tmp/s1" "$tmp/c1.safetensors" || fail "consolidate"
same "$tmp/c1.safetensors" "$tmp/u1.safetensors"
echo "ok: consolidate == the ordinary checkpoint's model"

# --- a second save replaces the first --------------------------------------------
old=$(ls "$tmp/s2" | grep shard- | head -1)
world 2 s2b "${ck[@]}" --epochs 2 --zero 1 --sharded-checkpoint --resume "$tmp/s1" --save "$tmp/s2"
[ "$(ls "$tmp/s2" | wc -l)" = 3 ] && [ ! -e "$tmp/s2/$old" ] ||
  fail "after a second save: $(ls "$tmp/s2" | tr '\n' ' ')"
echo "ok: a second save leaves only its own shards"

# --- damaged checkpoints are refused, naming the file --------------------------------
cp -r "$tmp/s1" "$tmp/bad"
shard=$(ls "$tmp/bad" | grep shard-00001)
truncate -s 500 "$tmp/bad/$shard"
start 2 t1 "${ck[@]}" --epochs 2 --resume "$tmp/bad"
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; pids=()
[ $rc -ne 0 ] && grep -q "$shard" "$tmp/t1.err.0" || fail "a truncated shard: $(tail -1 "$tmp/t1.err.0")"
cp -r "$tmp/s1" "$tmp/mixed"
other=$(ls "$tmp/s2" | grep shard-00000)
mine=$(ls "$tmp/mixed" | grep shard-00000)
cp "$tmp/s2/$other" "$tmp/mixed/$mine"
"$ckpt" consolidate "$tmp/mixed" "$tmp/x.safetensors" 2>"$tmp/mixed.err" && fail "a shard of another save was taken"
grep -q "different saves" "$tmp/mixed.err" || fail "a shard of another save: $(cat "$tmp/mixed.err")"
[ ! -e "$tmp/x.safetensors" ] || fail "consolidate wrote a file from a broken checkpoint"
"$ckpt" consolidate "$tmp/s1" 2>/dev/null; [ $? = 2 ] || fail "ddp-ckpt consolidate DIR (no OUT) did not exit 2"
"$ckpt" consolidate "$tmp/nowhere" "$tmp/y.safetensors" 2>"$tmp/nw.err" && fail "a missing directory was taken"
grep -q "not a sharded checkpoint" "$tmp/nw.err" || fail "a missing directory: $(cat "$tmp/nw.err")"
echo "ok: damaged checkpoints refused"

# --- PyTorch loads the consolidated ConvNet with strict=True ----------------------------
tpy=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
version=$("$tpy" -c "import numpy, safetensors, torch; print(torch.__version__)" 2>/dev/null) || version=
case "$version" in
[2-9].*) ;;
*) echo "SKIP (PyTorch part): no PyTorch 2.x with numpy and safetensors at $tpy (scripts/install-deps.sh refs)"; exit 0 ;;
esac
# Fashion-MNIST with a test set of its first 1000 images, so that the
# evaluations stay short under ASan; PyTorch's accuracy on the same 1000.
fashion=/usr/share/datasets/fashion-mnist
data=$tmp/fashion-small
[ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] && "$py" "$here/../support/fashion_small.py" "$fashion" "$data" 1000 ||
  { echo "SKIP (PyTorch part): no Fashion-MNIST"; exit 0; }
world 2 conv --model convnet --data "$data" --max-steps 30 --momentum 0.9 --seed 5 --zero 2 \
  --sharded-checkpoint --save "$tmp/conv" --json
"$ckpt" consolidate "$tmp/conv" "$tmp/conv.safetensors" || fail "consolidate the ConvNet"
ddp_acc=$("$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["test_accuracy"])' "$tmp/conv.out.0")
torch_acc=$("$tpy" - "$here/../io" "$tmp/conv.safetensors" "$data" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from safetensors.torch import load_file
from torch_interop import ConvNet
model = ConvNet()
model.load_state_dict(load_file(sys.argv[2]), strict=True)  # names, shapes, nothing missing or extra
raw = lambda name, off: np.fromfile("%s/%s" % (sys.argv[3], name), np.uint8)[off:]
x = torch.from_numpy(raw("t10k-images-idx3-ubyte", 16).reshape(-1, 1, 28, 28).astype(np.float32) / 255.0)
y = torch.from_numpy(raw("t10k-labels-idx1-ubyte", 8).astype(np.int64))
model.eval()
with torch.no_grad():
    print("%.4f" % (model(x).argmax(1) == y).float().mean().item())
PY
) || fail "PyTorch refused the consolidated file"
"$py" -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); print("ok: consolidated ConvNet in PyTorch (strict=True): ddp %.4f torch %.4f" % (a, b)); sys.exit(abs(a - b) > 0.001)' "$ddp_acc" "$torch_acc" ||
  fail "the consolidated ConvNet's accuracy in PyTorch differs"
