#!/usr/bin/env bash
# The MPI backend's allreduce against Open MPI's own (issue 38): float32 SUM,
# world 2 on this host, 8 B to 64 MiB, like with like, alternated for
# several rounds in one go, medians per size and the ratios (bar: >= 0.95x).
# The references are ../shared/refs/mpi_allreduce.c made like ddp's call by
# scripts/mpi-refs.sh: in place (MPI_IN_PLACE, as ddp_allreduce is; out of
# place Open MPI first copies the whole send buffer into the receive one),
# at MPI_THREAD_MULTIPLE (what ddp's MPI runs at; the unchanged reference
# runs at MPI_THREAD_SINGLE, where Open MPI skips its locks), the slowest
# rank's time (as ddp-bench reports):
#   ddp blocking   `mpirun -np 2 ddp-bench allreduce --backend mpi`, the
#                  default (DDP_MPI_BLOCKING_BYTES=-1: every blocking call
#                  MPI's blocking collective) against MPI_Allreduce;
#   ddp 64 KiB     DDP_MPI_BLOCKING_BYTES=65536 (blocking up to 64 KiB per
#                  rank, nonblocking with the caller spinning on MPI_Test
#                  above) against the same MPI_Allreduce;
#   ddp nonblock   DDP_MPI_BLOCKING_BYTES=0 (MPI_Iallreduce + MPI_Test
#                  polling) against MPI_Iallreduce + MPI_Wait.
# The unchanged reference (out of place, MPI_THREAD_SINGLE) runs too, and
# ddp blocking's ratio to it is printed apart, for information: it is not
# like with like.
# Alike on both sides (issue 38's last look at 8 B): at most SMALL_BYTES
# (8) per rank, SMALL_ITERS calls (default 100000, for ddp-bench's -n and
# the like references, scripts/mpi-refs.sh) instead of 2000, a 0.5 ms
# window at 0.25 us a call; the like references print us=%.3f (%.2f
# quantized 0.24 us by 4 %). At 8 B this VM is in one of two states for a
# whole launch (about 0.24 or 0.5 us a call): the rounds alternate the
# programs, so compare a round's state with its own. For ddp's cost on
# its own, independent of the state, run the same-process A/B:
#   mpirun --allow-run-as-root -np 2 build/bin/bench_mpi_allreduce -b 8
# (docs/comm.md, MPI, "Speed").
# Usage: scripts/bench-mpi.sh [ROUNDS (5)] [BUILD_DIR (build)]
#   REFS=/path/to/refs (default ../shared/refs); SIZES="8 65536" (bytes;
#   default 8 B to 64 MiB); MPIRUN_ARGS (extra mpirun
#   options, e.g. "--bind-to core"). Run it on a quiet machine: the ratios of
#   one go are what it reports; absolute times drift. A round takes about
#   1 minute on an idle 2-core VM (5 rounds: 5 minutes).
# Raw outputs and the summary go to $OUT (default a new /tmp/bench-mpi.*).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
build=${2:-build}
refs=${REFS:-../shared/refs}
bench=$build/bin/ddp-bench
out=${OUT:-$(mktemp -d /tmp/bench-mpi.XXXXXX)}
mkdir -p "$out"
[ -x "$bench" ] || { echo "no $bench: cmake --build $build --target ddp-bench" >&2; exit 1; }
export SMALL_BYTES=${SMALL_BYTES:-8} SMALL_ITERS=${SMALL_ITERS:-100000}
scripts/mpi-refs.sh "$out" "$refs"

sizes=(${SIZES:-8 1024 65536 1048576 4194304 16777216 67108864})
# mpi_allreduce.c's iterations per size (the like references' at SMALL_BYTES).
iters() { if [ "$1" -le "$SMALL_BYTES" ]; then echo "$SMALL_ITERS"; elif [ "$1" -le 65536 ]; then echo 2000; elif [ "$1" -le 1048576 ]; then echo 200; else echo 10; fi; }
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 ${MPIRUN_ARGS:-})

run_ddp() { # DDP_MPI_BLOCKING_BYTES value, output file
  for s in "${sizes[@]}"; do
    DDP_MPI_BLOCKING_BYTES=$1 "${mpi[@]}" -x DDP_MPI_BLOCKING_BYTES "$bench" allreduce --backend mpi \
      -b "$s" -e "$s" -n "$(iters "$s")" -w 5 --json >>"$out/$2"
  done
}
run_ddp_blocking() { run_ddp -1 ddp-blocking.jsonl; }
run_ddp_64k() { run_ddp 65536 ddp-64k.jsonl; }
run_ddp_nonblock() { run_ddp 0 ddp-nonblock.jsonl; }
run_mpi_blocking() { "${mpi[@]}" "$out/mpi_allreduce_like" "${sizes[@]}" >>"$out/mpi-blocking.txt"; }
run_mpi_nonblock() { "${mpi[@]}" "$out/mpi_iallreduce_like" "${sizes[@]}" >>"$out/mpi-nonblock.txt"; }
run_mpi_unchanged() { "${mpi[@]}" "$out/mpi_allreduce" "${sizes[@]}" >>"$out/mpi-unchanged.txt"; }

order=(run_ddp_blocking run_mpi_blocking run_ddp_64k run_ddp_nonblock run_mpi_nonblock run_mpi_unchanged)
: >"$out/ddp-blocking.jsonl"; : >"$out/ddp-64k.jsonl"; : >"$out/ddp-nonblock.jsonl"
: >"$out/mpi-blocking.txt"; : >"$out/mpi-nonblock.txt"; : >"$out/mpi-unchanged.txt"
: >"$out/load.txt"
for ((r = 1; r <= rounds; r++)); do
  for ((k = 0; k < ${#order[@]}; k++)); do
    f=${order[$(((k + r) % ${#order[@]}))]}
    echo "round $r/$rounds: ${f#run_} (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    cut -d' ' -f1 /proc/loadavg >>"$out/load.txt"
    $f
  done
done

python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, re, statistics as st, sys
out = sys.argv[1]
def ddp(name):
    d = {}
    for line in open(f"{out}/{name}.jsonl"):
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            assert not row.get("wrong"), row
            d.setdefault(row["size"], []).append((row["time_us"], row["algbw"]))
    return d
def ref(name):
    d = {}
    for line in open(f"{out}/{name}.txt"):
        m = re.search(r"bytes=(\d+) us=([\d.]+) algbw_GBps=([\d.]+)", line)
        if m:
            d.setdefault(int(m[1]), []).append((float(m[2]), float(m[3])))
    return d
def med(d, s):
    return (st.median(x[0] for x in d[s]), st.median(x[1] for x in d[s])) if s in d else (None, None)
def fmt(s):
    return f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB" if s >= 1024 else f"{s} B"
def cell(d, s):
    t, a = med(d, s)
    return "-" if t is None else (f"{t:.3f} µs" if t < 1 else f"{t:.2f} µs" if t < 1000 else f"{t/1000:.2f} ms") + (f", {a:.2f} GB/s" if s > 8 else "")
def ratio(d, r, s):
    t, a = med(d, s); tr, ar = med(r, s)
    if t is None or tr is None: return "-", False
    x = tr / t if s == 8 else a / ar
    return f"{x:.2f}x", x >= 0.95
like = " (in place, MPI_THREAD_MULTIPLE)"
pairs = [("ddp blocking (the default, DDP_MPI_BLOCKING_BYTES=-1)", ddp("ddp-blocking"), "MPI_Allreduce" + like, ref("mpi-blocking")),
         ("ddp blocking up to 64 KiB (DDP_MPI_BLOCKING_BYTES=65536)", ddp("ddp-64k"), "MPI_Allreduce" + like, ref("mpi-blocking")),
         ("ddp nonblocking (DDP_MPI_BLOCKING_BYTES=0)", ddp("ddp-nonblock"), "MPI_Iallreduce + MPI_Wait" + like, ref("mpi-nonblock")),
         ("for information, not like with like: ddp blocking (the default)", ddp("ddp-blocking"),
          "the unchanged reference (out of place, MPI_THREAD_SINGLE)", ref("mpi-unchanged"))]
load = [float(x) for x in open(f"{out}/load.txt")]
print(f"load average {min(load):.1f}-{max(load):.1f} (median {st.median(load):.1f})\n")
for name, d, rname, r in pairs:
    print(f"### {name} against {rname}\n")
    print(f"| size | ddp | {rname} | ratio (>= 0.95x) |\n|---|---|---|---|")
    for s in sorted(d):
        x, ok = ratio(d, r, s)
        print(f"| {fmt(s)} | {cell(d, s)} | {cell(r, s)} | {x} {'yes' if ok else 'NO'} |")
    print()
print("(Medians over the rounds. Ratio: algbw, or at 8 B the reference's time over ddp's; above 1 ddp is faster.)")
PY
echo "raw outputs in $out" >&2
