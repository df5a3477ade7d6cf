#!/usr/bin/env bash
# Memory per rank under ZeRO against plain data parallelism (issue 41's
# memory table): an MLP of about 100 M parameters (mlp:4096x8, 100.8 M) at
# world 4, Adam, a few steps, three runs: plain data parallelism, --zero 1,
# --zero 2. For each, every rank's training-state bytes from ddp-train's
# --json (memory_per_rank: parameters, gradients, optimizer state) in bytes
# per parameter, and each rank's peak resident set from /usr/bin/time (what
# the process held at most: the state, the activations, the loader, the
# one-time whole optimizer made before ZeRO narrows it, the libraries).
# Plain Adam data parallelism holds 16 bytes per parameter (4 + 4 + 8); the
# issue asks for the optimizer state at 1/W of that (+-5 %).
#   scripts/zero-memory.sh [model=mlp:4096x8] [world=4]
# About 4 x 1.6 GB of memory for plain data parallelism at the default size.
# Needs build/bin/{ddprun,ddp-train} (scripts/build.sh) and /usr/bin/time.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-mlp:4096x8}
world=${2:-4}
die() { echo "zero-memory: $*" >&2; exit 2; }
[ -x build/bin/ddprun ] && [ -x build/bin/ddp-train ] || die "build first (scripts/build.sh)"
[ -x /usr/bin/time ] || die "needs /usr/bin/time (apt-get install time)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-6s %-5s %12s %12s %12s %14s\n' run rank "param B/p" "grad B/p" "optim B/p" "peak RSS MiB"
for run in dp zero1 zero2; do
  case $run in dp) extra=() ;; zero1) extra=(--zero 1) ;; zero2) extra=(--zero 2) ;; esac
  timeout 1800 build/bin/ddprun --nproc-per-node "$world" /usr/bin/time -f "peak_rss_kb %M" \
    build/bin/ddp-train --model "$model" --optimizer adam --lr 1e-4 --max-steps 3 \
    --batch-size 32 --workers 0 --json "${extra[@]}" >"$tmp/$run.out" 2>"$tmp/$run.err" ||
    { tail -5 "$tmp/$run.err" >&2; die "the $run run failed"; }
  python3 - "$tmp/$run.out" "$tmp/$run.err" "$run" <<'PY'
import json, re, sys
out, err, run = sys.argv[1:]
mem = json.loads(open(out).read().splitlines()[-1])["memory_per_rank"]
rss = [int(m) for m in re.findall(r"peak_rss_kb (\d+)", open(err).read())]
n = mem[0]["param_bytes"] / 4  # parameters
for r, m in enumerate(mem):
    peak = "%.0f" % (rss[r] / 1024) if r < len(rss) else "?"  # lines come in exit order
    print("%-6s %-5d %12.3f %12.3f %12.3f %14s" % (run, r, m["param_bytes"] / n, m["grad_bytes"] / n,
                                                   m["optim_state_bytes"] / n, peak))
PY
done
echo "(peak RSS lines are in the order the ranks exited, not by rank)"
