#!/usr/bin/env bash
# What the MPI backend adds to Open MPI's allreduce, counted, not timed
# (issue 38): valgrind's callgrind on world 2 under mpirun, so the figures
# hold on a loaded machine. Prints, per allreduce, from both ranks:
#   - ddp's own instructions on a blocking 8-byte float32 allreduce:
#     ddp_allreduce's inclusive cost less the MPI_Allreduce it calls (the
#     group layer's checks, numbering, flight recorder, the backend's
#     bookkeeping), and the same at DDP_MPI_BLOCKING_BYTES=0 (nonblocking:
#     MPI_Iallreduce, then MPI_Test polling; there the polls' own cost in
#     MPI is counted apart);
#   - Open MPI's mutex locks per call at MPI_THREAD_SINGLE (the unchanged
#     reference's level) and MPI_THREAD_MULTIPLE (ddp's): the difference of
#     two runs (8 B once and twice, 2005 calls each) so that start and end
#     do not count;
#   - at 4 MiB: the bytes Open MPI copies per call out of place (the
#     unchanged reference) and in place (ddp_allreduce, the like-with-like
#     reference): calls of opal_datatype_copy_content_same_ddt, memcpy's
#     instructions.
# Usage: scripts/profile-mpi.sh [BUILD_DIR (build-portable)]
#   Valgrind cannot run AVX-512: the build must be made without
#   -march=native (scripts/build.sh portable, or cmake --build
#   build-portable --target ddp-bench) and runs with
#   DDP_CPU_KERNELS=generic. REFS as scripts/mpi-refs.sh. Takes 5-10 minutes
#   (eight callgrind runs of two ranks). Profiles and the summary in $OUT
#   (default a new /tmp/profile-mpi.*).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-portable}
bench=$build/bin/ddp-bench
out=${OUT:-$(mktemp -d /tmp/profile-mpi.XXXXXX)}
mkdir -p "$out"
command -v valgrind >/dev/null || { echo "profile-mpi: no valgrind (apt-get install valgrind)" >&2; exit 1; }
[ -x "$bench" ] || { echo "profile-mpi: no $bench: scripts/build.sh portable" >&2; exit 1; }
if ! grep -q 'DDP_NATIVE:BOOL=OFF' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "profile-mpi: $build is not a -DDDP_NATIVE=OFF build; valgrind cannot run -march=native's AVX-512: use scripts/build.sh portable" >&2
  exit 1
fi
scripts/mpi-refs.sh "$out" "${REFS:-../shared/refs}"
. tests/support/mpi_env.sh # ranks yield while they wait: less polling to count
export DDP_CPU_KERNELS=generic
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 -x DDP_CPU_KERNELS -x DDP_MPI_BLOCKING_BYTES)
cg() { # NAME PROGRAM ARGS...: callgrind on both ranks -> $out/NAME.<pid>
  local name=$1
  shift
  echo "profile-mpi: $name" >&2
  "${mpi[@]}" valgrind --tool=callgrind --callgrind-out-file="$out/$name.%p" "$@" >"$out/$name.log" 2>&1 ||
    { tail -20 "$out/$name.log" >&2; echo "profile-mpi: $name failed" >&2; exit 1; }
}
export DDP_MPI_BLOCKING_BYTES=-1
cg ddp-blocking "$bench" allreduce --backend mpi -b 8 -e 8 -n 2000 -w 5 -c 0
export DDP_MPI_BLOCKING_BYTES=0
cg ddp-nonblock "$bench" allreduce --backend mpi -b 8 -e 8 -n 2000 -w 5 -c 0
export DDP_MPI_BLOCKING_BYTES=-1
cg single-1 "$out/mpi_allreduce" 8
cg single-2 "$out/mpi_allreduce" 8 8
cg multiple-1 "$out/mpi_allreduce_like" 8
cg multiple-2 "$out/mpi_allreduce_like" 8 8
cg copy-out "$out/mpi_allreduce" 4194304
cg copy-in "$out/mpi_allreduce_like" 4194304

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import collections, glob, re, sys
out = sys.argv[1]

def load(path):
    """Self cost per function, and per call edge (caller, callee): inclusive cost and calls."""
    names, self_cost = {}, collections.Counter()
    edge, edge_calls, calls = collections.Counter(), collections.Counter(), collections.Counter()
    fn = cfn = None
    pending = None
    def name(rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        if m.group(2) is not None:
            names[m.group(1)] = m.group(2)
        return names[m.group(1)]
    for line in open(path):
        if line.startswith("fn="):
            fn = name(line[3:].rstrip("\n"))
        elif line.startswith("cfn="):
            cfn = name(line[4:].rstrip("\n"))
        elif line.startswith("calls="):
            pending = (cfn, int(line[6:].split()[0]))
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            cost = int(parts[1]) if len(parts) > 1 else 0
            if pending:
                edge[(fn, pending[0])] += cost
                edge_calls[(fn, pending[0])] += pending[1]
                calls[pending[0]] += pending[1]
                pending = None
            else:
                self_cost[fn] += cost
    return self_cost, edge, edge_calls, calls

def ranks(name):
    files = sorted(glob.glob(f"{out}/{name}.[0-9]*"))
    assert len(files) == 2, (name, files)
    return [load(f) for f in files]

def locks(calls):
    return sum(v for k, v in calls.items() if k.startswith("pthread_mutex_lock"))

print("Per 8-byte float32 allreduce, world 2, ranks 0 and 1 (callgrind instruction counts)\n")
for name, what, mpi_fn in (("ddp-blocking", "blocking (default)", "PMPI_Allreduce"),
                           ("ddp-nonblock", "nonblocking (DDP_MPI_BLOCKING_BYTES=0)", None)):
    row = []
    for self_cost, edge, edge_calls, calls in ranks(name):
        # Every ddp_allreduce of the run (ddp-bench's timed ones, and its
        # few of its own: the time's MAX), and what they spend in MPI: the
        # backend's calls of the collective and its MPI_Test polls.
        incl = sum(v for (a, b), v in edge.items() if b == "ddp_allreduce" and a != "ddp_allreduce")
        n = sum(v for (a, b), v in edge_calls.items() if b == "ddp_allreduce" and a != "ddp_allreduce")
        backend = ("mpi_enqueue", "blocking_allreduce", "mpi_allreduce_direct", "mpi_test", "mpi_wait")
        into_mpi = sum(v for (a, b), v in edge.items()
                       if a in backend and b in ("PMPI_Allreduce", "PMPI_Iallreduce", "PMPI_Test"))
        polls = sum(v for (a, b), v in edge_calls.items() if a in backend and b == "PMPI_Test")
        row.append((n, (incl - into_mpi) / max(n, 1), polls / max(n, 1)))
    print(f"ddp {what}: {row[0][0]} calls; ddp's own instructions per call: "
          f"{row[0][1]:.0f} and {row[1][1]:.0f}" + (f"; MPI_Test polls per call: {row[0][2]:.0f} and {row[1][2]:.0f}" if row[0][2] else ""))

per = []
for level in ("single", "multiple"):
    one, two = ranks(f"{level}-1"), ranks(f"{level}-2")
    per.append([(locks(b[3]) - locks(a[3])) / (b[3]["PMPI_Allreduce"] - a[3]["PMPI_Allreduce"]) for a, b in zip(one, two)])
print(f"Open MPI's mutex locks per MPI_Allreduce: MPI_THREAD_SINGLE {per[0][0]:.1f} and {per[0][1]:.1f}, "
      f"MPI_THREAD_MULTIPLE {per[1][0]:.1f} and {per[1][1]:.1f}")

print("\nPer 4 MiB allreduce (Open MPI's MPI_Allreduce alone):")
for name, what in (("copy-out", "out of place (the unchanged reference)"), ("copy-in", "in place (ddp_allreduce; the like-with-like reference)")):
    row = []
    for self_cost, edge, edge_calls, calls in ranks(name):
        n = calls["PMPI_Allreduce"]
        copies = calls.get("opal_datatype_copy_content_same_ddt", 0)
        mem = sum(v for (a, b), v in edge.items() if "memcpy" in b or "memmove" in b)
        row.append((copies / n, mem / n))
    print(f"  {what}: whole-buffer copies (opal_datatype_copy_content_same_ddt) per call {row[0][0]:.2f} and "
          f"{row[1][0]:.2f}; memcpy instructions per call {row[0][1]:,.0f} and {row[1][1]:,.0f}")
PY
echo "profiles in $out" >&2
