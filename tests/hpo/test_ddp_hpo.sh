#!/usr/bin/env bash
# ddp-hpo from the command line:
#  - on the sphere with --seed 0 it evaluates Propulate 1.2.2's individuals
#    in Propulate's order (its --log against tests/fixtures/hpo_propulate.txt,
#    exact), and --json reports the best of them;
#  - on a benchmark function the summary lists the top n by loss;
#  - --objective convnet trains each individual with the trainer (a tiny
#    budget) and records a finite loss per generation;
#  - under ddprun, 2 ranks are 2 workers exchanging their individuals (rank
#    0 reports both workers' generations), and 2 ranks as 1 worker of 2
#    train each convnet individual together;
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

timeout 60 "$bin" --objective sphere --generations 300 --pop-size 4 --seed 0 --log "$tmp/sphere.jsonl" \
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
"$bin" --help | grep -q -- "--ranks-per-worker R" || fail "--help"
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
fi
echo "all passed"
