#!/usr/bin/env bash
# Across hosts (issue 38, "Hierarchy"): 2 nodes x 2 ranks on the private
# Slurm of scripts/slurm-cluster.sh (each node a network namespace of this
# machine, so bytes between nodes cross a veth pair, not shared memory),
# float32 SUM allreduce from 1 MiB, alternated for ROUNDS rounds, medians:
#   mpihier srun --mpi=pmix ddp-bench allreduce --backend mpi (the default
#           across hosts: ddp's shared memory inside a node, MPI between the
#           nodes' leaders, src/comm/mpi/leaders.c; DDP_MPI_HIER_BYTES=0 so
#           every size composes whatever the default threshold);
#   mpidef  the same as shipped: DDP_MPI_HIER_BYTES unset, so a size below
#           the default threshold runs flat on MPI and one at or above it
#           composes (below the threshold it must cost what `mpi` costs);
#   mpi     the same with DDP_MPI_HIER=0 (pure MPI: ddp over Open MPI's own
#           composition, shared memory inside a node, TCP between them);
#   hier    srun ddp-bench allreduce (ddp's backend: its hierarchical
#           composition, shared memory inside a node, TCP between the
#           nodes' leaders);
#   ref     srun --mpi=pmix Open MPI's own allreduce made like ddp's call
#           (scripts/mpi-refs.sh: in place, MPI_THREAD_MULTIPLE).
# Prints each side's algbw and the ratios mpihier / mpi (the hierarchy
# against pure MPI: what docs/comm.md's rule, DDP_MPI_HIER_BYTES, rests on:
# the threshold is the smallest size from which this stays above 1),
# mpidef / mpi (the rule as shipped against pure MPI: about 1 below the
# threshold, mpihier / mpi from it),
# mpihier / hier (MPI against ddp's TCP between the leaders) and mpi / ref.
# Needs root, Slurm with its pmix plugin, and network namespaces
# (scripts/slurm-cluster.sh says which is missing).
# Usage: scripts/bench-mpi-hosts.sh [ROUNDS (5)] [BUILD_DIR (build)]
#   SIZES (default "1M 4M 16M 64M"; smaller ones too to place the
#   threshold, e.g. SIZES="64K 256K 1M 4M"). A round takes about a minute
#   and a half on an idle 2-core VM. Raw outputs and the summary in $OUT (default a new
#   /tmp/bench-mpi-hosts.*).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
build=${2:-build}
bench=$PWD/$build/bin/ddp-bench
out=${OUT:-$(mktemp -d /tmp/bench-mpi-hosts.XXXXXX)}
mkdir -p "$out"
[ -x "$bench" ] || { echo "bench-mpi-hosts: build first (cmake --build $build --target ddp-bench)" >&2; exit 1; }
scripts/mpi-refs.sh "$out" "${REFS:-../shared/refs}"
sizes=(${SIZES:-1M 4M 16M 64M})
bytes() { numfmt --from=iec "$1"; }
cluster=$(scripts/slurm-cluster.sh up --owner $$ --nodes 2 "$out/cluster") || exit $?
trap 'scripts/slurm-cluster.sh down "$cluster" >/dev/null 2>&1' EXIT
# --kill-on-bad-exit: a task that fails (a port another process holds, a
# crash) ends the step at once; without it its peers wait out their
# rendezvous and collective timeouts before the round can go on.
run() { scripts/slurm-cluster.sh run "$cluster" timeout 600 srun --immediate=30 --time=10 --kill-on-bad-exit=1 -N 2 -n 4 --ntasks-per-node=2 "$@"; }
# Open MPI names its shared-memory segments after the host name, which the
# two nodes share: each node's in its own TmpFS. And its waits yield: 4
# ranks on a machine of fewer cores are oversubscribed, which Open MPI would
# see itself but for the 16 CPUs the test cluster claims per node (ddp's
# backend yields by itself; without this Open MPI ran 10-20x slower on the
# loaded 2-core VM, its spinning ranks starving the ones with work).
vader='export OMPI_MCA_btl_vader_backing_directory='"$cluster"'/tmp/$SLURMD_NODENAME'
vader+=' OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}; exec "$0" "$@"'
iters() { if [ "$1" -le 1048576 ]; then echo 50; elif [ "$1" -le 16777216 ]; then echo 10; else echo 5; fi; }
run_mpi() {
  for s in "${sizes[@]}"; do
    run --mpi=pmix env DDP_MPI_HIER=0 bash -c "$vader" "$bench" allreduce --backend mpi -b "$s" -e "$s" \
      -n "$(iters "$(bytes "$s")")" -w 2 --json >>"$out/mpi.jsonl"
  done
}
# The hierarchy over MPI: every size composed (the threshold is what this
# measures); pure MPI: the composition off.
run_mpihier() {
  for s in "${sizes[@]}"; do
    run --mpi=pmix env DDP_MPI_HIER_BYTES=0 bash -c "$vader" "$bench" allreduce --backend mpi -b "$s" -e "$s" \
      -n "$(iters "$(bytes "$s")")" -w 2 --json >>"$out/mpihier.jsonl"
  done
}
# The rule as shipped (the default threshold).
run_mpidef() {
  for s in "${sizes[@]}"; do
    run --mpi=pmix bash -c "$vader" "$bench" allreduce --backend mpi -b "$s" -e "$s" \
      -n "$(iters "$(bytes "$s")")" -w 2 --json >>"$out/mpidef.jsonl"
  done
}
run_hier() {
  for s in "${sizes[@]}"; do
    run "$bench" allreduce -b "$s" -e "$s" -n "$(iters "$(bytes "$s")")" -w 2 --json >>"$out/hier.jsonl"
  done
}
run_ref() {
  local b=()
  for s in "${sizes[@]}"; do b+=("$(bytes "$s")"); done
  run --mpi=pmix bash -c "$vader" "$out/mpi_allreduce_like" "${b[@]}" >>"$out/ref.txt"
}
: >"$out/mpi.jsonl"; : >"$out/mpihier.jsonl"; : >"$out/mpidef.jsonl"; : >"$out/hier.jsonl"; : >"$out/ref.txt"
order=(run_mpihier run_mpi run_mpidef run_hier run_ref)
for ((r = 1; r <= rounds; r++)); do
  for ((k = 0; k < ${#order[@]}; k++)); do
    f=${order[$(((k + r) % ${#order[@]}))]}
    echo "round $r/$rounds: ${f#run_} (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    $f
  done
done

python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, re, statistics as st, sys
out = sys.argv[1]
def ddp(name):
    d = {}
    for line in open(f"{out}/{name}.jsonl"):
        if line.startswith("{"):
            row = json.loads(line)
            assert not row.get("wrong"), row
            d.setdefault(row["size"], []).append(row["algbw"])
    return d
ref = {}
for line in open(f"{out}/ref.txt"):
    m = re.search(r"bytes=(\d+) us=[\d.]+ algbw_GBps=([\d.]+)", line)
    if m:
        ref.setdefault(int(m[1]), []).append(float(m[2]))
mpi, mpihier, mpidef, hier = ddp("mpi"), ddp("mpihier"), ddp("mpidef"), ddp("hier")
med = lambda d, s: st.median(d[s]) if s in d else float("nan")
def size(s):
    return f"{s >> 20} MiB" if s >= 1 << 20 else f"{s >> 10} KiB"
print("2 nodes x 2 ranks (network namespaces of one machine), float32 SUM allreduce, algbw GB/s, medians\n")
print("| size | mpihier (ddp: shm + MPI between leaders, every size) | mpi (ddp over Open MPI, flat) "
      "| mpidef (the default rule) | hier (ddp: shm + TCP) | Open MPI's own | mpihier / mpi | mpidef / mpi "
      "| mpihier / hier | mpi / own |\n|---|---|---|---|---|---|---|---|---|---|")
for s in sorted(mpi):
    x, m, d, h, o = med(mpihier, s), med(mpi, s), med(mpidef, s), med(hier, s), med(ref, s)
    print(f"| {size(s)} | {x:.3f} | {m:.3f} | {d:.3f} | {h:.3f} | {o:.3f} | {x / m:.2f}x | {d / m:.2f}x "
          f"| {x / h:.2f}x | {m / o:.2f}x |")
PY
echo "raw outputs in $out" >&2
