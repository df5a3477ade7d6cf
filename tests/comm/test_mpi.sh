#!/usr/bin/env bash
# The MPI backend under mpirun (docs/comm.md, "MPI backend"): the collective
# matrix, point-to-point ordering, subgroups and a group from the program's
# own MPI_Comm at 2 and 4 ranks; DDP_DEBUG=detail naming a mismatch; a
# stalled peer ending the job by the timeout; backend "mpi" outside an MPI launch failing
# at once; a rank SIGKILLed ending the job with the rank named, never a
# hang; and (mode hier, not in the default list: test_mpi_hier) 4 ranks on
# 2 faked hosts composing shared memory with MPI between the leaders.
# Usage: test_mpi.sh PATH/TO/test_mpi_ranks [MODE...]
# Exits 77 (skipped) with the reason when mpirun or the MPI build is absent.
set -u
bin=${1:?usage: test_mpi.sh PATH/TO/test_mpi_ranks}
shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(outside matrix direct exclusion lane smallmismatch p2p subgroups usercomm arrival mismatch stall kill)
command -v mpirun >/dev/null || { echo "SKIP: mpirun not found (scripts/install-deps.sh mpi)"; exit 77; }
[ -x "$bin" ] || { echo "SKIP: $bin absent: this build has no MPI backend"; exit 77; }
. "$(dirname "$0")/../support/mpi_env.sh"
limit=${DDP_TEST_MPI_TIMEOUT:-240}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
failed=0

run_mpi() { # np mode
  timeout -k 10 $((limit + 20)) mpirun --allow-run-as-root --oversubscribe --timeout "$limit" \
    -np "$1" "$bin" "$2" >"$out" 2>&1
}

for mode in "${modes[@]}"; do
  case $mode in
  outside)
    # No launcher's variables: fails at once naming mpirun.
    start=$(date +%s)
    if env -u OMPI_COMM_WORLD_SIZE -u PMIX_RANK -u PMI_RANK -u PMI_SIZE -u RANK \
        timeout 30 "$bin" outside >"$out" 2>&1 && [ $(($(date +%s) - start)) -le 10 ]; then
      echo "ok: outside an MPI launch: $(head -1 "$out")"
    else
      echo "FAIL: outside an MPI launch"; cat "$out"; failed=1
    fi ;;
  smallmismatch)
    # Counts that differ between ranks on the small path: both ranks fail
    # naming the counts, never a wrong sum.
    if run_mpi 2 smallmismatch && [ "$(grep -c "every rank must pass the same count" "$out")" -eq 2 ]; then
      echo "ok: mismatched counts on the small path failed on both ranks: $(grep -m1 'same count' "$out")"
    else
      echo "FAIL: smallmismatch"; cat "$out"; failed=1
    fi ;;
  mismatch)
    # DDP_DEBUG=detail's fingerprints through the store MPI's rank 0 serves.
    if DDP_DEBUG=detail run_mpi 2 mismatch && [ "$(grep -c "mismatch" "$out")" -ge 2 ]; then
      echo "ok: DDP_DEBUG=detail named a mismatched allreduce on both ranks: $(grep -m1 mismatch "$out")"
    else
      echo "FAIL: DDP_DEBUG=detail mismatch"; cat "$out"; failed=1
    fi ;;
  arrival)
    # A rank first at a large blocking allreduce sleeps while it waits for
    # late peers (the arrival barrier, opt-in: DDP_MPI_ARRIVAL_BYTES set
    # to 64 KiB here), at 2 ranks; the sum is checked.
    # Open MPI's waits spin without yielding here, so that a wait in MPI's
    # blocking call (no barrier) uses its core's CPU even on a loaded host,
    # where yielding hands the core to the other programs.
    if (export OMPI_MCA_mpi_yield_when_idle=0 DDP_MPI_ARRIVAL_BYTES=65536; run_mpi 2 arrival); then
      echo "ok: arrival barrier: $(grep -m1 'rank 0 waited' "$out")"
    else
      echo "FAIL: arrival barrier"; cat "$out"; failed=1
    fi ;;
  stall)
    # Rank 1 sleeps 30 s; the op's 3 s timeout ends the job naming it, well
    # before the sleep ends: by the watchdog (blocking call), the wait
    # (DDP_MPI_BLOCKING_BYTES=0), or the arrival barrier's wait
    # (DDP_MPI_ARRIVAL_BYTES=0: every blocking collective waits there first).
    for setting in default DDP_MPI_BLOCKING_BYTES=0 DDP_MPI_ARRIVAL_BYTES=0; do
      start=$(date +%s)
      ( [ "$setting" = default ] || export "${setting?}"; run_mpi 2 stall ); rc=$?
      took=$(($(date +%s) - start))
      if [ $rc -ne 0 ] && [ $took -lt 25 ] && grep -q "allreduce #2 (rank 0 of 2).*did not complete in time" "$out"; then
        echo "ok: a stalled peer ended the job in ${took}s ($setting): $(grep -o 'allreduce #2 (rank 0 of 2)[^;]*' "$out" | head -1)"
      else
        echo "FAIL: stalled peer, $setting (exit $rc after ${took}s)"; cat "$out"; failed=1
      fi
    done ;;
  kill)
    start=$(date +%s)
    run_mpi 3 kill; rc=$?
    took=$(($(date +%s) - start)) # mpirun itself exits 137 (the rank's SIGKILL); a timeout shows as took >= limit
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -Eq "rank 1\b.*(signal 9|Killed)|process rank 1 " "$out" \
        && [ $took -lt "$limit" ]; then
      echo "ok: SIGKILL of rank 1 ended the job in ${took}s (exit $rc): $(grep -E 'rank 1' "$out" | head -1)"
    else
      echo "FAIL: SIGKILL of rank 1 (exit $rc after ${took}s)"; cat "$out"; failed=1
    fi ;;
  hier)
    # 4 ranks on 2 faked hosts (DDP_HOST_ID per rank, from its MPI rank):
    # shared memory inside each, MPI between their leaders. Each layout
    # with every collective composed (DDP_MPI_HIER_BYTES=0); the default
    # split (small ops flat, large composed: test_mpi_ranks checks which
    # path a 64 KiB and a threshold-sized allreduce took, and mixes them
    # async); the leaders' ops nonblocking
    # (DDP_MPI_BLOCKING_BYTES=0); and DDP_MPI_HIER=0 (flat MPI) by its
    # transports only.
    for spec in "block 0 default auto full" "interleaved 0 default auto full" "uneven 0 default auto full" \
                "block default default auto full" "interleaved 0 0 auto full" "block default default 0 quick"; do
      read -r layout hb bb hier kind <<<"$spec"
      hosts='case $DDP_TEST_LAYOUT in interleaved) h=$((OMPI_COMM_WORLD_RANK % 2));;
        uneven) h=$((OMPI_COMM_WORLD_RANK < 3 ? 0 : 1));; *) h=$((OMPI_COMM_WORLD_RANK / 2));; esac
        export DDP_HOST_ID=ddp-test-mpi-host-$h; exec "$0" "$@"'
      envs=(DDP_TEST_LAYOUT="$layout" DDP_MPI_HIER="$hier" DDP_TEST_QUICK=$([ "$kind" = quick ] && echo 1 || echo 0))
      [ "$hb" = default ] || envs+=(DDP_MPI_HIER_BYTES="$hb")
      [ "$bb" = default ] || envs+=(DDP_MPI_BLOCKING_BYTES="$bb")
      if env "${envs[@]}" timeout -k 10 $((limit + 20)) mpirun --allow-run-as-root --oversubscribe \
          --timeout "$limit" -np 4 -x DDP_TEST_LAYOUT -x DDP_MPI_HIER -x DDP_TEST_QUICK \
          bash -c "$hosts" "$bin" hier >"$out" 2>&1; then
        echo "ok: hier, 4 ranks as 2 hosts ($layout; DDP_MPI_HIER_BYTES $hb, DDP_MPI_BLOCKING_BYTES $bb, DDP_MPI_HIER $hier, $kind)"
      else
        echo "FAIL: hier ($spec) (exit $?)"; cat "$out"; failed=1
      fi
    done
    # Rank 1 SIGKILLed inside composed allreduces: a host mate of its
    # leader (block) and a leader (interleaved); the job ends naming it.
    for layout in block interleaved; do
      start=$(date +%s)
      env DDP_TEST_LAYOUT=$layout DDP_MPI_HIER_BYTES=0 timeout -k 10 $((limit + 20)) mpirun --allow-run-as-root \
        --oversubscribe --timeout "$limit" -np 4 -x DDP_TEST_LAYOUT bash -c "$hosts" "$bin" kill >"$out" 2>&1; rc=$?
      took=$(($(date +%s) - start))
      if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -Eq "rank 1\b.*(signal 9|Killed)|process rank 1 |rank 1 .*died" "$out" \
          && [ $took -lt "$limit" ]; then
        echo "ok: hier ($layout): SIGKILL of rank 1 ended the job in ${took}s (exit $rc): $(grep -E 'rank 1' "$out" | head -1)"
      else
        echo "FAIL: hier ($layout): SIGKILL of rank 1 (exit $rc after ${took}s)"; cat "$out"; failed=1
      fi
    done ;;
  *)
    # The default (every blocking call as MPI's blocking collective, no
    # arrival barrier), and the matrix
    # again with every collective nonblocking (DDP_MPI_BLOCKING_BYTES=0),
    # blocking calls up to 64 KiB per rank blocking and larger ones
    # nonblocking, and every blocking collective after the arrival barrier
    # (DDP_MPI_ARRIVAL_BYTES=0).
    settings=(default)
    [ "$mode" = matrix ] && settings=(default DDP_MPI_BLOCKING_BYTES=0 DDP_MPI_BLOCKING_BYTES=65536 DDP_MPI_ARRIVAL_BYTES=0 DDP_MPI_SMALL_BYTES=0)
    # direct: small calls by ddp's recursive doubling over point-to-point
    # (the default at 2 and 4 ranks), and by MPI_Allreduce (3 ranks, and
    # DDP_MPI_SMALL_BYTES=0).
    [ "$mode" = direct ] && settings=(default DDP_MPI_SMALL_BYTES=0)
    # exclusion: biased where membarrier allows, and the locked protocol only.
    [ "$mode" = exclusion ] && settings=(default DDP_INLINE_BIAS=0)
    # lane: the owner's plain record numbers where membarrier allows, and
    # atomic ones only.
    [ "$mode" = lane ] && settings=(default DDP_INLINE_BIAS=0)
    nps=(2 4)
    [ "$mode" = direct ] && nps=(2 3 4)
    for np in "${nps[@]}"; do
      for setting in "${settings[@]}"; do
        ( [ "$setting" = default ] || export "${setting?}"
          # lane keeps every record of its run (up to 40,600) in the ring.
          [ "$mode" = lane ] && export DDP_FLIGHT_RECORDER_SIZE=65536
          run_mpi "$np" "$mode" ); rc=$?
        if [ $rc -eq 0 ]; then
          echo "ok: $mode at $np ranks ($setting)"
        else
          echo "FAIL: $mode at $np ranks, $setting (exit $rc)"; cat "$out"; failed=1
        fi
      done
    done ;;
  esac
done
exit $failed
