#!/usr/bin/env bash
# ddprun end to end, one case per CTest test (the argument names it):
#   barrier   8 workers rendezvous through ddprun's store (env://), check their
#             torchrun environment, pass a barrier and an allreduce; exit 0
#   env       every torchrun variable, as each worker sees it (via env(1))
#   sigkill   one worker SIGKILLs itself: all workers are gone within the grace
#             period (their pids are dead), ddprun exits 1, and the summary names
#             that rank first with SIGKILL; with --max-restarts 1 the job restarts
#             (TORCHELASTIC_RESTART_COUNT=1) and completes
#   orphans   ddprun SIGKILLed: no worker survives it, nor the store's process
#             (PR_SET_PDEATHSIG), nor what a worker forked (ddprun's reaper),
#             nor the reaper; a normal end leaves no reaper either; what a
#             worker started with setsid is killed when the job ends, or,
#             when it exits while the job runs, reaped then (polled for up to
#             15 s), also behind a zombie that ddprun keeps (its reaper,
#             SIGKILLed)
#   store     the store's process (ddprun's child "ddp-store") SIGKILLed while
#             the workers run: ddprun stops them and exits 1 naming that process
#             and its signal; no worker survives
#   signals   SIGUSR1 reaches every worker and they go on; SIGTERM to ddprun
#             reaches every worker, which exit; ddprun exits 128+15
#   port      one node, no --master-port: a free MASTER_PORT, different from
#             DDP_STORE_ADDR's port, and the same for every worker; --master-port
#             passed on; --standalone (random run id), --nproc-per-node auto
#   nodes     two ddprun on this host as 2 nodes, static (--node-rank) and c10d;
#             a failure on one node restarts both (static and c10d); a node's
#             ddprun SIGKILLed: the other gives up on it (exit 1), and when it
#             was the store's host the other stops its workers (exit 1)
#   logs      --log-dir with --redirects, --tee and --local-ranks-filter: what
#             reaches the console and what the log files hold
#   usage     --nnodes 1:2 without c10d is refused with a message; bad options exit 2; --help;
#             -m and .py run with $PYTHON; a missing program fails with a reason
#   console   ddprun's stdout a FIFO whose reader never reads (or is stopped):
#             a worker printing megabytes then failing still gets the job torn
#             down within the grace period (exit 1); SIGTERM still ends ddprun
#             promptly (143); a reader stopped for a while sees the oldest
#             output dropped with a notice and the newest kept, while the log
#             file under --log-dir holds every line
#   order     rank 3 (not the lowest) SIGKILLs itself and the others fail from
#             the comm error within milliseconds: the summary names rank 3
#             first, every time over several runs; rank 3 stops ddprun for
#             300 ms as it dies (--freeze-launcher), so all four deaths reach
#             ddprun in one batch, as on a loaded machine (longer when the
#             others are too slow to fail within it, e.g. under ASan)
#   segments  shared-memory segments that dead workers left in /dev/shm (a
#             kill during the local backend's setup) are removed, with a
#             notice; another process's and look-alike names stay
#   torch     a PyTorch DDP script (gloo, env://) unchanged under ddprun
#             --nproc-per-node 2 with PyTorch 2.x: the reference environment's
#             Python, $DDP_TORCH_PY (default /opt/torch-venv/bin/python, built
#             by scripts/install-deps.sh refs; SKIP without it)
#   bindings  where the workers run: by default two workers on CPUs (and,
#             where there are two cores, cores) of their own, as
#             --report-bindings says and /proc/self/status shows; --bind none
#             and --bind-to=none leave them where ddprun may run; more
#             workers than CPUs: unbound with exactly one note, and --bind
#             core refused; --threads N counts N CPUs each and sets
#             OMP_NUM_THREADS; SLURM_STEP_ID leaves Slurm's binding; under
#             taskset -c C both run on C. SKIP with fewer than 2 CPUs
#   mayfail   --may-fail 1,2: rank 1 exits 3 and rank 2 SIGKILLs itself while
#             rank 0 goes on to finish its work: ddprun exits 0, names both on
#             stderr as let go, and rank 0's work is done; the same job
#             without --may-fail exits 1 and stops rank 0; --may-fail 1 alone
#             fails on rank 2 naming it; a malformed set is refused (exit 2)
#   litter    ddprun --nproc-per-node 2 ddp-train --pp 3 (a usage error), and
#             flight_worker's rank 1 exiting 2 while rank 0 waits: nothing
#             is left in the working directory; the flight dumps go to
#             DDP_DEBUG_DIR, or to a run directory under TMPDIR that the
#             summary names
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

case_name=${1:?usage: test_ddprun.sh CASE}
bin=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}
ddprun=$bin/ddprun
worker=$bin/../tests/launch_worker
here=$(cd "$(dirname "$0")" && pwd)
. "$here/../support/free_port.sh"
[ -x "$ddprun" ] || fail "$ddprun is not built"
[ -x "$worker" ] || fail "$worker is not built"
tmp=$(mktemp -d)
started=()
# Kills pid only while it is still one of ours (its command line names
# ddprun, launch_worker or this test's scripts): a pid from a pid file may
# have been reused by another process since.
kill_ours() {
  local cmd
  cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline") || return 0
  case "$cmd" in *ddprun*|*launch_worker*|*"$tmp"*) kill -KILL "$1" 2>/dev/null ;; esac
}
cleanup() {
  for p in "${started[@]}"; do kill_ours "$p"; done
  # Workers that a failing case left behind (their pids are in pid files).
  for f in "$tmp"/pids*/pid.*; do
    [ -f "$f" ] && kill_ours "$(cat "$f")"
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/pids"

alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; }
all_dead() { # DIR: every pid in DIR/pid.* is gone
  for f in "$1"/pid.*; do
    [ -f "$f" ] || continue
    alive "$(cat "$f")" && return 1
  done
  return 0
}
kill_then_all_dead() { # PID DIR WHAT: SIGKILL ddprun PID; every pid in DIR/pid.* gone within 5 s
  kill -KILL "$1"
  wait "$1" 2>/dev/null
  local end=$((SECONDS + 5))
  until all_dead "$2"; do
    [ $SECONDS -ge $end ] && fail "$3 survived ddprun's SIGKILL: $(cat "$2"/pid.* | tr '\n' ' ')"
    sleep 0.05
  done
}
wait_for_files() { # DIR COUNT SECONDS
  local end=$((SECONDS + $3))
  while [ "$(ls "$1" | grep -c '^pid\.')" -lt "$2" ]; do
    [ $SECONDS -ge $end ] && return 1
    sleep 0.05
  done
}

case "$case_name" in
barrier)
  timeout 30 "$ddprun" --nproc-per-node 8 "$worker" --nproc 8 --nnodes 1 >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/out" "$tmp/err"; fail "ddprun exited $rc"; }
  for r in 0 1 2 3 4 5 6 7; do
    grep -q "^launch_worker rank $r/8 local $r/8 node 0/1 restart 0 pid [0-9]* ok$" "$tmp/out" ||
      { cat "$tmp/out" "$tmp/err"; fail "rank $r did not report passing the barrier"; }
  done
  # The underscore spelling and --opt=value work the same.
  timeout 30 "$ddprun" --nproc_per_node=3 "$worker" --nproc 3 >"$tmp/out" 2>&1 || { cat "$tmp/out"; fail "--nproc_per_node=3"; }
  [ "$(grep -c ' ok$' "$tmp/out")" -eq 3 ] || fail "--nproc_per_node=3 did not run 3 workers"
  # --pass-local-rank: the worker checks --local-rank=N against LOCAL_RANK.
  timeout 30 "$ddprun" --nproc-per-node 2 --pass-local-rank "$worker" --no-init >"$tmp/out" 2>&1 ||
    { cat "$tmp/out"; fail "--pass-local-rank"; }
  ;;
env)
  timeout 30 env -u OMP_NUM_THREADS "$ddprun" --nproc-per-node 3 --max-restarts 2 --rdzv-id myjob /usr/bin/env >"$tmp/out" 2>&1 ||
    { cat "$tmp/out"; fail "ddprun env exited $?"; }
  for v in MASTER_ADDR=127.0.0.1 WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 GROUP_WORLD_SIZE=1 \
      ROLE_WORLD_SIZE=3 ROLE_NAME=default TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=2 \
      TORCHELASTIC_RUN_ID=myjob TORCHELASTIC_USE_AGENT_STORE=False OMP_NUM_THREADS=1 \
      DDP_STORE_PREFIX=ddprun/myjob/attempt/0/; do
    [ "$(grep -c "^$v\$" "$tmp/out")" -eq 3 ] || { cat "$tmp/out"; fail "$v is not in every worker's environment"; }
  done
  for r in 0 1 2; do
    for v in RANK=$r LOCAL_RANK=$r ROLE_RANK=$r; do
      [ "$(grep -c "^$v\$" "$tmp/out")" -eq 1 ] || fail "$v: not exactly one worker"
    done
  done
  [ "$(grep -c '^MASTER_PORT=[0-9][0-9]*$' "$tmp/out")" -eq 3 ] || fail "MASTER_PORT missing"
  [ "$(grep -c '^DDP_STORE_ADDR=127.0.0.1:[0-9][0-9]*$' "$tmp/out")" -eq 3 ] || fail "DDP_STORE_ADDR missing"
  # A user's OMP_NUM_THREADS is kept; one worker gets none added (torchrun's rule).
  OMP_NUM_THREADS=4 timeout 30 "$ddprun" --nproc-per-node 2 /usr/bin/env >"$tmp/out" 2>&1
  [ "$(grep -c '^OMP_NUM_THREADS=4$' "$tmp/out")" -eq 2 ] || fail "the user's OMP_NUM_THREADS was not kept"
  timeout 30 env -u OMP_NUM_THREADS "$ddprun" /usr/bin/env >"$tmp/out" 2>&1
  grep -q '^OMP_NUM_THREADS=' "$tmp/out" && fail "OMP_NUM_THREADS set for a single worker"
  # Inherited launcher variables are replaced, not duplicated.
  RANK=99 WORLD_SIZE=99 timeout 30 "$ddprun" --nproc-per-node 2 /usr/bin/env >"$tmp/out" 2>&1
  grep -q '^RANK=99$' "$tmp/out" && fail "an inherited RANK reached a worker"
  [ "$(grep -c '^WORLD_SIZE=2$' "$tmp/out")" -eq 2 ] || fail "WORLD_SIZE not replaced"
  ;;
sigkill)
  grace=3
  start=$(date +%s.%N)
  timeout 60 "$ddprun" --nproc-per-node 4 --grace-period $grace "$worker" --die-rank 2 --die-how kill --hang \
    --pidfile "$tmp/pids" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  end=$(date +%s.%N)
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "ddprun exited $rc after a worker was SIGKILLed (expected 1)"; }
  [ "$(ls "$tmp/pids" | grep -c '^pid\.')" -eq 4 ] || fail "not every worker wrote its pid"
  all_dead "$tmp/pids" || fail "a worker outlived ddprun"
  # The other workers hang (pause) and take SIGTERM's default action: gone
  # well within the grace period.
  awk -v a="$start" -v b="$end" -v g=$grace 'BEGIN { exit !(b - a < g) }' ||
    fail "ddprun took $(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }') s (grace $grace s)"
  grep -q 'first failure: rank 2 (local rank 2) on host .*: killed by signal 9 (SIGKILL)' "$tmp/err" ||
    { cat "$tmp/err"; fail "the summary does not name rank 2 first with SIGKILL"; }
  grep -q 'ddprun:   | launch_worker: rank 2 dies now (kill)' "$tmp/err" || { cat "$tmp/err"; fail "no tail of rank 2's output"; }
  grep -q 'the job failed' "$tmp/err" || fail "no verdict"
  grep -q 'first failure: rank [013]' "$tmp/err" && fail "another rank named first"
  # With a restart: attempt 0 fails, attempt 1 completes.
  rm -f "$tmp/pids"/pid.*
  timeout 60 "$ddprun" --nproc-per-node 4 --max-restarts 1 --grace-period $grace "$worker" --die-rank 2 --hang \
    >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/out" "$tmp/err"; fail "the restarted job exited $rc"; }
  grep -q 'restarting the group (restart 1 of 1)' "$tmp/err" || { cat "$tmp/err"; fail "no restart announced"; }
  [ "$(grep -c ' restart 1 pid [0-9]* ok$' "$tmp/out")" -eq 4 ] || { cat "$tmp/out"; fail "attempt 1 did not complete on 4 workers"; }
  # A failure in every attempt: restarts run out, exit 1.
  timeout 60 "$ddprun" --nproc-per-node 2 --max-restarts 1 --grace-period 1 "$worker" --die-rank 1 --die-how exit \
    --die-attempt -1 --hang >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "a job failing in every attempt exited $rc (expected 1)"; }
  grep -q 'the job failed (no restarts left)' "$tmp/err" || { cat "$tmp/err"; fail "no final verdict"; }
  [ "$(grep -c 'failure summary' "$tmp/err")" -eq 2 ] || fail "expected one summary per attempt"
  ;;
orphans)
  "$ddprun" --nproc-per-node 4 "$worker" --no-init --sleep 60 --pidfile "$tmp/pids" >"$tmp/out" 2>&1 &
  started+=($!)
  wait_for_files "$tmp/pids" 4 20 || fail "the workers did not start"
  store=$(pgrep -P "${started[0]}" -x ddp-store) || fail "ddprun has no child named ddp-store"
  echo "$store" >"$tmp/pids/pid.store"
  kill_then_all_dead "${started[0]}" "$tmp/pids" "workers or the store"
  # What the workers fork themselves dies too: ddprun's reaper SIGKILLs
  # their process groups once ddprun is gone, and exits.
  mkdir -p "$tmp/pids2"
  "$ddprun" --nproc-per-node 2 /bin/sh -c '
    "$1" --no-init --sleep 60 & echo $! >"$0/pid.child$LOCAL_RANK"
    echo $$ >"$0/pid.$LOCAL_RANK"
    wait' "$tmp/pids2" "$worker" >"$tmp/out" 2>&1 &
  started+=($!)
  wait_for_files "$tmp/pids2" 4 20 || fail "the workers and their children did not start"
  reaper=$(pgrep -P "${started[-1]}" -x ddprun-reaper) || fail "ddprun has no child named ddprun-reaper"
  echo "$reaper" >"$tmp/pids2/pid.reaper"
  kill_then_all_dead "${started[-1]}" "$tmp/pids2" "workers' children or the reaper"
  # A job that ends normally leaves no reaper behind either.
  "$ddprun" --nproc-per-node 2 /bin/sleep 1 >"$tmp/out" 2>&1 &
  job=$!
  started+=($job)
  end=$((SECONDS + 5))
  until reaper=$(pgrep -P $job -x ddprun-reaper); do
    [ $SECONDS -ge $end ] && fail "the normal job has no reaper"
    sleep 0.05
  done
  wait $job || fail "a trivial job failed"
  alive "$reaper" && fail "a reaper outlived a job that ended normally"
  # What leaves a worker's process group (setsid, here with a child of its
  # own) is adopted by ddprun once orphaned and killed when the job ends;
  # ddprun names it on stderr.
  mkdir -p "$tmp/pids3"
  timeout 30 "$ddprun" --nproc-per-node 2 /bin/sh -c '
    setsid /bin/sh -c "sleep 60 & echo \$! >$0/pid.grandchild$LOCAL_RANK; echo \$\$ >$0/pid.escaped$LOCAL_RANK; wait" &
    while [ ! -s "$0/pid.grandchild$LOCAL_RANK" ] || [ ! -s "$0/pid.escaped$LOCAL_RANK" ]; do sleep 0.05; done' \
    "$tmp/pids3" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/out" "$tmp/err"; fail "the job whose workers setsid exited $rc"; }
  [ "$(ls "$tmp/pids3" | grep -c '^pid\.')" -eq 4 ] || fail "not every escaped process wrote its pid"
  all_dead "$tmp/pids3" || { ps -ef; fail "a process that left its worker's process group outlived ddprun"; }
  grep -q '^ddprun: killed [24] processes that the workers left running outside their process groups (setsid or a daemon): pid [0-9]* (' "$tmp/err" ||
    { cat "$tmp/err"; fail "ddprun did not name the processes it killed"; }
  # One that exits while the job runs is reaped then, not left a zombie of
  # ddprun's until the job ends. Each worker setsids three sleeps, checks
  # that ddprun adopted them, ends them (so it knows when they exit) and
  # polls, while it still runs, until none is ddprun's zombie: on a loaded
  # machine ddprun may take a while, so 15 s are given; without the reap the
  # zombies stay until the end. Only the sleeps are counted (a worker that
  # has just exited is ddprun's zombie for a moment, and is no orphan). With
  # "reaper", the worker first SIGKILLs ddprun's reaper, whose zombie ddprun
  # keeps until the group ends: it comes before the sleeps among ddprun's
  # children, and they must not wait behind it.
  cat >"$tmp/zombies.sh" <<'EOF'
dir=$1 mode=$2
mine=$dir/sleeps.$LOCAL_RANK
ms() { echo $(( ($(date +%s%N) - start) / 1000000 )); }
if [ "$mode" = reaper ]; then
  reaper=$(pgrep -P $PPID -x ddprun-reaper) || { echo "ddprun has no reaper" >&2; exit 3; }
  kill -KILL $reaper
  start=$(date +%s%N)
  until [ "$(ps -o stat= -p $reaper | cut -c1)" = Z ]; do
    [ $(ms) -lt 10000 ] || { echo "the reaper is no zombie 10 s after SIGKILL" >&2; exit 3; }
    sleep 0.05
  done
fi
for i in 1 2 3; do (setsid sleep 60 & echo $! >>"$mine"); done
sleeps=$(paste -sd, "$mine")
# The subshells that started them are gone: ddprun is their parent now.
[ "$(ps -o ppid= -p "$sleeps" | awk -v p=$PPID '$1 == p' | wc -l)" = 3 ] ||
  { echo "not all of the sleeps $sleeps are ddprun's children" >&2; ps -o pid,ppid,stat,comm -p "$sleeps" >&2; exit 4; }
kill $(cat "$mine")
start=$(date +%s%N)
while n=$(ps -o stat=,ppid= -p "$sleeps" | awk -v p=$PPID '$1 ~ /^Z/ && $2 == p' | wc -l); [ "$n" -gt 0 ]; do
  [ $(ms) -lt 15000 ] || break
  sleep 0.05
done
echo "$n $(ms)" >"$dir/zombies.$LOCAL_RANK"
EOF
  for mode in plain reaper; do
    nproc=2
    [ $mode = reaper ] && nproc=1
    mkdir -p "$tmp/zombies-$mode"
    timeout 60 "$ddprun" --nproc-per-node $nproc /bin/sh "$tmp/zombies.sh" "$tmp/zombies-$mode" $mode \
      >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/out" "$tmp/err"; fail "the job whose workers end setsid'd sleeps failed ($mode)"; }
    for r in $(seq 0 $((nproc - 1))); do
      read -r zombies ms <"$tmp/zombies-$mode/zombies.$r" || fail "local rank $r wrote no zombie count ($mode)"
      [ "$zombies" = 0 ] ||
        fail "ddprun still had $zombies of local rank $r's setsid'd sleeps as zombie children $ms ms after they exited, while the job ran ($mode)"
    done
  done
  # A normal job kills nothing and says nothing of it.
  timeout 30 "$ddprun" --nproc-per-node 2 /bin/true >"$tmp/out" 2>"$tmp/err" || fail "/bin/true under ddprun"
  grep -q 'killed' "$tmp/err" && { cat "$tmp/err"; fail "ddprun killed something after /bin/true"; }
  :
  ;;
store)
  "$ddprun" --nproc-per-node 3 --grace-period 2 "$worker" --no-init --sleep 60 --pidfile "$tmp/pids" >"$tmp/out" 2>"$tmp/err" &
  pid=$!
  started+=($pid)
  wait_for_files "$tmp/pids" 3 20 || fail "the workers did not start"
  store=$(pgrep -P $pid -x ddp-store) || fail "ddprun has no child named ddp-store"
  started+=($store)
  kill -KILL "$store"
  timeout 20 tail --pid=$pid -f /dev/null
  wait $pid
  rc=$?
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "ddprun exited $rc after its store's process was killed (expected 1)"; }
  grep -q "^ddprun: node 0 (.*): the store server process (pid $store, 127\.0\.0\.1:[0-9]*) killed by signal 9 (SIGKILL) during attempt 0; the job cannot go on without its store$" "$tmp/err" ||
    { cat "$tmp/err"; fail "ddprun's error does not name its store's process"; }
  all_dead "$tmp/pids" || fail "workers survived: $(cat "$tmp"/pids/pid.* | tr '\n' ' ')"
  ;;
signals)
  cat >"$tmp/w.sh" <<'SH'
#!/usr/bin/env bash
trap 'echo "rank $RANK got USR1"' USR1
trap 'echo "rank $RANK got TERM"; exit 0' TERM
echo $$ >"$1/pid.$RANK"
for i in $(seq 600); do sleep 0.1; done
SH
  chmod +x "$tmp/w.sh"
  "$ddprun" --nproc-per-node 3 --grace-period 5 "$tmp/w.sh" "$tmp/pids" >"$tmp/out" 2>"$tmp/err" &
  pid=$!
  started+=($pid)
  wait_for_files "$tmp/pids" 3 20 || fail "the workers did not start"
  sleep 0.3 # the traps are set before the pid files are written; let bash settle
  kill -USR1 $pid
  end=$((SECONDS + 10))
  until [ "$(grep -c 'got USR1' "$tmp/out")" -eq 3 ]; do
    [ $SECONDS -ge $end ] && { cat "$tmp/out"; fail "SIGUSR1 did not reach every worker"; }
    sleep 0.05
  done
  alive $pid || fail "ddprun stopped after SIGUSR1"
  kill -TERM $pid
  timeout 20 tail --pid=$pid -f /dev/null
  wait $pid
  rc=$?
  [ $rc -eq 143 ] || { cat "$tmp/err"; fail "ddprun exited $rc after SIGTERM (expected 143)"; }
  [ "$(grep -c 'got TERM' "$tmp/out")" -eq 3 ] || { cat "$tmp/out"; fail "SIGTERM did not reach every worker"; }
  all_dead "$tmp/pids" || fail "a worker survived"
  ;;
port)
  timeout 30 "$ddprun" --nproc-per-node 2 /usr/bin/env >"$tmp/a" 2>&1 || fail "ddprun env"
  timeout 30 "$ddprun" --nproc-per-node 2 /usr/bin/env >"$tmp/b" 2>&1 || fail "ddprun env"
  p=$(grep -m1 '^MASTER_PORT=' "$tmp/a" | cut -d= -f2)
  s=$(grep -m1 '^DDP_STORE_ADDR=' "$tmp/a" | sed 's/.*://')
  [ "$(grep -c "^MASTER_PORT=$p\$" "$tmp/a")" -eq 2 ] || fail "the workers disagree on MASTER_PORT"
  [ "$p" != 29500 ] || fail "one node without --master-port used 29500 instead of a free port"
  [ "$p" != "$s" ] || fail "MASTER_PORT is the store's port"
  # A port in use is not chosen: hold one, and ask for it explicitly too.
  /usr/bin/python3 - "$p" <<'PY' || fail "the chosen MASTER_PORT $p is not free after the job"
import socket, sys
s = socket.socket(); s.bind(("0.0.0.0", int(sys.argv[1]))); s.close()
PY
  timeout 30 "$ddprun" --master-port 31234 --nproc-per-node 2 /usr/bin/env >"$tmp/c" 2>&1
  [ "$(grep -c '^MASTER_PORT=31234$' "$tmp/c")" -eq 2 ] || fail "--master-port 31234 not passed on"
  # --standalone: a random run id and a free port; auto here (no GPU) = the CPUs.
  timeout 30 "$ddprun" --standalone --nproc-per-node auto /usr/bin/env >"$tmp/d" 2>&1 || fail "--standalone"
  n=$(nproc)
  [ "$(grep -c "^LOCAL_WORLD_SIZE=$n\$" "$tmp/d")" -eq "$n" ] || ls /dev/nvidia0 2>/dev/null ||
    fail "--nproc-per-node auto did not start $n workers on a host without GPUs"
  [ "$(grep '^TORCHELASTIC_RUN_ID=standalone-' "$tmp/d" | sort -u | wc -l)" -eq 1 ] || fail "--standalone: no single random run id"
  ;;
nodes)
  for backend in static c10d; do
    port=$(ddp_free_port)
    if [ $backend = static ]; then
      args=(--nnodes 2 --master-addr 127.0.0.1 --master-port "$port")
      a0=(--node-rank 0); a1=(--node-rank 1)
    else
      args=(--nnodes 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id c10dtest)
      a0=(); a1=()
    fi
    timeout 60 "$ddprun" "${args[@]}" "${a1[@]}" --nproc-per-node 3 --rdzv-timeout 30 "$worker" --nproc 3 --nnodes 2 \
      >"$tmp/n1" 2>&1 &
    n1=$!
    started+=($n1)
    timeout 60 "$ddprun" "${args[@]}" "${a0[@]}" --nproc-per-node 3 --rdzv-timeout 30 "$worker" --nproc 3 --nnodes 2 \
      >"$tmp/n0" 2>&1
    rc0=$?
    wait $n1
    rc1=$?
    [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { cat "$tmp/n0" "$tmp/n1"; fail "$backend: the nodes exited $rc0 and $rc1"; }
    cat "$tmp/n0" "$tmp/n1" >"$tmp/all"
    for r in 0 1 2 3 4 5; do
      grep -q "^launch_worker rank $r/6 local $((r % 3))/3 node $((r / 3))/2 restart 0" "$tmp/all" ||
        { cat "$tmp/all"; fail "$backend: rank $r missing or with the wrong local rank / node"; }
    done
    # The node ranks are whole: each node's workers share one node rank.
    [ "$(grep -o 'node [01]/2' "$tmp/n0" | sort -u | wc -l)" -eq 1 ] || fail "$backend: node 0's workers disagree"
  done
  # A worker failing on one node stops the other node too, and both restart.
  port=$(ddp_free_port)
  args=(--nnodes 2 --master-port "$port" --nproc-per-node 2 --max-restarts 1 --grace-period 2 --rdzv-timeout 30)
  timeout 60 "$ddprun" "${args[@]}" --node-rank 1 "$worker" --die-rank 3 --hang >"$tmp/n1" 2>&1 &
  n1=$!
  started+=($n1)
  timeout 60 "$ddprun" "${args[@]}" --node-rank 0 "$worker" --die-rank 3 --hang >"$tmp/n0" 2>&1
  rc0=$?
  wait $n1
  rc1=$?
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { cat "$tmp/n0" "$tmp/n1"; fail "restart across nodes: exited $rc0 and $rc1"; }
  grep -q 'another node failed: rank 3' "$tmp/n0" || { cat "$tmp/n0"; fail "node 0 does not name node 1's failure"; }
  [ "$(cat "$tmp/n0" "$tmp/n1" | grep -c ' restart 1 pid [0-9]* ok$')" -eq 4 ] || fail "attempt 1 not complete"
  # The same with c10d ranks: the failing rank's node is whichever arrived second.
  port=$(ddp_free_port)
  args=(--nnodes 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --nproc-per-node 2 --max-restarts 1
        --grace-period 2 --rdzv-timeout 30)
  timeout 60 "$ddprun" "${args[@]}" "$worker" --die-rank 1 --hang >"$tmp/n1" 2>&1 &
  n1=$!
  started+=($n1)
  timeout 60 "$ddprun" "${args[@]}" "$worker" --die-rank 1 --hang >"$tmp/n0" 2>&1
  rc0=$?
  wait $n1
  rc1=$?
  [ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || { cat "$tmp/n0" "$tmp/n1"; fail "c10d restart across nodes: exited $rc0 and $rc1"; }
  [ "$(cat "$tmp/n0" "$tmp/n1" | grep -c ' restart 1 pid [0-9]* ok$')" -eq 4 ] || fail "c10d: attempt 1 not complete"
  # A node's ddprun SIGKILLed: its workers die with it, and the other node
  # does not wait for it forever (silent for --rdzv-timeout 3 s: exit 1).
  port=$(ddp_free_port)
  args=(--nnodes 2 --master-port "$port" --nproc-per-node 2 --rdzv-timeout 3)
  mkdir -p "$tmp/pids1"
  "$ddprun" "${args[@]}" --node-rank 1 "$worker" --no-init --sleep 60 --pidfile "$tmp/pids1" >"$tmp/n1" 2>&1 &
  n1=$!
  started+=($n1)
  timeout 60 "$ddprun" "${args[@]}" --node-rank 0 "$worker" --no-init >"$tmp/n0" 2>&1 &
  n0=$!
  started+=($n0)
  wait_for_files "$tmp/pids1" 2 20 || { cat "$tmp/n0" "$tmp/n1"; fail "node 1's workers did not start"; }
  kill -KILL $n1
  t=$SECONDS
  wait $n0
  rc0=$?
  [ $rc0 -eq 1 ] || { cat "$tmp/n0"; fail "node 0 exited $rc0 after node 1's ddprun was SIGKILLed (expected 1)"; }
  [ $((SECONDS - t)) -le 15 ] || fail "node 0 took $((SECONDS - t)) s to give up on node 1"
  grep -q 'node 1 has been silent' "$tmp/n0" || { cat "$tmp/n0"; fail "node 0 does not say node 1 went silent"; }
  end=$((SECONDS + 5))
  until all_dead "$tmp/pids1"; do [ $SECONDS -ge $end ] && fail "node 1's workers outlived its ddprun"; sleep 0.05; done
  # The store's host (node 0) SIGKILLed: node 1 stops its workers and exits 1.
  port=$(ddp_free_port)
  args=(--nnodes 2 --master-port "$port" --nproc-per-node 2 --rdzv-timeout 10 --grace-period 2)
  mkdir -p "$tmp/pids2"
  "$ddprun" "${args[@]}" --node-rank 0 "$worker" --no-init --sleep 60 >"$tmp/n0" 2>&1 &
  n0=$!
  started+=($n0)
  timeout 60 "$ddprun" "${args[@]}" --node-rank 1 "$worker" --no-init --sleep 60 --pidfile "$tmp/pids2" >"$tmp/n1" 2>&1 &
  n1=$!
  started+=($n1)
  wait_for_files "$tmp/pids2" 2 20 || { cat "$tmp/n0" "$tmp/n1"; fail "node 1's workers did not start"; }
  kill -KILL $n0
  t=$SECONDS
  wait $n1
  rc1=$?
  [ $rc1 -eq 1 ] || { cat "$tmp/n1"; fail "node 1 exited $rc1 after the store's host was SIGKILLed (expected 1)"; }
  # The store client keeps reconnecting for up to --rdzv-timeout (10 s) before
  # it calls the store lost, then the grace period (2 s) runs: 15 s is that
  # with a margin for a loaded machine (11 s has been seen).
  [ $((SECONDS - t)) -le 15 ] || fail "node 1 took $((SECONDS - t)) s to notice"
  all_dead "$tmp/pids2" || fail "node 1's workers survived"
  ;;
logs)
  cat >"$tmp/w.sh" <<'SH'
#!/usr/bin/env bash
echo "out of $LOCAL_RANK"
echo "err of $LOCAL_RANK" >&2
SH
  chmod +x "$tmp/w.sh"
  # Local rank 0: stdout redirected (file only); rank 1: stderr teed; rank 2:
  # filtered off the console. Every stream lands in its log file.
  timeout 30 "$ddprun" --nproc-per-node 3 --rdzv-id logjob --log-dir "$tmp/logs" --redirects 0:1 --tee 1:2 \
    --local-ranks-filter 0,1 "$tmp/w.sh" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/err"; fail "ddprun exited $?"; }
  grep -q 'out of 0' "$tmp/out" && fail "local rank 0's redirected stdout reached the console"
  grep -q 'err of 0' "$tmp/err" || fail "local rank 0's stderr did not reach the console"
  grep -q 'out of 1' "$tmp/out" && grep -q 'err of 1' "$tmp/err" || fail "local rank 1's output is missing from the console"
  grep -q 'of 2' "$tmp/out" "$tmp/err" && fail "local rank 2 is filtered but reached the console"
  for r in 0 1 2; do
    for s in out err; do
      f="$tmp/logs/logjob/attempt_0/$r/std$s.log"
      [ "$(cat "$f" 2>/dev/null)" = "$s of $r" ] || fail "$f does not hold '$s of $r'"
    done
  done
  ;;
usage)
  "$ddprun" --nnodes 1:2 "$worker" >"$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 2 ] || fail "--nnodes 1:2 exited $rc (expected 2)"
  grep -q 'elastic membership needs --rdzv-backend c10d' "$tmp/out" || { cat "$tmp/out"; fail "no clear message for --nnodes 1:2 (static)"; }
  "$ddprun" --bogus "$worker" >"$tmp/out" 2>&1; [ $? -eq 2 ] || fail "--bogus not refused"
  grep -q 'unknown option --bogus' "$tmp/out" || fail "--bogus: no message"
  "$ddprun" --nproc-per-node zero "$worker" >"$tmp/out" 2>&1; [ $? -eq 2 ] || fail "--nproc-per-node zero not refused"
  "$ddprun" >"$tmp/out" 2>&1; [ $? -eq 2 ] || fail "no program not refused"
  "$ddprun" --help >"$tmp/out" || fail "--help exited $?"
  for word in --nproc-per-node --nnodes --node-rank --master-addr --master-port --rdzv-endpoint --rdzv-id \
      --rdzv-backend --standalone --max-restarts --monitor-interval --log-dir --redirects --tee \
      --local-ranks-filter --no-python --pass-local-rank --grace-period SLURM; do
    grep -q -- "$word" "$tmp/out" || fail "--help does not mention $word"
  done
  # -m runs a Python module ($PYTHON -u -m NAME); a .py runs with $PYTHON.
  PYTHON=/usr/bin/python3 timeout 30 "$ddprun" --nproc-per-node 2 -m site >"$tmp/out" 2>&1 || fail "-m site exited $?"
  [ "$(grep -c '^sys.path = \[' "$tmp/out")" -eq 2 ] || { cat "$tmp/out"; fail "-m site did not run in 2 workers"; }
  printf 'import os, sys\nprint("py", os.environ["RANK"], sys.executable)\n' >"$tmp/p.py"
  PYTHON=/usr/bin/python3 timeout 30 "$ddprun" --nproc-per-node 2 "$tmp/p.py" >"$tmp/out" 2>&1 || fail ".py exited $?"
  [ "$(grep -c '^py [01] /usr/bin/python3$' "$tmp/out")" -eq 2 ] || { cat "$tmp/out"; fail ".py did not run with \$PYTHON"; }
  # -m with --pass-local-rank: the longest command line ddprun builds
  # ($PYTHON -u -m NAME --local-rank=N ARGS); it once overran its argv array.
  printf 'import sys\nprint("argv", " ".join(sys.argv[1:]))\n' >"$tmp/argmod.py"
  PYTHONPATH=$tmp PYTHON=/usr/bin/python3 timeout 30 "$ddprun" --nproc-per-node 2 --pass-local-rank \
    -m argmod a b >"$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/out"; fail "-m with --pass-local-rank exited $rc"; }
  for r in 0 1; do
    grep -q "^argv --local-rank=$r a b\$" "$tmp/out" || { cat "$tmp/out"; fail "-m --pass-local-rank: no --local-rank=$r a b"; }
  done
  # A program that cannot be executed is a failure with a reason.
  timeout 30 "$ddprun" "$tmp/no-such-program" >"$tmp/out" 2>&1; [ $? -eq 1 ] || fail "a missing program did not fail the job"
  grep -q 'cannot execute' "$tmp/out" || { cat "$tmp/out"; fail "no reason for the missing program"; }
  ;;
console)
  mkfifo "$tmp/fifo"
  # A reader that holds the FIFO open and never reads it (killed at the end:
  # a child of this shell, so its pid is ours while it runs).
  sleep 100 <"$tmp/fifo" >/dev/null 2>&1 &
  holder=$!
  trap 'kill -KILL $holder 2>/dev/null; cleanup' EXIT
  grace=2
  start=$(date +%s.%N)
  timeout 30 "$ddprun" --nproc-per-node 3 --grace-period $grace --log-dir "$tmp/logs" --rdzv-id c1 \
    "$worker" --no-init --sleep 60 --spew-rank 1 --spew 4 --spew-exit 3 --pidfile "$tmp/pids" \
    >"$tmp/fifo" 2>"$tmp/err"
  rc=$?
  end=$(date +%s.%N)
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "ddprun exited $rc with a console that does not read (expected 1; 124: it stalled)"; }
  all_dead "$tmp/pids" || fail "a worker outlived ddprun"
  awk -v a="$start" -v b="$end" -v g=$grace 'BEGIN { exit !(b - a < g + 3) }' ||
    fail "ddprun took $(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }') s (grace $grace s)"
  grep -q 'first failure: rank 1 (local rank 1).*exited with code 3' "$tmp/err" ||
    { cat "$tmp/err"; fail "the summary does not name rank 1"; }
  log=$tmp/logs/c1/attempt_0/1/stdout.log
  [ "$(wc -l <"$log")" -eq 40000 ] || fail "the log file holds $(wc -l <"$log") lines, not all 40000"
  [ "$(tail -n1 "$log" | cut -d' ' -f2)" = 39999 ] || fail "the log file's last line is not spew 39999"
  # SIGTERM while the console is full: ddprun ends promptly with 128+15.
  rm -f "$tmp/pids"/pid.*
  timeout 30 "$ddprun" --nproc-per-node 2 --grace-period $grace "$worker" --no-init --sleep 60 \
    --spew-rank 0 --spew 4 --pidfile "$tmp/pids" >"$tmp/fifo" 2>"$tmp/err" &  # the same never-read FIFO
  pid=$!
  started+=($pid)
  wait_for_files "$tmp/pids" 2 20 || fail "the workers did not start"
  sleep 1
  t0=$(date +%s.%N)
  kill -TERM $pid
  wait $pid
  rc=$?
  t1=$(date +%s.%N)
  [ $rc -eq 143 ] || { cat "$tmp/err"; fail "ddprun exited $rc after SIGTERM with a full console (expected 143)"; }
  awk -v a="$t0" -v b="$t1" -v g=$grace 'BEGIN { exit !(b - a < g + 3) }' || fail "ddprun took too long after SIGTERM"
  all_dead "$tmp/pids" || fail "a worker outlived ddprun"
  # A reader stopped while rank 0 prints 4 MB, resumed while the job runs:
  # the first lines, a notice of what was dropped, and the newest lines.
  mkfifo "$tmp/fifo2"
  cat "$tmp/fifo2" >"$tmp/console" &
  reader=$!
  started+=($reader)
  timeout 30 "$ddprun" --nproc-per-node 2 --log-dir "$tmp/logs" --rdzv-id c3 "$worker" --no-init --sleep 6 \
    --spew-rank 0 --spew 4 >"$tmp/fifo2" 2>"$tmp/err" &
  pid=$!
  started+=($pid)
  # Stopped once both ends are open (stopped sooner, it would block the open).
  until [ -n "$(ls -l /proc/$reader/fd 2>/dev/null | grep fifo2)" ]; do sleep 0.01; done
  kill -STOP $reader
  # Resume the reader once rank 0 has printed everything (its log is whole).
  log=$tmp/logs/c3/attempt_0/0/stdout.log
  end=$((SECONDS + 20))
  until [ -f "$log" ] && [ "$(wc -l <"$log")" -ge 40000 ]; do
    [ $SECONDS -ge $end ] && { kill -CONT $reader; fail "rank 0 did not print its 4 MB within 20 s"; }
    sleep 0.1
  done
  kill -CONT $reader
  wait $pid
  rc=$?
  wait $reader
  [ $rc -eq 0 ] || { cat "$tmp/err"; fail "ddprun exited $rc (expected 0)"; }
  grep -q "^spew 0 x" "$tmp/console" || fail "the first line is not on the console"
  grep -q "^spew 39999 x" "$tmp/console" || fail "the newest line is not on the console"
  grep -Eq "^\[ddprun: [0-9]+ bytes of rank 0's output dropped: the console is not reading\]$" "$tmp/console" ||
    { head -c 300 "$tmp/console"; fail "no drop notice on the console"; }
  [ "$(grep -c ' ok$' "$tmp/console")" -eq 2 ] || fail "a worker's last line is missing"
  # Every line that reached the console is whole.
  bad=$(grep -Evc "^(spew [0-9]+ x+|\[ddprun: .*\]|launch_worker .* ok)$" "$tmp/console")
  [ "$bad" -eq 0 ] || { grep -Ev "^(spew [0-9]+ x+|\[ddprun: .*\]|launch_worker .* ok)$" "$tmp/console" | head -3; fail "$bad broken lines on the console"; }
  ;;
order)
  # Five conclusive runs. A run is conclusive when the other three failures
  # really reached ddprun in the same batch as rank 3's death; when the
  # machine (or a sanitizer) is too slow for them to fail within the freeze,
  # the freeze doubles (up to 4.8 s) and the run does not count. Whatever the
  # batch held, rank 3 must be named first in every run.
  freeze=300 conclusive=0 i=0
  while [ $conclusive -lt 5 ]; do
    i=$((i + 1))
    [ $i -le 12 ] || fail "only $conclusive of 5 runs had all four failures in one batch after $((i - 1)) runs"
    timeout 60 "$ddprun" --nproc-per-node 4 --grace-period 3 "$worker" --die-rank 3 --die-how kill --check-final \
      --freeze-launcher $freeze \
      >"$tmp/out" 2>"$tmp/err"
    rc=$?
    [ $rc -eq 1 ] || { cat "$tmp/err"; fail "run $i: ddprun exited $rc (expected 1)"; }
    grep -q 'first failure: rank 3 (local rank 3) on host .*: killed by signal 9 (SIGKILL)' "$tmp/err" ||
      { cat "$tmp/err"; fail "run $i: the summary does not name rank 3 first"; }
    if [ "$(grep -c 'also failed: rank [012] .*exited with code 7' "$tmp/err")" -eq 3 ]; then
      conclusive=$((conclusive + 1))
    else
      echo "run $i: the other ranks had not failed within the ${freeze} ms freeze; not counted, freeze doubled"
      [ $freeze -lt 4800 ] && freeze=$((freeze * 2))
    fi
  done
  ;;
segments)
  # Each worker leaves a segment named as the local backend names rank 0's
  # (as a rank SIGKILLed while its group is set up does); worker 1 then
  # SIGKILLs itself and ddprun tears the job down. Both segments must be
  # gone; one named after a live process that is no worker of this job
  # (this shell) stays, and so does a name that only looks alike.
  decoy=/dev/shm/ddp-local-$$-00000000deadbeef
  lookalike=/dev/shm/ddp-local-$$-notanonce
  : >"$decoy"; : >"$lookalike"
  mkdir -p "$tmp/pids"
  timeout 60 "$ddprun" --nproc-per-node 2 --grace-period 2 /bin/sh -c '
    echo $$ >"$0/pid.$LOCAL_RANK"
    : >/dev/shm/ddp-local-$$-0123456789abcdef
    : >"$0/made.$LOCAL_RANK"
    if [ "$LOCAL_RANK" = 1 ]; then
      while [ ! -e "$0/made.0" ]; do sleep 0.01; done
      kill -KILL $$
    fi
    sleep 30' "$tmp/pids" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  # Only this job's workers' segments count: one another run left behind
  # (a test killed midway) is not this ddprun's to remove.
  left=0
  for f in "$tmp"/pids/pid.*; do
    seg=/dev/shm/ddp-local-$(cat "$f")-0123456789abcdef
    [ -e "$seg" ] && left=$((left + 1))
    rm -f "$seg"
  done
  decoy_kept=0; [ -e "$decoy" ] && [ -e "$lookalike" ] && decoy_kept=1
  rm -f "$decoy" "$lookalike"
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "ddprun exited $rc (expected 1)"; }
  [ "$(ls "$tmp/pids" | grep -c '^pid\.')" -eq 2 ] || fail "not every worker wrote its pid"
  [ "$left" -eq 0 ] || { ls -la /dev/shm; fail "$left segments of dead workers left in /dev/shm"; }
  [ $decoy_kept -eq 1 ] || fail "a segment that was no dead worker's was removed"
  for r in 0 1; do
    grep -q "removed 1 shared-memory segment that worker pid $(cat "$tmp/pids/pid.$r") left" "$tmp/err" ||
      { cat "$tmp/err"; fail "no notice of worker $r's segment"; }
  done
  ;;
torch)
  py=${DDP_TORCH_PY:-/opt/torch-venv/bin/python}
  version=$("$py" -c 'import torch, torch.distributed; print(torch.__version__)' 2>/dev/null)
  case "$version" in
  [2-9].*) echo "torch $version at $py" ;;
  *) skip "no PyTorch 2.x at $py (scripts/install-deps.sh refs builds it; DDP_TORCH_PY to use another)" ;;
  esac
  PYTHON=$py timeout 120 "$ddprun" --nproc-per-node 2 "$here/torch_ddp_check.py" >"$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/out"; fail "the PyTorch DDP script exited $rc under ddprun"; }
  for r in 0 1; do
    grep -q "^torch_ddp_check rank $r/2 ok" "$tmp/out" || { cat "$tmp/out"; fail "rank $r did not finish"; }
  done
  ;;
bindings)
  # Each worker prints the CPUs the kernel lets it run on; ddprun's
  # --report-bindings lines must say the same.
  cpus=$(nproc) # the CPUs this process may use (its affinity mask)
  [ "$cpus" -ge 2 ] || skip "this process may use $cpus CPU: two workers cannot have CPUs of their own"
  [ -z "${SLURM_STEP_ID:-}${SLURM_CPU_BIND:-}" ] || skip "under srun, where Slurm's binding wins"
  allowed() { sed -n 's/^Cpus_allowed_list:[[:space:]]*//p' "${1:-/proc/self/status}"; }
  expand() { tr ',' '\n' <<<"$1" | while IFS=- read -r a b; do seq "$a" "${b:-$a}"; done; }
  mine=$(allowed)
  show='echo "worker $LOCAL_RANK cpus $(sed -n "s/^Cpus_allowed_list:[[:space:]]*//p" /proc/self/status) omp ${OMP_NUM_THREADS:-unset}"'
  run() { # ddprun options... -> $tmp/out (workers), $tmp/err (ddprun); fails on a non-zero exit
    timeout 30 env -u OMP_NUM_THREADS "$ddprun" --report-bindings "$@" sh -c "$show" >"$tmp/out" 2>"$tmp/err" ||
      { cat "$tmp/out" "$tmp/err"; fail "ddprun $* exited $?"; }
  }
  worker_cpus() { sed -n "s/^worker $1 cpus \([^ ]*\) .*/\1/p" "$tmp/out"; }
  reported() { sed -n "s/^ddprun: rank $1 (local rank $1, pid [0-9]*) bound to CPUs\{0,1\} \([0-9,-]*\) (.*/\1/p" "$tmp/err"; }
  # The default: two workers on CPUs of their own, as reported.
  run --nproc-per-node 2
  [ "$(grep -c ' bound to CPU' "$tmp/err")" -eq 2 ] || { cat "$tmp/err"; fail "not 2 workers reported bound"; }
  grep -q 'note:' "$tmp/err" && { cat "$tmp/err"; fail "a note with enough CPUs"; }
  for r in 0 1; do
    got=$(worker_cpus $r); said=$(reported $r)
    [ -n "$got" ] && [ "$got" = "$said" ] || { cat "$tmp/out" "$tmp/err"; fail "worker $r runs on CPUs '$got', ddprun said '$said'"; }
  done
  common=$(comm -12 <(expand "$(worker_cpus 0)" | sort) <(expand "$(worker_cpus 1)" | sort))
  [ -z "$common" ] || fail "workers 0 and 1 share CPUs $common"
  # On different cores too, where this process may use two cores (SMT
  # siblings are one core; a 2-vCPU VM may be one core's two threads).
  core_of() { cat "/sys/devices/system/cpu/cpu$1/topology/core_cpus_list" 2>/dev/null ||
              cat "/sys/devices/system/cpu/cpu$1/topology/thread_siblings_list" 2>/dev/null || echo "$1"; }
  cores=$(for c in $(expand "$mine"); do core_of "$c"; done | sort -u | wc -l)
  if [ "$cores" -ge 2 ]; then
    c0=$(for c in $(expand "$(worker_cpus 0)"); do core_of "$c"; done | sort -u)
    c1=$(for c in $(expand "$(worker_cpus 1)"); do core_of "$c"; done | sort -u)
    [ -z "$(comm -12 <(echo "$c0") <(echo "$c1"))" ] || fail "workers 0 and 1 share a core ($c0 / $c1)"
  else
    echo "note: CPUs $mine are one core's threads: the workers got a thread each, checked as CPUs only"
  fi
  # --bind none (and mpirun's spelling): unbound, where ddprun may run.
  for opt in "--bind none" "--bind-to=none"; do
    run $opt --nproc-per-node 2
    for r in 0 1; do
      [ "$(worker_cpus $r)" = "$mine" ] || { cat "$tmp/out"; fail "$opt: worker $r runs on CPUs $(worker_cpus $r), not $mine"; }
      grep -q "^ddprun: rank $r (local rank $r, pid [0-9]*) not bound (--bind none): may run on CPUs $mine\$" "$tmp/err" ||
        { cat "$tmp/err"; fail "$opt: rank $r not reported unbound"; }
    done
  done
  # Too few CPUs: unbound, and one note however many workers.
  n=$((cpus + 1))
  run --nproc-per-node "$n"
  [ "$(grep -c '^ddprun: note: .*leaving their placement to the scheduler$' "$tmp/err")" -eq 1 ] ||
    { cat "$tmp/err"; fail "not exactly one note for $n workers on $cpus CPUs"; }
  [ "$(grep -c " not bound ($n workers x 1 thread need $n CPUs, this process may use $cpus): may run on CPUs $mine\$" "$tmp/err")" -eq "$n" ] ||
    { cat "$tmp/err"; fail "$n workers not reported unbound"; }
  [ "$(grep -c "cpus $mine " "$tmp/out")" -eq "$n" ] || { cat "$tmp/out"; fail "a worker was bound with too few CPUs"; }
  # ... but --bind core refuses, naming the numbers.
  timeout 30 env -u OMP_NUM_THREADS "$ddprun" --bind core --nproc-per-node "$n" true >"$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 1 ] && grep -q -- "--bind core: $n workers x 1 thread need $n CPUs" "$tmp/out" ||
    { cat "$tmp/out"; fail "--bind core with too few CPUs exited $rc"; }
  # --threads N counts N CPUs per worker and sets OMP_NUM_THREADS=N.
  run --threads "$cpus" --nproc-per-node 2
  [ "$(grep -c "omp $cpus\$" "$tmp/out")" -eq 2 ] || { cat "$tmp/out"; fail "--threads $cpus: OMP_NUM_THREADS"; }
  grep -q "need $((2 * cpus)) CPUs" "$tmp/err" || { cat "$tmp/err"; fail "--threads $cpus: 2 workers x $cpus did not count"; }
  # Under srun Slurm's binding wins; the caller's own mask is the limit (taskset).
  SLURM_STEP_ID=3 run --nproc-per-node 2
  [ "$(grep -c "not bound (under srun: Slurm's binding (SLURM_STEP_ID=3)): may run on CPUs $mine\$" "$tmp/err")" -eq 2 ] ||
    { cat "$tmp/err"; fail "SLURM_STEP_ID: the workers were bound"; }
  grep -q 'note:' "$tmp/err" && fail "a note under srun"
  if command -v taskset >/dev/null; then
    first=$(expand "$mine" | head -n 1)
    timeout 30 taskset -c "$first" "$ddprun" --report-bindings --nproc-per-node 2 sh -c "$show" >"$tmp/out" 2>"$tmp/err" ||
      { cat "$tmp/err"; fail "taskset -c $first ddprun exited $?"; }
    [ "$(grep -c "cpus $first " "$tmp/out")" -eq 2 ] && grep -q "this process may use 1 (CPUs $first)" "$tmp/err" ||
      { cat "$tmp/out" "$tmp/err"; fail "under taskset -c $first"; }
  fi
  ;;
mayfail)
  # Rank 0 finishes 1.5 s after the others' failures; it writes done.0 only
  # if it was not stopped.
  job='case $RANK in 1) exit 3 ;; 2) kill -KILL $$ ;; *) sleep 1.5; touch "$0/done.$RANK" ;; esac'
  timeout 60 "$ddprun" --nproc-per-node 3 --may-fail 1,2 sh -c "$job" "$tmp" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 0 ] || { cat "$tmp/err"; fail "--may-fail 1,2: ddprun exited $rc, expected 0"; }
  [ -f "$tmp/done.0" ] || { cat "$tmp/err"; fail "--may-fail 1,2: rank 0 was stopped"; }
  grep -q 'rank 1 (local rank 1, pid [0-9]*) exited with code 3; the others go on (--may-fail)' "$tmp/err" &&
    grep -q 'rank 2 (local rank 2, pid [0-9]*) .*SIGKILL.*; the others go on (--may-fail)' "$tmp/err" &&
    grep -q 'the job finished; 2 workers failed and were let go (--may-fail)' "$tmp/err" ||
    { cat "$tmp/err"; fail "--may-fail 1,2: stderr does not name both let-go ranks"; }
  rm -f "$tmp/done.0"
  timeout 60 "$ddprun" --nproc-per-node 3 --grace-period 1 sh -c "$job" "$tmp" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 1 ] && [ ! -f "$tmp/done.0" ] || { cat "$tmp/err"; fail "without --may-fail: exit $rc (expected 1), rank 0 not stopped?"; }
  timeout 60 "$ddprun" --nproc-per-node 3 --grace-period 1 --may-fail 1 sh -c "$job" "$tmp" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  [ $rc -eq 1 ] && grep -q 'first failure: rank 2 ' "$tmp/err" ||
    { cat "$tmp/err"; fail "--may-fail 1 with rank 2 killed: exit $rc, expected 1 naming rank 2 first"; }
  for bad in 2-1 '1,,2' x -1 '1,'; do
    "$ddprun" --nproc-per-node 2 --may-fail "$bad" true >"$tmp/out" 2>"$tmp/err"
    rc=$?
    [ $rc -eq 2 ] && grep -q -- "--may-fail '$bad'" "$tmp/err" ||
      { cat "$tmp/err"; fail "--may-fail '$bad': exit $rc, expected 2 with a message naming it"; }
  done
  ;;
litter)
  # A rank exits on a usage error and ddprun stops the others, gathering
  # their flight recorders. Without DDP_DEBUG_DIR the dumps go to a run
  # directory under TMPDIR that the summary names, never to the working
  # directory; with it, there. First the issue's command (ddp-train --pp 3
  # at world 2: whether the other rank is still alive to dump is a race),
  # then flight_worker's rank 1 exiting 2 while rank 0 waits in an allreduce
  # (it always dumps).
  train=$bin/ddp-train
  fworker=$bin/../tests/flight_worker
  [ -x "$train" ] && [ -x "$fworker" ] || fail "$train or $fworker is not built"
  mkdir "$tmp/cwd" "$tmp/tmpdir" "$tmp/asked"
  (cd "$tmp/cwd" && env -u DDP_DEBUG_DIR TMPDIR="$tmp/tmpdir" timeout 60 "$ddprun" --nproc-per-node 2 \
    "$train" --pp 3 >"$tmp/out" 2>"$tmp/err")
  rc=$?
  [ $rc -ne 0 ] || { cat "$tmp/err"; fail "ddp-train --pp 3 at world 2: ddprun exited 0"; }
  [ -z "$(ls -A "$tmp/cwd")" ] || { cat "$tmp/err"; fail "ddp-train --pp 3: files left in the working directory: $(ls -A "$tmp/cwd")"; }
  (cd "$tmp/cwd" && env -u DDP_DEBUG_DIR TMPDIR="$tmp/tmpdir" DDP_TIMEOUT=30 timeout 60 "$ddprun" --nproc-per-node 2 \
    --rdzv-id litter "$fworker" --exit-rank 1 --at 3 >"$tmp/out" 2>"$tmp/err")
  rc=$?
  [ $rc -eq 1 ] || { cat "$tmp/err"; fail "flight_worker --exit-rank 1: ddprun exited $rc, expected 1"; }
  [ -z "$(ls -A "$tmp/cwd")" ] || { cat "$tmp/err"; fail "files left in the working directory: $(ls -A "$tmp/cwd")"; }
  run_dir=$(ls -d "$tmp"/tmpdir/ddp-debug-litter-* 2>/dev/null)
  [ -f "$run_dir/ddp-flight-rank0.json" ] ||
    { cat "$tmp/err"; ls -R "$tmp/tmpdir"; fail "rank 0's dump is not in TMPDIR/ddp-debug-<run id>-<pid>"; }
  grep -q "in $run_dir/ddp-flight-rank\*\.json" "$tmp/err" ||
    { cat "$tmp/err"; fail "the summary does not name the run directory of the dumps"; }
  (cd "$tmp/cwd" && DDP_DEBUG_DIR="$tmp/asked" TMPDIR="$tmp/tmpdir" DDP_TIMEOUT=30 timeout 60 "$ddprun" \
    --nproc-per-node 2 "$fworker" --exit-rank 1 --at 3 >"$tmp/out" 2>"$tmp/err")
  [ -z "$(ls -A "$tmp/cwd")" ] && [ -f "$tmp/asked/ddp-flight-rank0.json" ] ||
    { cat "$tmp/err"; ls "$tmp/cwd" "$tmp/asked"; fail "with DDP_DEBUG_DIR: the dump is not there, or the working directory is not empty"; }
  ;;
*) fail "unknown case $case_name" ;;
esac
echo "PASS: $case_name"
