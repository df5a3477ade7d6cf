#!/usr/bin/env bash
# ddp-train --tensorboard DIR beside --log FILE (issue 27): the event files,
# read back by the tensorboard package's own EventAccumulator (the pinned
# reference environment: /opt/torch-venv, or DDP_TORCH_PY), hold every value
# of the JSON log at its step, as float32 (the log prints round-trip digits,
# so its numbers are the very values), and nothing the log has as null; one
# event file, named as SummaryWriter names it. The toy model (regression,
# MSE: no accuracy) and headtail (classification) for a few epochs with an
# evaluation every few steps. Skips (77) only without that Python.
set -euo pipefail
bin=${DDP_BIN_DIR:?DDP_BIN_DIR}
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
"$py" -c "import tensorboard" 2>/dev/null ||
  { echo "SKIP: no tensorboard package in $py (scripts/install-deps.sh refs)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # NAME ddp-train options...
  local name=$1; shift
  timeout 120 "$bin/ddp-train" "$@" --workers 0 --tensorboard "$tmp/$name/tb" --log "$tmp/$name/log.jsonl" \
    >"$tmp/$name.out" 2>"$tmp/$name.err" || { cat "$tmp/$name.err"; echo "FAIL: ddp-train $*"; exit 1; }
}
mkdir -p "$tmp/toy" "$tmp/headtail"
run toy --model toy --epochs 3 --eval-every 20 --seed 4
run headtail --model headtail --samples 2048 --epochs 2 --eval-every 10 --optimizer adam --lr 0.001
for name in toy headtail; do
  TB_CHECK_DIR=$(dirname "$0") "$py" - "$tmp/$name" <<'PY' || exit 1
import glob, json, os, re, socket, struct, sys
from tensorboard.backend.event_processing import event_accumulator as ea
sys.path.insert(0, os.environ["TB_CHECK_DIR"])
from tensorboard_check import STEP_TAGS as STEP, EVAL_TAGS as EVAL, f32  # the log's keys, their tags
root = sys.argv[1]
files = glob.glob(os.path.join(root, "tb", "events.out.tfevents.*"))
if len(files) != 1:
    sys.exit("FAIL: %s: expected one event file, found %r" % (root, files))
if not re.fullmatch(r"events\.out\.tfevents\.\d+\.%s\.\d+\.\d+" % re.escape(socket.gethostname()),
                    os.path.basename(files[0])):
    sys.exit("FAIL: event file name %s is not SummaryWriter's" % files[0])
acc = ea.EventAccumulator(os.path.join(root, "tb"), size_guidance={ea.SCALARS: 0})
acc.Reload()
tb = {(t, e.step): e.value for t in acc.Tags()["scalars"] for e in acc.Scalars(t)}
seen, steps, evals = set(), 0, 0
for n, line in enumerate(open(os.path.join(root, "log.jsonl")), 1):
    rec = json.loads(line)
    keys = STEP if "loss" in rec else EVAL
    steps += "loss" in rec
    evals += "loss" not in rec
    for key, tag in keys.items():
        where = (tag, rec["step"])
        if rec.get(key) is None:
            if where in tb:
                sys.exit("FAIL: log line %d has %s null, TensorBoard %r" % (n, key, tb[where]))
            continue
        if where not in tb:
            sys.exit("FAIL: log line %d: %s = %r at step %d is not in TensorBoard" % (n, key, rec[key], rec["step"]))
        if struct.pack("<f", tb[where]) != struct.pack("<f", f32(rec[key])):
            sys.exit("FAIL: %s at step %d: TensorBoard %r, the log %r (float32 %r)"
                     % (tag, rec["step"], tb[where], rec[key], f32(rec[key])))
        seen.add(where)
if set(tb) != seen:
    sys.exit("FAIL: TensorBoard has values the log does not: %r" % sorted(set(tb) - seen)[:5])
if steps == 0 or evals == 0:
    sys.exit("FAIL: the log has %d steps and %d evaluations" % (steps, evals))
print("ok %s: %d scalars at %d steps and %d evaluations equal to the log" % (os.path.basename(root), len(seen), steps, evals))
PY
done
