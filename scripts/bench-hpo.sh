#!/usr/bin/env bash
# The search's own cost against Propulate 1.2.2's, in the same go (issue
# 22): the 2-D sphere (an objective that costs nothing), 2 ranks as 2
# workers on one island, pop_size 4, GENERATIONS per worker, checkpointing
# on (Propulate: its pickle per generation; ddp-hpo: --checkpoint, commits
# every second and at the end). Each round runs both (the order alternating);
# each side's figure is the median of its rounds' evaluations per second
# (the search alone, not the processes' start), and the ratio is ddp / Propulate.
#   scripts/bench-hpo.sh [rounds=5] [generations=500]
# Needs build/bin/{ddprun,ddp-hpo}, Open MPI and the reference environment
# (scripts/install-deps.sh refs: /opt/torch-venv, or DDP_TORCH_PY).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
gens=${2:-500}
py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
ref=${DDP_SHARED_DIR:-../shared}/refs/propulate_sphere.py
die() { echo "bench-hpo: $*" >&2; exit 2; }
[ -x build/bin/ddp-hpo ] || die "build first (scripts/build.sh)"
[ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR)"
"$py" -c "import propulate" 2>/dev/null || die "no Propulate at $py (scripts/install-deps.sh refs)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ours() {
  rm -rf "$tmp/ckpt"
  DDP_TIMEOUT=120 timeout 600 build/bin/ddprun --nproc-per-node 2 build/bin/ddp-hpo --objective sphere \
    --generations "$gens" --pop-size 4 --checkpoint "$tmp/ckpt" --json 2>/dev/null | tail -n 1 |
    python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["evals_per_s"])'
}
theirs() {
  timeout 600 mpirun --allow-run-as-root --oversubscribe -np 2 "$py" "$ref" --generations "$gens" 2>/dev/null |
    sed -n 's/.*evals_per_s=\([0-9.]*\).*/\1/p' | tail -n 1
}
o=() t=()
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then a=$(ours); b=$(theirs); else b=$(theirs); a=$(ours); fi
  echo "round $r: ddp-hpo $a evaluations/s, Propulate $b evaluations/s" >&2
  o+=("$a"); t+=("$b")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mo=$(median "${o[@]}"); mt=$(median "${t[@]}")
awk -v o="$mo" -v t="$mt" -v r="$rounds" -v g="$gens" 'BEGIN {
  printf "sphere, 2 workers, %d generations each, checkpoints on: ddp-hpo %.0f evaluations/s, Propulate %.0f evaluations/s, ratio %.0fx (median of %d rounds)\n", g, o, t, o / t, r }'
