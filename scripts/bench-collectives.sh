#!/usr/bin/env bash
# Reproduces BENCHMARKS.md's "Collectives (ddp-bench)" comparison: float32 SUM
# allreduce between 2 local ranks, ddp-bench (the group picks shared memory)
# against PyTorch's gloo (refs/torch_allreduce.py) and Open MPI
# (refs/mpi_allreduce.c), the three alternated for several rounds in one go,
# then medians per size, the ratios, and the issue's targets:
#   8 B allreduce <= 1 us; 64 KiB..64 MiB algbw >= Open MPI's at every size;
#   64 MiB algbw >= 3x gloo's and memory efficiency >= 60 %.
# Usage: scripts/bench-collectives.sh [ROUNDS (5)] [BUILD_DIR (build)]
#   REFS=/path/to/refs (default ../shared/refs from the repository root)
# Needs: a Release/RelWithDebInfo build of ddp-bench, /usr/bin/python3 with
# torch (scripts/install-deps.sh test), Open MPI (scripts/install-deps.sh mpi).
# Raw outputs and the summary go to $OUT (default a new /tmp/bench-collectives.*).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
build=${2:-build}
refs=${REFS:-../shared/refs}
bench=$build/bin/ddp-bench
out=${OUT:-$(mktemp -d /tmp/bench-collectives.XXXXXX)}
mkdir -p "$out"
[ -x "$bench" ] || { echo "no $bench: cmake --build $build --target ddp-bench" >&2; exit 1; }
command -v mpicc >/dev/null || { echo "no mpicc: scripts/install-deps.sh mpi" >&2; exit 1; }
mpicc -O2 "$refs/mpi_allreduce.c" -o "$out/mpi_allreduce"

# Sizes, and ddp-bench's timed iterations per size: mpi_allreduce.c's (gloo's
# script runs min(200, 64 MiB / size), at least 3).
sizes=(8 65536 262144 1048576 4194304 16777216 67108864)
declare -A iters=([8]=2000 [65536]=2000 [262144]=200 [1048576]=200 [4194304]=10
  [16777216]=10 [67108864]=10)
list=$(IFS=,; echo "${sizes[*]}")

run_ddp() {
  for s in "${sizes[@]}"; do
    local n=${iters[$s]}
    "$bench" allreduce --nproc 2 -b "$s" -e "$s" -n "$n" -w 5 -c 1 --json
  done >>"$out/ddp.jsonl"
}
run_gloo() {
  /usr/bin/python3 "$refs/torch_allreduce.py" --world 2 --sizes "$list" \
    --port $((20000 + RANDOM % 20000)) >>"$out/gloo.txt"
}
run_mpi() {
  mpirun --allow-run-as-root --oversubscribe -np 2 "$out/mpi_allreduce" "${sizes[@]}" >>"$out/mpi.txt"
}

: >"$out/ddp.jsonl"; : >"$out/gloo.txt"; : >"$out/mpi.txt"; : >"$out/load.txt"
for ((r = 1; r <= rounds; r++)); do
  # Rotate the order so that no program always runs first or last.
  order=(run_ddp run_gloo run_mpi)
  for ((k = 0; k < 3; k++)); do
    f=${order[$(((k + r) % 3))]}
    echo "round $r/$rounds: ${f#run_} (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    cut -d' ' -f1 /proc/loadavg >>"$out/load.txt"
    $f
  done
done

python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, re, statistics as st, sys
out = sys.argv[1]
ddp, eff, wrong = {}, {}, 0
for line in open(f"{out}/ddp.jsonl"):
    row = json.loads(line)
    ddp.setdefault(row["size"], []).append((row["time_us"], row["algbw"]))
    if row.get("memeff") is not None:
        eff.setdefault(row["size"], []).append(row["memeff"])
    wrong += row["wrong"] or 0
def ref(path):
    d = {}
    for line in open(path):
        m = re.search(r"bytes=(\d+) us=([\d.]+) algbw_GBps=([\d.]+)", line)
        if m:
            d.setdefault(int(m[1]), []).append((float(m[2]), float(m[3])))
    return d
gloo, mpi = ref(f"{out}/gloo.txt"), ref(f"{out}/mpi.txt")
load = [float(x) for x in open(f"{out}/load.txt")]
med = lambda xs, k: st.median(x[k] for x in xs)
def fmt(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1024 else f"{size} B"
def cell(d, s):
    if s not in d: return "-", None, None
    t, a = med(d[s], 0), med(d[s], 1)
    return (f"{t:.2f} µs" if t < 1000 else f"{t/1000:.2f} ms") + f", {a:.3f} GB/s", t, a
print(f"rounds: {len(ddp.get(8, []))}, load average {min(load):.1f}-{max(load):.1f} "
      f"(median {st.median(load):.1f}); wrong elements: {wrong}\n")
print("| size | ddp-bench (shm) | memeff | Open MPI | gloo | ddp / MPI algbw | ddp / gloo algbw |")
print("|---|---|---|---|---|---|---|")
targets = []
for s in sorted(ddp):
    c, t, a = cell(ddp, s)
    cm, tm, am = cell(mpi, s)
    cg, tg, ag = cell(gloo, s)
    e = f"{st.median(eff[s]):.0f} %" if s in eff else "-"
    rm = f"{tm / t:.2f}x" if s == 8 and tm else (f"{a / am:.2f}x" if am else "-")
    rg = f"{tg / t:.0f}x" if s == 8 and tg else (f"{a / ag:.2f}x" if ag else "-")
    print(f"| {fmt(s)} | {c} | {e} | {cm} | {cg} | {rm} | {rg} |")
    if s == 8:
        targets.append((f"8 B allreduce <= 1 µs", t <= 1.0, f"{t:.2f} µs"))
    if 65536 <= s <= 64 << 20 and am:
        targets.append((f"{fmt(s)}: algbw >= Open MPI's", a >= am, f"{a / am:.2f}x"))
    if s == 64 << 20:
        if ag: targets.append(("64 MiB: algbw >= 3x gloo's", a >= 3 * ag, f"{a / ag:.2f}x"))
        if s in eff:
            m = st.median(eff[s])
            targets.append(("64 MiB: memory efficiency >= 60 %", m >= 60, f"{m:.0f} %"))
print("\n(8 B: the ratios are time ratios, the other's time over ddp's; other sizes: "
      "algbw ratios. Medians over the rounds.)\n")
print("| target | met | measured |")
print("|---|---|---|")
for name, ok, what in targets:
    print(f"| {name} | {'yes' if ok else 'NO'} | {what} |")
PY
echo "raw outputs in $out" >&2
