#!/usr/bin/env bash
# Reproduces BENCHMARKS.md's "Collectives (ddp-bench)" comparison: float32 SUM
# allreduce between 2 local ranks, ddp-bench (the group picks shared memory)
# against PyTorch's gloo (refs/torch_allreduce.py) and Open MPI
# (refs/mpi_allreduce.c), alternated for several rounds in one go. ddp-bench
# runs twice per round: its ranks left to the scheduler (--bind none, as
# torchrun leaves them) and --bind core (one CPU each, as mpirun binds 2 ranks
# by default, and ddp-bench's default since issue 20: scripts/bench-placement.sh);
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

run_ddp() { # [--bind core]
  for s in "${sizes[@]}"; do
    local n=${iters[$s]}
    "$bench" allreduce --nproc 2 -b "$s" -e "$s" -n "$n" -w 5 -c 1 --json "$@"
  done
}
run_ddp_free() { run_ddp --bind none >>"$out/ddp.jsonl"; }
run_ddp_bound() { run_ddp --bind core >>"$out/ddp-bound.jsonl"; }
run_gloo() {
  /usr/bin/python3 "$refs/torch_allreduce.py" --world 2 --sizes "$list" \
    --port $((20000 + RANDOM % 20000)) >>"$out/gloo.txt"
}
run_mpi() {
  mpirun --allow-run-as-root --oversubscribe -np 2 "$out/mpi_allreduce" "${sizes[@]}" >>"$out/mpi.txt"
}

: >"$out/ddp.jsonl"; : >"$out/ddp-bound.jsonl"; : >"$out/gloo.txt"; : >"$out/mpi.txt"
: >"$out/load.txt"
for ((r = 1; r <= rounds; r++)); do
  # Rotate the order so that no program always runs first or last.
  order=(run_ddp_free run_gloo run_ddp_bound run_mpi)
  for ((k = 0; k < 4; k++)); do
    f=${order[$(((k + r) % 4))]}
    echo "round $r/$rounds: ${f#run_} (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    cut -d' ' -f1 /proc/loadavg >>"$out/load.txt"
    $f
  done
done

python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, re, statistics as st, sys
out = sys.argv[1]
def ddp_rows(path):
    d, eff, wrong = {}, {}, 0
    for line in open(path):
        row = json.loads(line)
        d.setdefault(row["size"], []).append((row["time_us"], row["algbw"]))
        if row.get("memeff") is not None:
            eff.setdefault(row["size"], []).append(row["memeff"])
        wrong += row["wrong"] or 0
    return d, eff, wrong
def ref(path):
    d = {}
    for line in open(path):
        m = re.search(r"bytes=(\d+) us=([\d.]+) algbw_GBps=([\d.]+)", line)
        if m:
            d.setdefault(int(m[1]), []).append((float(m[2]), float(m[3])))
    return d
free, free_eff, wrong1 = ddp_rows(f"{out}/ddp.jsonl")
bound, bound_eff, wrong2 = ddp_rows(f"{out}/ddp-bound.jsonl")
gloo, mpi = ref(f"{out}/gloo.txt"), ref(f"{out}/mpi.txt")
load = [float(x) for x in open(f"{out}/load.txt")]
def fmt(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1024 else f"{size} B"
def med(d, s):
    if s not in d: return None, None
    return st.median(x[0] for x in d[s]), st.median(x[1] for x in d[s])
def cell(d, s, eff=None):
    t, a = med(d, s)
    if t is None: return "-"
    c = (f"{t:.2f} µs" if t < 1000 else f"{t/1000:.2f} ms") + (f", {a:.2f} GB/s" if s > 8 else "")
    if eff and s in eff: c += f", {st.median(eff[s]):.0f} %"
    return c
def ratio(d, ref, s):
    t, a = med(d, s); tr, ar = med(ref, s)
    if t is None or tr is None: return "-"
    return f"{tr / t:.2f}x" if s == 8 else f"{a / ar:.2f}x"
print(f"rounds: {len(free.get(8, []))}, load average {min(load):.1f}-{max(load):.1f} "
      f"(median {st.median(load):.1f}); wrong elements: {wrong1 + wrong2}\n")
print("| size | ddp-bench --bind none | ddp-bench --bind core | Open MPI | gloo | ddp / MPI | bound ddp / MPI | ddp / gloo |")
print("|---|---|---|---|---|---|---|---|")
for s in sorted(free):
    print(f"| {fmt(s)} | {cell(free, s, free_eff)} | {cell(bound, s, bound_eff)} | {cell(mpi, s)} "
          f"| {cell(gloo, s)} | {ratio(free, mpi, s)} | {ratio(bound, mpi, s)} | {ratio(free, gloo, s)} |")
print("\n(Medians over the rounds: time, algbw, memory efficiency. Ratios: algbw, "
      "or at 8 B the other's time over ddp's; above 1 ddp is faster.)\n")
print("| target | ddp-bench --bind none | ddp-bench --bind core |")
print("|---|---|---|")
def targets(d, eff):
    res = []
    t, _ = med(d, 8)
    res.append((t <= 1.0, f"{t:.2f} µs"))
    for s in sorted(d):
        if 65536 <= s <= 64 << 20:
            a, am = med(d, s)[1], med(mpi, s)[1]
            res.append((a >= am, f"{a / am:.2f}x"))
    a, ag = med(d, 64 << 20)[1], med(gloo, 64 << 20)[1]
    res.append((a >= 3 * ag, f"{a / ag:.2f}x"))
    m = st.median(eff[64 << 20])
    res.append((m >= 60, f"{m:.0f} %"))
    return res
names = ["8 B allreduce <= 1 µs"] + [f"{fmt(s)}: algbw >= Open MPI's" for s in sorted(free)
         if 65536 <= s <= 64 << 20] + ["64 MiB: algbw >= 3x gloo's", "64 MiB: memory efficiency >= 60 %"]
for name, (ok1, v1), (ok2, v2) in zip(names, targets(free, free_eff), targets(bound, bound_eff)):
    print(f"| {name} | {'yes' if ok1 else 'NO'} ({v1}) | {'yes' if ok2 else 'NO'} ({v2}) |")
PY
echo "raw outputs in $out" >&2
