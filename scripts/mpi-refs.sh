#!/usr/bin/env bash
# Builds Open MPI's own allreduce programs that the MPI backend is compared
# with (issue 38), from ../shared/refs/mpi_allreduce.c, into DIR:
#   mpi_allreduce        the reference unchanged: MPI_Init (MPI_THREAD_SINGLE),
#                        out of place (MPI_Allreduce(in, out)), rank 0's time;
#   mpi_allreduce_like   like with like for ddp_allreduce: in place
#                        (MPI_IN_PLACE on one buffer, filled before the
#                        warm-up, as ddp-bench's), MPI_Init_thread asking
#                        MPI_THREAD_MULTIPLE (what ddp's MPI runs at), the
#                        slowest rank's time (what ddp-bench reports); the
#                        result checked on a fresh in-place call;
#   mpi_iallreduce_like  the same with MPI_Iallreduce + MPI_Wait.
# Why each change (callgrind, scripts/profile-mpi.sh; BENCHMARKS.md "MPI
# backend"): out of place, Open MPI copies the send buffer into the receive
# buffer first (opal_datatype_copy_content_same_ddt, one full copy a call);
# MPI_THREAD_MULTIPLE makes Open MPI take its internal locks, which the
# unchanged reference's MPI_THREAD_SINGLE skips.
# Two more changes to the like-with-like references, for the measurement
# only (neither makes the reference's call slower; ddp's side gets the same
# through scripts/bench-mpi.sh):
#   - at most SMALL_BYTES (8) per rank, SMALL_ITERS calls (default 100000)
#     instead of the reference's 2000: 2000 calls of 0.25 us are a 0.5 ms
#     window, where one tick of the kernel's is 1-4 %;
#   - us=%.3f instead of %.2f: at 0.24 us a call, %.2f quantizes by 2-4 %.
# Usage: scripts/mpi-refs.sh DIR [REFS (../shared/refs)]; prints nothing on
# success, exits 1 saying what failed. SMALL_ITERS and SMALL_BYTES as said.
set -euo pipefail
dir=${1:?usage: mpi-refs.sh DIR [REFS]}
refs=${2:-${REFS:-$(cd "$(dirname "$0")/.." && pwd)/../shared/refs}}
src=$refs/mpi_allreduce.c
[ -f "$src" ] || { echo "mpi-refs: no $src (set REFS)" >&2; exit 1; }
command -v mpicc >/dev/null || { echo "mpi-refs: no mpicc: scripts/install-deps.sh mpi" >&2; exit 1; }
mkdir -p "$dir"
mpicc -O2 -g "$src" -o "$dir/mpi_allreduce"
sed -e 's/MPI_Init(&argc, &argv);/int provided_; MPI_Init_thread(\&argc, \&argv, MPI_THREAD_MULTIPLE, \&provided_);/' \
    -e 's/MPI_Allreduce(in, out,/MPI_Allreduce(MPI_IN_PLACE, out,/' \
    -e 's/in\[i\] = 1\.0f;/in[i] = out[i] = 1.0f;/' \
    -e 's|t = (MPI_Wtime() - t) / iters;|&\n        MPI_Allreduce(MPI_IN_PLACE, \&t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);|' \
    -e 's/if (n && out\[n - 1\] != (float)world)/for (long i = 0; i < n; i++) out[i] = 1.0f;\n        MPI_Allreduce(MPI_IN_PLACE, out, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);\n        &/' \
    -e "s/int iters = bytes <= 65536 ? 2000/int iters = bytes <= ${SMALL_BYTES:-8} ? ${SMALL_ITERS:-100000} : bytes <= 65536 ? 2000/" \
    -e 's/us=%\.2f/us=%.3f/' \
    "$src" >"$dir/mpi_allreduce_like.c"
for want in "bytes <= ${SMALL_BYTES:-8} ? ${SMALL_ITERS:-100000} :" 'us=%\.3f' MPI_THREAD_MULTIPLE 'MPI_Allreduce(MPI_IN_PLACE, out' 'in\[i\] = out\[i\]' MPI_MAX 'out\[i\] = 1.0f;$'; do
  grep -q "$want" "$dir/mpi_allreduce_like.c" ||
    { echo "mpi-refs: could not derive the like-with-like reference ($want) from $src" >&2; exit 1; }
done
grep -q 'MPI_Allreduce(in, out' "$dir/mpi_allreduce_like.c" &&
  { echo "mpi-refs: an out-of-place call is left in the like-with-like reference" >&2; exit 1; }
# Nonblocking: the warm-up, timed and checking calls (not the time's MAX).
sed 's/MPI_Allreduce(\(MPI_IN_PLACE, out, [^;]*\));\( *\)$/{ MPI_Request q_; MPI_Iallreduce(\1, \&q_); MPI_Wait(\&q_, MPI_STATUS_IGNORE); }\2/' \
  "$dir/mpi_allreduce_like.c" >"$dir/mpi_iallreduce_like.c"
[ "$(grep -c MPI_Iallreduce "$dir/mpi_iallreduce_like.c")" -ge 2 ] ||
  { echo "mpi-refs: could not derive the nonblocking reference from $src" >&2; exit 1; }
mpicc -O2 -g "$dir/mpi_allreduce_like.c" -o "$dir/mpi_allreduce_like"
mpicc -O2 -g "$dir/mpi_iallreduce_like.c" -o "$dir/mpi_iallreduce_like"
