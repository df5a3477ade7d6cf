#!/usr/bin/env bash
# ddp-train from the command line: --help documents every flag, bad flags fail
# with exit 2 and a message, the same seed gives the same loss curve twice
# (with different loader thread counts too), --max-steps and --json hold,
# --log writes the promised records, --patience stops early.
set -euo pipefail
bin=${DDP_BIN_DIR:?}/ddp-train
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1"; fail=$((fail+1)); fi; }
py() { /usr/bin/python3 -c "$@"; }

help=$("$bin" --help)
for flag in --model --activation --data --epochs --max-steps --batch-size --lr --optimizer \
            --momentum --weight-decay --scheduler --step-size --gamma --seed --threads --workers \
            --eval-every --patience --log --json --sync-bn --dump-state --help; do
  check "--help documents $flag" 'grep -q -- "$flag" <<<"$help"'
done

set +e
out=$("$bin" --no-such-flag 2>&1); rc=$?
set -e
check "unknown flag exits 2" '[ $rc -eq 2 ]'
check "unknown flag is named" 'grep -q "unknown option .--no-such-flag." <<<"$out"'
set +e
out=$("$bin" --model resnet 2>&1); rc=$?
set -e
check "unknown model exits 1 listing the choices" '[ $rc -eq 1 ] && grep -q convnet <<<"$out"'

# Same seed, same curve: two runs (one with 0 loader threads, one with 2).
common=(--model toy --data regression --epochs 3 --batch-size 16 --seed 5 --lr 0.05)
"$bin" "${common[@]}" --workers 0 --log "$tmp/a.jsonl" >/dev/null 2>&1
"$bin" "${common[@]}" --workers 2 --log "$tmp/b.jsonl" >/dev/null 2>&1
strip() { py 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    for k in ("samples_per_s", "load_ms", "forward_ms", "backward_compute_ms", "backward_comm_ms",
              "optimizer_ms", "step_ms", "preempted_ms"): r.pop(k, None)
    print(json.dumps(r, sort_keys=True))' "$1"; }
check "same seed gives the same loss curve" 'diff <(strip "$tmp/a.jsonl") <(strip "$tmp/b.jsonl") >/dev/null'
check "a different seed gives a different curve" \
  '"$bin" "${common[@]}" --seed 6 --log "$tmp/c.jsonl" >/dev/null 2>&1; ! diff -q <(strip "$tmp/a.jsonl" 2>/dev/null) <(strip "$tmp/c.jsonl" 2>/dev/null) >/dev/null'
check "the log has per-step and per-eval records" \
  'py "import json,sys
rs=[json.loads(l) for l in open(sys.argv[1])]
steps=[r for r in rs if \"loss\" in r]; evals=[r for r in rs if \"test_loss\" in r]
phases=[\"load_ms\",\"forward_ms\",\"backward_compute_ms\",\"backward_comm_ms\",\"optimizer_ms\"]
assert len(steps)==3*64 and all(set(r)=={\"step\",\"epoch\",\"loss\",\"lr\",\"samples_per_s\",\"step_ms\",\"preempted_ms\"}|set(phases) for r in steps)
# Preemption is a cause, not a part: within the step, never negative
# (null on a kernel without schedstat).
assert all(r[\"preempted_ms\"] is None or 0<=r[\"preempted_ms\"]<=r[\"step_ms\"]*1.0001+1e-6 for r in steps)
# The phases are disjoint parts of the step: none negative, together within it.
assert all(min(r[k] for k in phases)>=0 and sum(r[k] for k in phases)<=r[\"step_ms\"]*1.0001+1e-6 for r in steps)
# One process: no communication.
assert all(r[\"backward_comm_ms\"]==0 for r in steps)
assert [r[\"step\"] for r in steps]==list(range(1,3*64+1))
assert len(evals)==3 and all(set(r)=={\"step\",\"epoch\",\"test_loss\",\"test_accuracy\"} for r in evals)" "$tmp/a.jsonl"'

# preempted_ms: pinned to one CPU with two busy loops, ddp-train is kept
# from running about two thirds of every step (each of the three gets a
# third); the clock must say so (the CPU time itself would read a third).
if [ -r /proc/thread-self/schedstat ]; then
  cpu=$(py 'import os; print(min(os.sched_getaffinity(0)))')
  spinners=()
  for i in 1 2; do timeout 60 taskset -c "$cpu" sh -c 'while :; do :; done' & spinners+=($!); done
  json=$(timeout 60 taskset -c "$cpu" "$bin" --model toy --data regression --samples 1048576 \
          --batch-size 65536 --epochs 2 --workers 0 --json 2>/dev/null | tail -n 1)
  kill "${spinners[@]}"; wait "${spinners[@]}" 2>/dev/null || true
  check "a rank sharing its CPU with two busy loops waits for it two thirds of each step" \
    'py "import json,sys
d=json.loads(sys.argv[1]); p=d[\"steady_step_phases\"]
assert d[\"steady_preempted_ms_per_rank\"]==[p[\"preempted_ms\"]], d
assert 0.45*p[\"step_ms\"]<=p[\"preempted_ms\"]<=p[\"step_ms\"], p" "$json"'
else
  echo "SKIP: preempted_ms (this kernel keeps no /proc/thread-self/schedstat)"
fi

# --max-steps, --json and the StepLR schedule (step-size counts epochs).
json=$("$bin" --model toy --data regression --samples 160 --batch-size 16 --epochs 5 --max-steps 25 \
        --scheduler step --step-size 1 --gamma 0.5 --lr 0.1 --log "$tmp/d.jsonl" --json 2>/dev/null | tail -n 1)
check "--max-steps stops at 25 and --json reports it" \
  'py "import json,sys; r=json.loads(sys.argv[1]); assert r[\"steps\"]==25 and abs(r[\"epochs\"]-2.5)<1e-9 and r[\"world_size\"]==1 and r[\"samples_per_s\"]>0 and r[\"steady_samples_per_s\"]>0" "$json"'
check "StepLR halves the lr each epoch" \
  'py "import json,sys
rs=[json.loads(l) for l in open(sys.argv[1]) if \"lr\" in l]
assert [r[\"lr\"] for r in rs]==[0.1]*10+[0.05]*10+[0.025]*5, [r[\"lr\"] for r in rs]" "$tmp/d.jsonl"'

# --patience: with a huge lr the test loss never improves after the first eval.
json=$("$bin" --model headtail --data toydata --samples 2000 --batch-size 100 --epochs 50 --eval-every 2 \
        --patience 2 --lr 0 --json 2>/dev/null | tail -n 1)
check "--patience 2 stops after 2 evaluations without improvement" \
  'py "import json,sys; r=json.loads(sys.argv[1]); assert r[\"steps\"]==6, r" "$json"'

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
