#!/usr/bin/env bash
# ddp-hpo from the command line:
#  - on the sphere with --seed 0 (and --migration-prob 0, the fixture's
#    Propulate option) it evaluates Propulate 1.2.2's individuals in
#    Propulate's order (its --log against tests/fixtures/hpo_propulate.txt,
#    exact), and --json reports the best of them;
#  - on a benchmark function the summary lists the top n by loss;
#  - --objective convnet trains each individual with the trainer (a tiny
#    budget) and records a finite loss per generation;
#  - under ddprun, 2 ranks are 2 workers exchanging their individuals (rank
#    0 reports both workers' generations), and 2 ranks as 1 worker of 2
#    train each convnet individual together, each rank of each evaluation
#    writing its timeline (--trace) with the expected steps and evaluations;
#  - --objective cmd: runs a program per evaluation: its printed loss (a
#    number or JSON) is the individual's; one that fails, hangs past
#    --eval-timeout (killed with what it started) or prints no loss counts
#    as inf with the reason on stderr, and the search goes on; a worker of 2
#    ranks runs it on both as one ddp job (RANK, WORLD_SIZE, a store prefix of
#    its own per evaluation), here ddp-train training data-parallel;
#  - --json escapes the objective (a quote in a cmd: line); under ddprun
#    --trace a cmd: evaluation inherits none of the launcher's variables
#    (the trace file, the restart count: launch's one contract);
#  - mistakes are named and exit 2 (1 for a broken launch environment).
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-hpo
here=$(cd "$(dirname "$0")" && pwd)
fixture=$here/../fixtures/hpo_propulate.txt
py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
unset WORLD_SIZE DDP_STORE_ADDR

timeout 60 "$bin" --objective sphere --generations 300 --pop-size 4 --seed 0 --migration-prob 0 --log "$tmp/sphere.jsonl" \
  --json >"$tmp/sphere.out" 2>"$tmp/sphere.err" || { cat "$tmp/sphere.err"; fail "sphere search"; }
"$py" - "$tmp/sphere.jsonl" "$fixture" "$tmp/sphere.out" <<'PY' || fail "the sphere search is not Propulate's"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
lines = open(sys.argv[2]).read().splitlines()
start = lines.index("problem sphere 0 4 300") + 1
want = [l.split() for l in lines[start:start + 300]]
assert len(log) == 300, len(log)
for rec, w in zip(log, want):
    assert rec["generation"] == int(w[0]), (rec, w)
    assert rec["loss"] == float(w[1]), (rec, w)
    assert rec["a"] == float(w[2].split("=")[1]) and rec["b"] == float(w[3].split("=")[1]), (rec, w)
summary = json.loads(open(sys.argv[3]).read().splitlines()[-1])
best = min(log, key=lambda r: r["loss"])
assert summary["evaluations"] == 300 and summary["best_loss"] == best["loss"], (summary, best)
assert summary["best_generation"] == best["generation"], summary
PY
echo "ok sphere: 300 generations equal Propulate's, the best reported"

timeout 60 "$bin" --objective rastrigin --generations 500 --pop-size 8 --top-n 3 >"$tmp/r.out" 2>"$tmp/r.err" \
  || { cat "$tmp/r.err"; fail "rastrigin search"; }
[ "$(grep -c '^([123]): a=' "$tmp/r.err")" = 3 ] || { cat "$tmp/r.err"; fail "no top 3 in the summary"; }
"$py" - "$tmp/r.err" <<'PY' || fail "the top 3 are not in order of loss"
import re, sys
losses = [float(m) for m in re.findall(r"loss ([0-9.e+-]+), island", open(sys.argv[1]).read())]
assert len(losses) == 3 and losses == sorted(losses), losses
PY
echo "ok rastrigin: the top 3 by loss"

data=/usr/share/datasets/fashion-mnist
if [ -n "${DDP_SANITIZER:-}" ]; then
  echo "note: convnet objective not run under the $DDP_SANITIZER sanitizer (minutes of training)"
elif [ ! -e "$data/t10k-labels-idx1-ubyte.gz" ]; then
  echo "note: $data not installed (install-deps.sh data): convnet objective not run"
else
  timeout 300 "$bin" --objective convnet --generations 2 --epochs 1 --max-steps 20 --log "$tmp/c.jsonl" \
    --json >"$tmp/c.out" 2>"$tmp/c.err" || { cat "$tmp/c.err"; fail "convnet search"; }
  "$py" - "$tmp/c.jsonl" <<'PY' || fail "convnet's evaluations"
import json, math, sys
log = [json.loads(l) for l in open(sys.argv[1])]
assert len(log) == 2, log
for r in log:
    assert 2 <= r["conv_layers"] <= 10 and r["activation"] in ("relu", "sigmoid", "tanh"), r
    assert 1e-4 <= r["lr"] <= 1e-2 and 0.5 <= r["gamma"] <= 0.999, r
    assert r["loss"] is not None and math.isfinite(r["loss"]) and r["loss"] > 0, r
PY
  echo "ok convnet: two individuals trained, each with a finite test loss"
fi

expect_usage() { # EXPECTED ARGS...
  local want=$1; shift
  "$bin" "$@" >"$tmp/u.out" 2>"$tmp/u.err"
  local rc=$?
  [ $rc = 2 ] && grep -q -- "$want" "$tmp/u.err" || { cat "$tmp/u.err"; fail "ddp-hpo $*: exit $rc, expected 2 and '$want'"; }
}
expect_usage "no benchmark function 'ackley'" --objective ackley
expect_usage "lr: logfloat needs bounds > 0" --objective convnet --space "lr=logfloat:0:1"
expect_usage "needs a trait 'conv_layers'" --objective convnet --space "x=float:0:1"
expect_usage "float traits only" --objective sphere --space "a=int:1:3"
expect_usage "--pop-size expects an integer >= 2" --pop-size 1
expect_usage "needs that many ranks" --ranks-per-worker 2
WORLD_SIZE=2 "$bin" --generations 1 >/dev/null 2>"$tmp/w.err"; rc=$?
[ $rc = 1 ] && grep -q "rank is not set" "$tmp/w.err" || fail "WORLD_SIZE=2 alone: exit $rc: $(cat "$tmp/w.err")"
"$bin" --help >"$tmp/help" && grep -q -- "--ranks-per-worker R" "$tmp/help" || fail "--help"
echo "ok mistakes named"

ddprun=${DDP_BIN_DIR}/ddprun
export DDP_TIMEOUT=60
timeout 120 "$ddprun" --nproc-per-node 2 "$bin" --objective sphere --generations 400 --log "$tmp/w2.jsonl" --json \
  >"$tmp/w2.out" 2>"$tmp/w2.err" || { cat "$tmp/w2.err"; fail "2 workers under ddprun"; }
"$py" - "$tmp/w2.jsonl" "$tmp/w2.out" <<'PY' || fail "2 workers: rank 0 does not hold both workers' individuals"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
summary = json.loads(open(sys.argv[2]).read().splitlines()[-1])
assert summary["workers"] == 2 and summary["evaluations"] == 800, summary
for w in (0, 1):
    gens = [r["generation"] for r in log if r["worker"] == w]
    assert gens == list(range(400)), (w, gens[:5], len(gens))
    assert all(r["loss"] == r["a"] * r["a"] + r["b"] * r["b"] for r in log if r["worker"] == w)
PY
echo "ok 2 workers under ddprun: rank 0 holds both workers' 400 generations"
timeout 60 "$ddprun" --nproc-per-node 3 "$bin" --ranks-per-worker 2 >/dev/null 2>"$tmp/w3.err"
grep -q "3 ranks do not split into workers of 2" "$tmp/w3.err" || { cat "$tmp/w3.err"; fail "3 ranks, workers of 2"; }
if [ -z "${DDP_SANITIZER:-}" ] && [ -e "$data/t10k-labels-idx1-ubyte.gz" ]; then
  timeout 300 "$ddprun" --nproc-per-node 2 "$bin" --objective convnet --ranks-per-worker 2 --generations 2 --epochs 1 \
    --max-steps 10 --log "$tmp/cw.jsonl" --json >"$tmp/cw.out" 2>"$tmp/cw.err" || { cat "$tmp/cw.err"; fail "a worker of 2 ranks"; }
  "$py" - "$tmp/cw.jsonl" "$tmp/cw.out" <<'PY' || fail "a worker of 2 ranks: its evaluations"
import json, math, sys
log = [json.loads(l) for l in open(sys.argv[1])]
summary = json.loads(open(sys.argv[2]).read().splitlines()[-1])
assert summary["workers"] == 1 and len(log) == 2, (summary, log)
assert all(r["worker"] == 0 and math.isfinite(r["loss"]) for r in log), log
PY
  echo "ok 1 worker of 2 ranks: 2 convnet individuals trained together"
  # Seed 002's work per evaluation, as scripts/bench-hpo-seed.sh counts it:
  # each rank trains on half of the first 64 images, 64 / 2 / 8 = 4 steps an
  # epoch, and validates once after each epoch (the timelines' steps and
  # evaluations); the data sets' opening time is reported.
  mkdir "$tmp/trace"
  timeout 300 "$ddprun" --nproc-per-node 2 "$bin" --objective convnet --ranks-per-worker 2 --generations 2 \
    --epochs 2 --patience 5 --train-samples 64 --val-samples 300 --eval-batch-size 100 --trace "$tmp/trace" \
    --json >"$tmp/tw.out" 2>"$tmp/tw.err" || { cat "$tmp/tw.err"; fail "--trace"; }
  "$py" - "$tmp/trace" "$tmp/tw.out" <<'PY' || fail "--trace: the evaluations' steps"
import json, os, sys
summary = json.loads(open(sys.argv[2]).read().splitlines()[-1])
assert summary["data_seconds"] > 0, summary
names = sorted(os.listdir(sys.argv[1]))
assert names == [f"w0-g{g}-r{r}.json" for g in range(2) for r in range(2)], names
for n in names:
    ev = json.load(open(os.path.join(sys.argv[1], n)))["traceEvents"]
    steps = [e for e in ev if e.get("name") == "step"]
    evals = [e for e in ev if e.get("name") == "evaluate"]
    assert len(steps) == 8 and len(evals) == 2, (n, len(steps), len(evals))
PY
  echo "ok --trace: a timeline per rank and evaluation, 4 steps an epoch, an evaluation per epoch"
fi
# --- cmd: ----------------------------------------------------------------
cat >"$tmp/loss.py" <<'PYEOF'
import json, sys
a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
x, y = float(a["--a"]), float(a["--b"])
print("chatter first")
print(json.dumps({"loss": x * x + y * y, "other": 1}))
PYEOF
sphere_space="a=float:-5.12:5.12,b=float:-5.12:5.12"
timeout 120 "$bin" --objective "cmd:$py $tmp/loss.py" --space "$sphere_space" --generations 8 --seed 0 --migration-prob 0 \
  --log "$tmp/cmd.jsonl" >/dev/null 2>"$tmp/cmd.err" || { cat "$tmp/cmd.err"; fail "cmd: search"; }
"$py" - "$tmp/cmd.jsonl" "$fixture" <<'PY' || fail "cmd: losses are not the program's"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
lines = open(sys.argv[2]).read().splitlines()
start = lines.index("problem sphere 0 4 300") + 1
assert len(log) == 8
for r, w in zip(log, lines[start:start + 8]):
    assert r["loss"] == r["a"] * r["a"] + r["b"] * r["b"] == float(w.split()[1]), (r, w)
PY
echo "ok cmd: the program's JSON loss, the sphere's individuals"
cat >"$tmp/faulty.sh" <<'SHEOF'
#!/bin/sh
# --a A --b B. By the signs: (+, -) exits 3, (-, -) hangs, (+, +) prints
# garbage when b > 1 and 1.5 otherwise. Seed 0's first 16 individuals
# (Propulate's) hold every case: +- at 0, -- at 2, ++ with b < 1 at 3,
# ++ with b > 1 at 9.
case "$2" in -*) na=1 ;; *) na=0 ;; esac
case "$4" in -*) nb=1 ;; *) nb=0 ;; esac
[ $na = 0 ] && [ $nb = 1 ] && exit 3
[ $na = 1 ] && [ $nb = 1 ] && sleep 31.7
[ $na = 0 ] && [ "$(echo "$4" | cut -c1)" != 0 ] && { echo "not a number"; exit 0; }
echo 1.5
SHEOF
chmod +x "$tmp/faulty.sh"
timeout 120 "$bin" --objective "cmd:$tmp/faulty.sh" --space "$sphere_space" --generations 16 --seed 0 --migration-prob 0 \
  --eval-timeout 0.5 --log "$tmp/faulty.jsonl" >/dev/null 2>"$tmp/faulty.err" || { cat "$tmp/faulty.err"; fail "cmd: faulty search"; }
"$py" - "$tmp/faulty.jsonl" "$tmp/faulty.err" <<'PY' || fail "cmd: failures not recorded as inf with their reasons"
import json, sys
log = [json.loads(l) for l in open(sys.argv[1])]
err = open(sys.argv[2]).read()
assert len(log) == 16, len(log)
def kind(r):
    if r["a"] >= 0 and r["b"] < 0: return "exit"
    if r["a"] < 0 and r["b"] < 0: return "hang"
    if r["a"] >= 0 and r["b"] >= 1: return "garbage"
    return "ok"
kinds = [kind(r) for r in log]
for r, k in zip(log, kinds):
    assert (r["loss"] == 1.5) if k == "ok" else (r["loss"] is None), (k, r)
    if k == "hang":
        assert r["eval_s"] >= 0.45, r  # killed at the timeout
assert {"exit", "hang", "garbage", "ok"} <= set(kinds), kinds
for text in ("exited 3", "timed out after 0.5 s", "no loss"):
    assert text in err, text
PY
# The timeout kills the program's process group: its sleep too.
! pgrep -f "sleep 31.7" >/dev/null || fail "a timed-out evaluation left its sleep running"
echo "ok cmd: failures, a hang and garbage count as inf with their reasons; the search completed"
# --json escapes what it prints: an objective holding a quote and a
# backslash (passed on to the program as an argument) is still one JSON line
# that reads back to the same text.
quoted="cmd:$py $tmp/loss.py --tag x\"y\\z"
timeout 60 "$bin" --objective "$quoted" --space "$sphere_space" --generations 2 --seed 0 --json \
  >"$tmp/q.out" 2>"$tmp/q.err" || { cat "$tmp/q.err"; fail "cmd: with a quote"; }
"$py" - "$tmp/q.out" "$quoted" <<'PY' || fail "--json: the objective is not escaped"
import json, sys
summary = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert summary["objective"] == sys.argv[2], (summary["objective"], sys.argv[2])
PY
echo "ok --json: an objective with a quote and a backslash is escaped"
# Under ddprun --trace the cmd: evaluations follow the launcher's contract:
# they do not inherit the outer rank's trace file or restart count (nor its
# rank, store or run id), so a program tracing itself does not overwrite
# rank 0's timeline.
cat >"$tmp/envdump.sh" <<SHEOF
#!/bin/sh
env >"$tmp/evalenv.\$\$"
echo 1.0
SHEOF
chmod +x "$tmp/envdump.sh"
mkdir "$tmp/outer-trace"
timeout 60 "$ddprun" --nproc-per-node 1 --trace "$tmp/outer-trace" "$bin" --objective "cmd:$tmp/envdump.sh" \
  --space "$sphere_space" --generations 2 >/dev/null 2>"$tmp/te.err" || { cat "$tmp/te.err"; fail "cmd: under ddprun --trace"; }
ls "$tmp"/evalenv.* >/dev/null 2>&1 || fail "cmd: under ddprun --trace: no evaluation ran"
for f in "$tmp"/evalenv.*; do
  for var in DDP_TRACE_FILE TORCHELASTIC_RESTART_COUNT TORCHELASTIC_RUN_ID TORCHELASTIC_MAX_RESTARTS DDP_STORE_ADDR; do
    ! grep -q "^$var=" "$f" || fail "cmd: an evaluation under ddprun --trace inherited $(grep "^$var=" "$f")"
  done
  grep -q '^RANK=0$' "$f" && grep -q '^DDP_HPO_A=' "$f" || fail "cmd: an evaluation's own variables are missing"
done
echo "ok cmd: under ddprun --trace an evaluation inherits no trace file, restart count, run id or store"
if [ -z "${DDP_SANITIZER:-}" ]; then
  cat >"$tmp/train.sh" <<SHEOF
#!/bin/sh
echo "\$RANK \$WORLD_SIZE \$DDP_STORE_PREFIX" >>"$tmp/env.\$RANK"
exec ${DDP_BIN_DIR}/ddp-train --model toy --epochs 1 --workers 0 --json "\$@"
SHEOF
  chmod +x "$tmp/train.sh"
  timeout 180 "$ddprun" --nproc-per-node 2 "$bin" --objective "cmd:$tmp/train.sh" --loss-key test_loss \
    --space "lr=logfloat:0.001:0.1,momentum=float:0:0.9" --ranks-per-worker 2 --generations 2 \
    --log "$tmp/ddp.jsonl" --json >"$tmp/ddp.out" 2>"$tmp/ddp.err" || { cat "$tmp/ddp.err"; fail "cmd: ddp-train on a worker of 2"; }
  "$py" - "$tmp/ddp.jsonl" "$tmp/env.0" "$tmp/env.1" <<'PY' || fail "cmd: ddp-train on a worker of 2 ranks"
import json, math, sys
log = [json.loads(l) for l in open(sys.argv[1])]
assert len(log) == 2 and all(r["loss"] is not None and math.isfinite(r["loss"]) for r in log), log
e0 = [l.split() for l in open(sys.argv[2])]
e1 = [l.split() for l in open(sys.argv[3])]
assert [r[:2] for r in e0] == [["0", "2"]] * 2 and [r[:2] for r in e1] == [["1", "2"]] * 2, (e0, e1)
assert e0[0][2] == e1[0][2] and e0[1][2] == e1[1][2] and e0[0][2] != e0[1][2], (e0, e1)
PY
  echo "ok cmd: ddp-train as one 2-rank job per evaluation, a store prefix each"
fi
echo "all passed"
