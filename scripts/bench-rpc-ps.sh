#!/usr/bin/env bash
# Seed 001's parameter-server program: ddp's examples/rpc_parameter_server
# against PyTorch's torch.distributed.rpc reference
# (../shared/refs/torch_rpc_parameter_server.py) in the same go, alternating
# round by round, both from the same initial weights (the reference's
# --save-init). Prints each run's samples/s and test accuracy, then the
# medians of samples/s, their ratio, and the mean accuracies (issue 24:
# ddp >= 2x the samples/s, accuracy within 0.5 points).
#
#   scripts/bench-rpc-ps.sh [ROUNDS (3)] [EPOCHS (1)] [TRAINERS (1)]
#
# Environment: BUILD (build dir, default build), PY (the PyTorch Python,
# default /opt/torch-venv/bin/python), MAX_STEPS (per trainer, 0 = whole
# epochs), ONLY=ddp to run ddp alone (the multi-trainer runs: PyTorch's
# program fails with more than one trainer). Not part of CI: one round of
# one epoch takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
EPOCHS=${2:-1}
TRAINERS=${3:-1}
BUILD=${BUILD:-build}
PY=${PY:-/opt/torch-venv/bin/python}
MAX_STEPS=${MAX_STEPS:-0}
ONLY=${ONLY:-}
REF=../shared/refs/torch_rpc_parameter_server.py
EXE=$BUILD/bin/rpc_parameter_server
DDPRUN=$BUILD/bin/ddprun
[ -x "$EXE" ] && [ -x "$DDPRUN" ] || { echo "build $EXE and $DDPRUN first" >&2; exit 2; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
INIT=$WORK/init.safetensors

# The initial weights: the reference's ParameterServer with seed 0.
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
"$PY" "$REF" --trainers 1 --max-steps 1 --save-init "$INIT" --port "$(port)" >/dev/null 2>&1
[ -s "$INIT" ] || { echo "the reference did not write $INIT" >&2; exit 1; }

field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" | tail -1; }
echo "round impl samples_per_s test_accuracy"
for r in $(seq 1 "$ROUNDS"); do
  out=$("$DDPRUN" --nproc-per-node $((TRAINERS + 1)) "$EXE" --init "$INIT" --epochs "$EPOCHS" \
        --max-steps "$MAX_STEPS" 2>"$WORK/ddp.err") || { cat "$WORK/ddp.err" >&2; exit 1; }
  echo "$r ddp $(echo "$out" | field samples_per_s) $(echo "$out" | field test_accuracy)" | tee -a "$WORK/runs"
  [ -n "$ONLY" ] && continue
  out=$("$PY" "$REF" --trainers "$TRAINERS" --epochs "$EPOCHS" --max-steps "$MAX_STEPS" \
        --port "$(port)" 2>"$WORK/torch.err") || { tail -5 "$WORK/torch.err" >&2; exit 1; }
  echo "$r torch $(echo "$out" | field samples_per_s) $(echo "$out" | field test_accuracy)" | tee -a "$WORK/runs"
done
"$PY" - "$WORK/runs" <<'EOF'
import statistics as st, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for _, impl, sps, acc in rows:
    by.setdefault(impl, []).append((float(sps), float(acc)))
for impl, v in by.items():
    print(f"{impl}: median samples/s {st.median(s for s, _ in v):.1f}, mean test accuracy "
          f"{100 * st.mean(a for _, a in v):.2f}% over {len(v)} runs "
          f"(accuracies {', '.join(f'{100 * a:.2f}' for _, a in v)})")
if "ddp" in by and "torch" in by:
    d, t = by["ddp"], by["torch"]
    # The load of a shared machine drifts between rounds: the ratio within
    # each round (ddp then PyTorch, back to back) is the steadier figure.
    pairs = [a / b for (a, _), (b, _) in zip(d, t)]
    print(f"ratio within each round: {', '.join(f'{r:.2f}' for r in pairs)}; "
          f"median {st.median(pairs):.2f}x")
    print(f"ratio of medians (ddp / torch) samples/s: "
          f"{st.median(s for s, _ in d) / st.median(s for s, _ in t):.2f}x; "
          f"accuracy difference (ddp - torch): "
          f"{100 * (st.mean(a for _, a in d) - st.mean(a for _, a in t)):+.2f} points")
EOF
