#!/usr/bin/env bash
# Seed 002's job in the same go (issue 22): the convnet-N search with workers
# of 2 ranks on 2 ranks, a reduced budget, ddp-hpo (the trainer, data-parallel
# on the worker's subgroup) against Propulate 1.2.2 running the tutorial's
# ind_loss with PyTorch DDP over gloo (../shared/refs/propulate_torch_ddp.py).
#
# The same work per evaluation on both sides:
#  - the same space: the reference's (lr uniform in [1e-4, 1e-2], not ddp's
#    default log-uniform), pop_size 2 (the reference's 2 x workers), seed 0
#    (both generators are random.Random(0) on the worker's first rank);
#  - batch 8 per rank, Adadelta + StepLR(1, gamma), NLL, EPOCHS epochs on the
#    first TRAIN training images (a DistributedSampler's half each: TRAIN/16
#    steps per rank and epoch, 125 at 2,000), early stopping that cannot
#    trigger in 2 epochs, and after each epoch a validation on the first VAL
#    test images in batches of 100, half per rank;
#  - the same individuals where the search allows: generations 0 and 1 are
#    random ones drawn alike (same conv_layers and activation), the later
#    ones are bred from the first two and agree when the two frameworks'
#    losses rank them alike (ddp draws what Propulate draws, its emigration
#    draw on one island included). The cost of an evaluation follows
#    conv_layers, so each round prints both sides' (conv_layers, activation)
#    and the ratio is also given over the generations whose individuals
#    agree ("matched": mean evaluation seconds, as each side times its own).
# The headline is wall seconds per evaluation of the search: ddp-hpo's
# search plus its one opening of the data sets (Propulate's tutorial loads
# them inside every evaluation, so ddp's one load counts too); Propulate's
# search as its script times it. Processes' start (Python's imports, ddprun)
# is outside both. Medians over the rounds, alternating which goes first;
# ratios are Propulate's over ddp's.
# With BREAKDOWN=1, one more ddp-hpo run with --trace ends it: where an
# evaluation's time goes, per rank, summed over the evaluations (the
# trainer's timeline: steps' forward, backward's compute, the gradients'
# allreduce (the last bucket's, blocking: mostly the wait for the other
# rank), the loss's allreduce, the optimizer; the validations; and the rest
# of each evaluation: the model, trainer and group set-up and tear-down).
#   scripts/bench-hpo-seed.sh [rounds=3] [generations=4] [epochs=2] [train=2000] [val=1000]
# Needs $DDP_BUILD_DIR/bin/{ddprun,ddp-hpo} (default build/), Fashion-MNIST,
# Open MPI and the reference environment (/opt/torch-venv, or DDP_TORCH_PY).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; gens=${2:-4}; epochs=${3:-2}; train=${4:-2000}; val=${5:-1000}
bin=${DDP_BUILD_DIR:-build}/bin
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
ref=${DDP_SHARED_DIR:-../shared}/refs/propulate_torch_ddp.py
space='conv_layers=int:2:10,activation=cat:relu|sigmoid|tanh,lr=float:0.0001:0.01,gamma=float:0.5:0.999'
die() { echo "bench-hpo-seed: $*" >&2; exit 2; }
[ -x "$bin/ddp-hpo" ] || die "build first (scripts/build.sh, or set DDP_BUILD_DIR)"
[ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR)"
"$py" -c "import propulate, torch" 2>/dev/null || die "no Propulate + PyTorch at $py (scripts/install-deps.sh refs)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Each prints "PER_EVAL SEARCH_S DATA_S" and writes its individuals, one
# "GENERATION CONV_LAYERS ACTIVATION EVAL_SECONDS" line each, to $1.
ours() {
  DDP_TIMEOUT=600 timeout 3000 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-hpo" --objective convnet \
    --space "$space" --ranks-per-worker 2 --pop-size 2 --seed 0 --generations "$gens" \
    --epochs "$epochs" --train-samples "$train" --val-samples "$val" --eval-batch-size 100 \
    --log "$tmp/ours.jsonl" --json 2>"$tmp/ours.err" >"$tmp/ours.out" ||
    { cat "$tmp/ours.err" >&2; die "ddp-hpo failed"; }
  python3 - "$tmp/ours.out" "$tmp/ours.jsonl" "$1" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
with open(sys.argv[3], "w") as f:
    for l in open(sys.argv[2]):
        e = json.loads(l)
        f.write(f"{e['generation']} {e['conv_layers']} {e['activation']} {e['eval_s']:.3f}\n")
print(f"{(d['seconds'] + d['data_seconds']) / d['evaluations']:.4f} {d['seconds']:.3f} {d['data_seconds']:.3f}")
PY
}
theirs() {
  timeout 3000 mpirun --allow-run-as-root --oversubscribe -np 2 "$py" "$ref" --ranks-per-worker 2 \
    --generations "$gens" --epochs "$epochs" --train-samples "$train" --val-samples "$val" \
    >"$tmp/theirs.out" 2>"$tmp/theirs.err" || { tail -20 "$tmp/theirs.err" >&2; die "the reference failed"; }
  python3 - "$tmp/theirs.out" "$1" <<'PY'
import ast, re, sys
out = open(sys.argv[1]).read()
with open(sys.argv[2], "w") as f:
    for g, line in enumerate(l for l in out.splitlines() if l.startswith("eval seconds=")):
        secs = float(re.search(r"seconds=([0-9.]+)", line).group(1))
        p = ast.literal_eval(re.search(r"params=\[(\{.*?\})", line).group(1))
        f.write(f"{g} {p['conv_layers']} {p['activation']} {secs:.3f}\n")
m = re.search(r"seconds=([0-9.]+) seconds_per_eval=([0-9.]+)", out)
print(f"{float(m.group(2)):.4f} {float(m.group(1)):.3f} 0")
PY
}
# The generations whose individuals agree, and each side's mean seconds
# over them: "N OURS THEIRS CONV_LAYERS_OURS CONV_LAYERS_THEIRS".
matched() {
  python3 - "$1" "$2" <<'PY'
import sys
a = [l.split() for l in open(sys.argv[1])]; b = [l.split() for l in open(sys.argv[2])]
m = [(float(x[3]), float(y[3])) for x, y in zip(a, b) if x[1:3] == y[1:3]]
n = len(m)
print(n, sum(x for x, _ in m) / max(n, 1), sum(y for _, y in m) / max(n, 1),
      ",".join(x[1] + x[2][0] for x in a), ",".join(y[1] + y[2][0] for y in b))
PY
}
o=() t=() mo=() mt=()
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then a=$(ours "$tmp/o.txt"); b=$(theirs "$tmp/t.txt")
  else b=$(theirs "$tmp/t.txt"); a=$(ours "$tmp/o.txt"); fi
  read -r ao as ad <<<"$a"; read -r bo bs _ <<<"$b"
  read -r n mao mbo co ct <<<"$(matched "$tmp/o.txt" "$tmp/t.txt")"
  echo "round $r: ddp-hpo $ao s/evaluation (search $as s + data $ad s), Propulate + PyTorch DDP $bo s/evaluation (search $bs s); individuals (conv_layers, activation) ddp $co, Propulate $ct; $n of $gens agree: ${mao} s against ${mbo} s each" >&2
  o+=("$ao"); t+=("$bo")
  if [ "$n" -gt 0 ]; then mo+=("$mao"); mt+=("$mbo"); fi
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m1=$(median "${o[@]}"); m2=$(median "${t[@]}")
m3=$(median "${mo[@]}"); m4=$(median "${mt[@]}")
awk -v o="$m1" -v t="$m2" -v mo="$m3" -v mt="$m4" -v r="$rounds" -v g="$gens" -v e="$epochs" -v n="$train" 'BEGIN {
  printf "seed 002 job, 1 worker of 2 ranks, %d generations, %d epochs on %d images: ddp-hpo %.2f s/evaluation, Propulate + PyTorch DDP %.2f s/evaluation, %.2fx less time; matched individuals %.2f s against %.2f s, %.2fx (medians of %d rounds)\n", g, e, n, o, t, t / o, mo, mt, mt / mo, r }'
[ "${BREAKDOWN:-0}" = 1 ] || exit 0
mkdir "$tmp/trace"
DDP_TIMEOUT=600 timeout 3000 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-hpo" --objective convnet \
  --space "$space" --ranks-per-worker 2 --pop-size 2 --seed 0 --generations "$gens" \
  --epochs "$epochs" --train-samples "$train" --val-samples "$val" --eval-batch-size 100 \
  --trace "$tmp/trace" --log "$tmp/bd.jsonl" --json 2>/dev/null >"$tmp/bd.out" || die "the traced ddp-hpo run failed"
python3 - "$tmp/trace" "$tmp/bd.jsonl" "$tmp/bd.out" <<'PY'
import collections, json, os, sys
d = json.loads(open(sys.argv[3]).read().splitlines()[-1])
evals = {e["generation"]: e["eval_s"] for e in map(json.loads, open(sys.argv[2]))}
for rank in (0, 1):
    tot = collections.Counter(); steps = 0
    for g, eval_s in sorted(evals.items()):
        ev = json.load(open(os.path.join(sys.argv[1], f"w0-g{g}-r{rank}.json")))["traceEvents"]
        x = [e for e in ev if e.get("ph") == "X"]
        for e in x:
            tot[e["name"]] += e["dur"] / 1e6
        steps += sum(e["name"] == "step" for e in x)
        span = (max(e["ts"] + e["dur"] for e in x) - min(e["ts"] for e in x)) / 1e6
        tot["outside the trainer's run"] += eval_s - span
    n = len(evals); wait = tot["allreduce (last bucket, blocking)"]
    rows = [("forward", tot["forward"]), ("backward compute", tot["backward"] - wait),
            ("gradient allreduce (blocking, incl. waiting for the peer)", wait),
            ("loss allreduce", tot["loss allreduce"]), ("optimizer", tot["optimizer"]),
            ("batch loading", tot["load"]), ("validations", tot["evaluate"]),
            ("outside the trainer's run (model, trainer set-up/tear-down)", tot["outside the trainer's run"])]
    whole = sum(evals.values())
    print(f"rank {rank}: {n} evaluations, {whole / n:.3f} s each, {steps / n:.0f} steps each; per evaluation:")
    for name, v in rows:
        print(f"  {name:60s} {v / n:7.3f} s  {100 * v / whole:5.1f} %")
print(f"data sets opened once per process: {d['data_seconds']:.3f} s")
PY
