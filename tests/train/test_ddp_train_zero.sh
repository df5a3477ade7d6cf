#!/usr/bin/env bash
# ddp-train --zero 1|2 as real processes (torchrun's variables by hand, the
# shared-memory backend, whose reductions add ranks in rank order):
#  - the ConvNet (Fashion-MNIST, when present; else the toy model), 20
#    steps of SGD with momentum and of Adam, at 2 and 3 ranks: the state
#    after training bit-identical to plain data parallelism's (--dump-state),
#    and the checkpoints' optimizer state too;
#  - the toy model at 4 ranks, --zero 2 --microbatches 2: within 1e-3 of
#    what training moved plain data parallelism's parameters with the same
#    micro-batches (stage 2's gradient ring reduces every micro-batch and
#    adds the averages: the same sums in another order, docs/sharding.md),
#    and --zero 1 --microbatches 2 bit-identical;
#  - checkpoints across world sizes and stages: --zero 2 at 4 ranks saved at
#    an epoch's end, resumed at 2 ranks with --zero 1, saved, resumed at 3
#    ranks with --zero 2: both checkpoint files bit-identical to a run without
#    ZeRO stopped and resumed the same way;
#  - --clip-grad-norm under --zero 1 and 2 at 2 ranks bit-identical to data
#    parallelism with the same clip (and the clip acting); --pp with it and a
#    negative max_norm refused;
#  - --zero 3 (parameters sharded, gathered per module) bit-identical to
#    plain data parallelism for the ConvNet at 2 and 4 processes, and its
#    memory figures (the range plus the two largest modules, the one running
#    and the one prefetched; one with --zero-prefetch off);
#  - --zero without a group is refused, saying why.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-train
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

fashion=/usr/share/datasets/fashion-mnist
data=$tmp/fashion-small
if [ -e "$fashion/t10k-labels-idx1-ubyte.gz" ] &&
  "$py" "$here/../support/fashion_small.py" "$fashion" "$data" 1000; then
  base=(--model convnet --data "$data" --seed 2 --max-steps 20 --batch-size 16)
else
  echo "(no Fashion-MNIST at $fashion: the toy model instead of the ConvNet)"
  base=(--model toy --seed 2 --max-steps 20 --batch-size 16)
fi
# Small buckets (0.01 MiB: the ConvNet in 9) and stage 2's gradient ring
# wherever the graph fits it (docs/sharding.md): the equalities below are
# the ring's, its slots reused. The memory section runs the default rule.
base+=(--bucket-cap-mb 0.01)
export DDP_ZERO_GRAD_RING=always

# --- ZeRO-1, 2 and 3 == plain data parallelism, bit for bit -------------------
for n in 2 3; do
  for opt in "--optimizer sgd --lr 0.01 --momentum 0.9 --weight-decay 1e-4" \
             "--optimizer adam --lr 0.001"; do
    tag=$(echo "$opt" | cut -d' ' -f2)
    # shellcheck disable=SC2086
    world $n ref.$tag.$n "${base[@]}" $opt --dump-state "$tmp/ref.$tag.$n.{rank}" \
      --save "$tmp/ref.$tag.$n.safetensors"
    # Stage 3 at 2 ranks here and at 4 below (3 and 4 ranks as threads in
    # tests/parallel/test_zero.c): the test stays inside its time under ASan.
    stages="1 2"
    [ "$n" = 2 ] && stages="1 2 3"
    for stage in $stages; do
      # shellcheck disable=SC2086
      world $n z$stage.$tag.$n "${base[@]}" $opt --zero $stage \
        --dump-state "$tmp/z$stage.$tag.$n.{rank}" --save "$tmp/z$stage.$tag.$n.safetensors"
      for ((r = 0; r < n; r++)); do
        # Each rank against the same rank (BatchNorm's running statistics
        # are a rank's own since the last forward's broadcast).
        cmp -s "$tmp/z$stage.$tag.$n.$r" "$tmp/ref.$tag.$n.$r" ||
          fail "--zero $stage, $tag, $n ranks: rank $r's state differs from plain data parallelism's"
      done
      same "$tmp/z$stage.$tag.$n.train.safetensors" "$tmp/ref.$tag.$n.train.safetensors"
      echo "ok: --zero $stage $tag at $n ranks: bit-identical to data parallelism (state and checkpoint)"
    done
  done
done

# --- ZeRO-3 at 4 ranks: every reduction of the processes' backend adds the ranks in
# rank order, so stage 3's reduces equal data parallelism's allreduces bit for bit.
world 4 ref.adam.4 "${base[@]}" --optimizer adam --lr 0.001 --dump-state "$tmp/ref.adam.4.{rank}"
world 4 z3.adam.4 "${base[@]}" --optimizer adam --lr 0.001 --zero 3 --dump-state "$tmp/z3.adam.4.{rank}"
for ((r = 0; r < 4; r++)); do
  cmp -s "$tmp/z3.adam.4.$r" "$tmp/ref.adam.4.$r" ||
    fail "--zero 3, adam, 4 ranks: rank $r's state differs from plain data parallelism's"
done
echo "ok: --zero 3 adam at 4 ranks: bit-identical to data parallelism"
world 4 z2.adam.4 "${base[@]}" --optimizer adam --lr 0.001 --zero 2 --dump-state "$tmp/z2.adam.4.{rank}" --json
"$py" -c 'import json, sys
mem = json.loads(open(sys.argv[1]).read().splitlines()[-1])["memory_per_rank"]
assert all(m["grad_ring_bytes"] > 0 for m in mem), mem' "$tmp/z2.adam.4.out.0" ||
  fail "--zero 2 at 4 ranks: the gradient ring was not in use"
for ((r = 0; r < 4; r++)); do
  cmp -s "$tmp/z2.adam.4.$r" "$tmp/ref.adam.4.$r" ||
    fail "--zero 2, adam, 4 ranks: rank $r's state differs from plain data parallelism's"
done
echo "ok: --zero 2 adam at 4 ranks (gradient ring): bit-identical to data parallelism"

# --- micro-batches at 4 ranks ----------------------------------------------------
toy=(--model toy --seed 5 --batch-size 16 --optimizer adam --lr 0.01 --max-steps 20)


world 4 mref "${toy[@]}" --microbatches 2 --dump-state "$tmp/mref"
world 4 mz1 "${toy[@]}" --microbatches 2 --zero 1 --dump-state "$tmp/mz1"
cmp -s "$tmp/mz1" "$tmp/mref" || fail "--zero 1 --microbatches 2 at 4 ranks differs from data parallelism"
echo "ok: --zero 1 --microbatches 2 at 4 ranks: bit-identical"
# Stage 2 reduces each micro-batch (its gradient ring keeps no whole
# buffer to accumulate in): each rank's average is (g1 sum)/W + (g2 sum)/W
# where data parallelism has (g1 + g2 sum)/W. Bound: the distance to data
# parallelism's parameters within 1e-3 of the distance training moved them
# (the initial parameters from one step at learning rate 0: Adam moves
# nothing); a micro-batch lost or counted twice is far above it.
world 4 minit "${toy[@]}" --max-steps 1 --lr 0 --dump-state "$tmp/minit"
world 4 mz "${toy[@]}" --microbatches 2 --zero 2 --dump-state "$tmp/mz"
"$py" - "$tmp/mz" "$tmp/mref" "$tmp/minit" <<'PY' || fail "--zero 2 --microbatches 2 at 4 ranks is not within the bound of data parallelism"
import math, sys
def load(p):
    out = {}
    for line in open(p):
        f = line.split()
        out[f[0]] = [float(v) for v in f[2:]]
    return out
z, ref, init = (load(p) for p in sys.argv[1:])
assert z.keys() == ref.keys() == init.keys()
d = sum((a - b) ** 2 for k in ref for a, b in zip(z[k], ref[k]))
moved = sum((a - b) ** 2 for k in ref for a, b in zip(ref[k], init[k]))
ratio = math.sqrt(d / moved)
print("ok: --zero 2 --microbatches 2 at 4 ranks: ||zero - dp|| / ||dp - initial|| = %.3g (bound 1e-3)" % ratio)
assert moved > 0 and ratio <= 1e-3, ratio
PY

# --- checkpoints across world sizes and stages ----------------------------------
# 1024 samples, batch 16: an epoch is 16 steps at 4 ranks, 32 at 2, 22 at 3.
# A per-rank batch of 16 at every world (--elastic-batch per-rank): the
# default keeps the global batch, which 3 ranks cannot divide from 4 x 16.
ck=(--model toy --seed 7 --batch-size 16 --elastic-batch per-rank --optimizer adam --lr 0.01 --weight-decay 1e-4)
world 4 c1 "${ck[@]}" --epochs 1 --zero 2 --save "$tmp/c1.safetensors"
world 2 c2 "${ck[@]}" --epochs 2 --zero 1 --resume "$tmp/c1.safetensors" --save "$tmp/c2.safetensors"
world 3 c3 "${ck[@]}" --epochs 3 --zero 2 --resume "$tmp/c2.safetensors" --save "$tmp/c3.safetensors"
world 4 u1 "${ck[@]}" --epochs 1 --save "$tmp/u1.safetensors"
world 2 u2 "${ck[@]}" --epochs 2 --resume "$tmp/u1.safetensors" --save "$tmp/u2.safetensors"
world 3 u3 "${ck[@]}" --epochs 3 --resume "$tmp/u2.safetensors" --save "$tmp/u3.safetensors"
for k in 1 2 3; do
  same "$tmp/c$k.safetensors" "$tmp/u$k.safetensors"
  same "$tmp/c$k.train.safetensors" "$tmp/u$k.train.safetensors"
done
echo "ok: ZeRO-2 at 4 ranks -> ZeRO-1 at 2 -> ZeRO-2 at 3, saved and resumed: bit-identical to the unsharded runs"

# --- memory: the optimizer state per rank is 1/W of the unsharded ----------------
unset DDP_ZERO_GRAD_RING
# mlp:256x8 with 0.25 MiB buckets (a hidden layer each): stage 2's ring of
# two buckets is smaller than the buffer it replaces (a model of one or two
# buckets keeps the whole buffer: docs/sharding.md).
mem=(--model mlp:256x8 --bucket-cap-mb 0.25 --optimizer adam --lr 0.001 --max-steps 3 --batch-size 8 --json)
world 4 mdp "${mem[@]}"
world 4 mz1 "${mem[@]}" --zero 1
world 4 mz2 "${mem[@]}" --zero 2
world 4 mz3 "${mem[@]}" --zero 3
world 4 mz3n "${mem[@]}" --zero 3 --zero-prefetch off
"$py" - "$tmp/mdp.out.0" "$tmp/mz1.out.0" "$tmp/mz2.out.0" "$tmp/mz3.out.0" "$tmp/mz3n.out.0" <<'PY' || fail "memory figures"
import json, sys
dp, z1, z2, z3, z3n = (json.loads(open(p).read().splitlines()[-1])["memory_per_rank"] for p in sys.argv[1:])
n = 10 * 256 + 256 + 6 * (256 * 256 + 256) + 256 * 5 + 5      # mlp:256x8's floats
pick = lambda m: {k: m[k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes", "grad_reduced_bytes")}
for r in range(4):
    assert pick(dp[r]) == {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optim_state_bytes": 8 * n,
                           "grad_reduced_bytes": 4 * n}, dp[r]
for z in (z1, z2):
    assert sum(m["optim_state_bytes"] for m in z) == 8 * n, z     # every float's state once
    for m in z:
        assert m["param_bytes"] == 4 * n, m
        assert abs(m["optim_state_bytes"] * 4 / (8 * n) - 1) <= 0.05, m
assert all(m["grad_reduced_bytes"] == 4 * n and m["grad_bytes"] == 4 * n for m in z1), z1
assert all(m["grad_ring_bytes"] == 0 for m in dp + z1 + z3), (dp, z1, z3)
assert sum(m["grad_reduced_bytes"] for m in z2) == 4 * n, z2       # the ranges, each once
# Stage 2's gradient ring: each rank keeps its range, 1/W of the buffer
# (+-5 %), plus the ring of two buckets (0.25 MiB buckets: a hidden layer
# each).
for m in z2:
    assert abs(m["grad_reduced_bytes"] * 4 / (4 * n) - 1) <= 0.05, m
    assert 0 < m["grad_ring_bytes"] <= 2 * 4 * n, m
    assert m["grad_bytes"] == m["grad_reduced_bytes"] + m["grad_ring_bytes"], m
# Stage 3: the range plus the two largest modules (hidden layers: 256 x 256 +
# 256 floats), the one running and the one prefetched, less what of them is
# in the range; one module with --zero-prefetch off. No ring at stage 3.
unit = 256 * 256 + 256
assert sum(m["optim_state_bytes"] for m in z3) == 8 * n, z3
for r, (m, mn) in enumerate(zip(z3, z3n)):
    own = n * (r + 1) // 4 - n * r // 4
    assert 4 * (own + unit) < m["param_bytes"] <= 4 * (own + 2 * unit), m
    assert 4 * own < mn["param_bytes"] <= 4 * (own + unit), mn
    assert m["grad_reduced_bytes"] == 4 * own and m["grad_bytes"] == 4 * n, m
    assert mn["grad_ring_bytes"] == 0, mn
# The peak: the three buffers plus a step's activations (batch 8 x 256
# floats a layer, their gradients, scratch: more than 0, below 16 MiB);
# the process held at least that.
for m in dp + z1 + z2 + z3 + z3n:
    tensors = m["param_bytes"] + m["grad_bytes"] + m["optim_state_bytes"]
    assert tensors < m["peak_tensor_bytes"] < tensors + (16 << 20), m
    assert m["max_rss_bytes"] >= m["peak_tensor_bytes"], m
print("ok: optimizer state per rank under --zero 1 and 2: %s of %d bytes unsharded; "
      "gradients kept under --zero 2: %s of %d, plus a ring of %s; peak tensor bytes %s"
      % ([m["optim_state_bytes"] for m in z2], 8 * n, [m["grad_reduced_bytes"] for m in z2], 4 * n,
         [m["grad_ring_bytes"] for m in z2], [m["peak_tensor_bytes"] for m in z2]))
PY

# --- --clip-grad-norm: --zero 1|2 == data parallelism, both clipping --------------
# (tests/train/test_clip.c checks the clipped norm itself, step by step.)
cl=(--model toy --seed 6 --batch-size 16 --optimizer adam --lr 0.01 --max-steps 10)
world 2 clref "${cl[@]}" --clip-grad-norm 0.05 --dump-state "$tmp/clref"
world 2 clnone "${cl[@]}" --dump-state "$tmp/clnone"
cmp -s "$tmp/clref" "$tmp/clnone" && fail "--clip-grad-norm 0.05 changed nothing: the clip never acted"
for stage in 1 2; do
  world 2 clz$stage "${cl[@]}" --clip-grad-norm 0.05 --zero $stage --dump-state "$tmp/clz$stage"
  cmp -s "$tmp/clz$stage" "$tmp/clref" ||
    fail "--zero $stage --clip-grad-norm at 2 ranks differs from data parallelism with the same clip"
done
echo "ok: --clip-grad-norm under --zero 1 and 2 at 2 ranks: bit-identical to data parallelism's"
start 2 clpp --model toy --max-steps 1 --pp 2 --clip-grad-norm 1
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
pids=()
[ $rc -ne 0 ] && grep -q "under the pipeline strategy" "$tmp/clpp.err.0" ||
  fail "--pp with --clip-grad-norm was not refused with its reason: $(tail -2 "$tmp/clpp.err.0")"
timeout 60 "$bin" --model toy --max-steps 1 --clip-grad-norm -1 >"$tmp/cl.out" 2>"$tmp/cl.err" &&
  fail "--clip-grad-norm -1 was accepted"
grep -q "clip-grad-norm" "$tmp/cl.err" || fail "--clip-grad-norm -1: $(cat "$tmp/cl.err")"

# --- refusals -------------------------------------------------------------------
timeout 60 "$bin" --model toy --max-steps 1 --zero 1 >"$tmp/one.out" 2>"$tmp/one.err" &&
  fail "--zero without a group was accepted"
grep -q "needs a process group" "$tmp/one.err" || fail "--zero without a group: $(cat "$tmp/one.err")"
echo "ok: refusals"
