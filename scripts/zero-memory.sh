#!/usr/bin/env bash
# Memory per rank under ZeRO against plain data parallelism (issue 41's
# memory table): an MLP of about 100 M parameters (mlp:4096x8, 100.8 M) at
# world 4, Adam, a few steps, five runs: plain data parallelism, --zero 1,
# --zero 2, --zero 3 and --zero 3 --zero-prefetch off (zero3np: one module
# gathered at a time instead of two). For each, every rank's training-state bytes from ddp-train's
# --json (memory_per_rank: parameters, gradients, optimizer state) in bytes
# per parameter, the part of the gradient buffer holding reduced gradients,
# the peak of tensor memory (the buffers plus the tape's activations) and
# each rank's peak resident set (ru_maxrss: what the process held at most:
# the state, the activations, the loader, the one-time whole optimizer made
# before ZeRO narrows it, the libraries), all from --json's memory_per_rank.
# Plain Adam data parallelism holds 16 bytes per parameter (4 + 4 + 8); the
# issue asks for the optimizer state at 1/W of that (+-5 %), and under
# --zero 2 for the gradients at 1/W: the script checks each rank's kept
# gradient range at 1/W (+-5 %) and its gradients as that range plus the
# gradient ring (two bucket-sized slots, docs/sharding.md), and exits 1
# otherwise.
#   scripts/zero-memory.sh [model=mlp:4096x8] [world=4]
# About 4 x 1.6 GB of memory for plain data parallelism at the default size.
# Needs build/bin/{ddprun,ddp-train} (scripts/build.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-mlp:4096x8}
world=${2:-4}
die() { echo "zero-memory: $*" >&2; exit 2; }
[ -x build/bin/ddprun ] && [ -x build/bin/ddp-train ] || die "build first (scripts/build.sh)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-7s %-5s %10s %10s %10s %12s %10s %10s %12s %12s %8s\n' run rank "param B/p" "grad B/p" \
  "optim B/p" "reduced B/p" "ring B/p" "sum B/p" "peak tensor" "peak RSS" "fits?"
printf '%-7s %-5s %10s %10s %10s %12s %10s %10s %12s %12s %8s\n' "" "" "" "" "" "(grad)" "(grad)" "" "MiB" "MiB" "24 GiB"
for run in dp zero1 zero2 zero3 zero3np; do
  case $run in
    dp) extra=() ;; zero1) extra=(--zero 1) ;; zero2) extra=(--zero 2) ;; zero3) extra=(--zero 3) ;;
    zero3np) extra=(--zero 3 --zero-prefetch off) ;;
  esac
  timeout 1800 build/bin/ddprun --nproc-per-node "$world" \
    build/bin/ddp-train --model "$model" --optimizer adam --lr 1e-4 --max-steps 3 \
    --batch-size 32 --workers 0 --json "${extra[@]}" >"$tmp/$run.out" 2>"$tmp/$run.err" ||
    { tail -5 "$tmp/$run.err" >&2; die "the $run run failed"; }
  python3 - "$tmp/$run.out" "$tmp/$run.err" "$run" "$world" <<'PY' || die "the $run figures are not what the issue asks"
import json, re, sys
out, err, run, world = sys.argv[1:]
W = int(world)
mem = json.loads(open(out).read().splitlines()[-1])["memory_per_rank"]
n = sum(m["grad_reduced_bytes"] for m in mem) / 4 if run == "zero2" else mem[0]["grad_bytes"] / 4
MiB = 1 << 20
ok = True
for r, m in enumerate(mem):
    state = m["param_bytes"] + m["grad_bytes"] + m["optim_state_bytes"]
    print("%-7s %-5d %10.3f %10.3f %10.3f %12.3f %10.3f %10.3f %12.0f %12.0f %8s" % (
        run, r, m["param_bytes"] / n, m["grad_bytes"] / n, m["optim_state_bytes"] / n,
        m["grad_reduced_bytes"] / n, m.get("grad_ring_bytes", 0) / n, state / n,
        m["peak_tensor_bytes"] / MiB, m["max_rss_bytes"] / MiB,
        "yes" if m["max_rss_bytes"] < 24 << 30 else "NO"))
    if run in ("zero1", "zero2", "zero3") and abs(m["optim_state_bytes"] / (8 * n / W) - 1) > 0.05:
        ok = False
        print("  rank %d: optimizer state not 1/W of the unsharded (+-5 %%)" % r)
    if run == "zero2":
        kept, ring = m["grad_reduced_bytes"], m["grad_ring_bytes"]
        if abs(kept / (4 * n / W) - 1) > 0.05 or ring <= 0 or m["grad_bytes"] != kept + ring:
            ok = False
            print("  rank %d: gradients not 1/W (+-5 %%) plus the ring" % r)
sys.exit(0 if ok else 1)
PY
done
echo "(B/p: bytes per parameter; plain Adam data parallelism: 4 + 4 + 8 = 16. reduced: the part"
echo " of the gradient buffer holding reduced gradients (the rank's range under --zero 2, the only"
echo " part of the buffer it keeps); ring: under --zero 2, the two bucket-sized slots backward"
echo " writes into (docs/sharding.md, \"Gradient memory\"); grad = reduced + ring. peak tensor: the buffers"
echo " plus the tape's activations high water; param under --zero 3: the rank's range and the two"
echo " largest modules gathered, the running one and the prefetched one (one under zero3np); peak RSS:"
echo " the process's ru_maxrss, which also holds the model built whole"
echo " before ZeRO shards it, the one-time whole optimizer, the data and the libraries)"
