#!/usr/bin/env bash
# A real Slurm (Debian's slurmctld and slurmd) with a generated config in a
# private directory, for tests and for trying examples/slurm/: one node, or
# several nodes on this machine, each in a network namespace of its own.
#
#   dir=$(scripts/slurm-cluster.sh up [--owner PID] [--nodes N] [DIR])   # prints DIR
#   eval "$(scripts/slurm-cluster.sh env DIR)"                # export SLURM_CONF=DIR/slurm.conf
#   srun --immediate=30 -n 4 ./prog                            # one node
#   scripts/slurm-cluster.sh run DIR srun --immediate=30 -N 2 -n 4 ./prog   # N nodes
#   scripts/slurm-cluster.sh down DIR                          # stop everything, remove DIR
#
# --nodes N (2-8): nodes ddpn0..ddpn<N-1>, each a network namespace with its
# own address (10.79.0.1, .2, ...; node 0 holds a bridge the others' veth
# pairs join) and a slurmd; slurmctld runs in node 0's. Every daemon sees
# DIR/hosts as /etc/hosts (a private mount namespace), so the node names
# resolve in jobs as on a real cluster; `run DIR CMD...` runs CMD the same way
# in node 0 (srun, sbatch, sinfo must run there: the nodes are not reachable
# from this machine's own network). ddp tells the nodes apart by their
# network namespace (docs/cluster.md), so ranks on two nodes talk TCP.
#
# `up` writes DIR/slurm.conf (auth/none, no accounting, no cgroups, a node
# with 16 CPUs whatever the hardware has so 4-8 tasks run on 2 cores, free
# ports), starts both daemons and waits until sinfo shows the node idle
# (DDP_SLURM_UP_TIMEOUT seconds, default 60). Exit status: 0 up, 77 cannot
# run here (not root, no Slurm installed, daemons failed to start: the reason
# and the daemons' log tails go to stderr), 1 usage.
# `--owner PID` starts a watchdog that runs `down` when PID exits, so a test
# killed by its timeout still leaves no daemon behind.
# `down` cancels the jobs, stops the daemons (TERM, then KILL after 5 s), kills
# any job step or task left over (processes whose environment names this
# cluster) and removes DIR. docs/cluster.md explains the config.
set -uo pipefail

die() { echo "slurm-cluster: $*" >&2; exit 1; }
cannot() { echo "slurm-cluster: cannot run Slurm here: $*" >&2; exit 77; }

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 1
}

# A TCP port nobody listens on, from a random start in 20000..59999; two calls
# can return the same port, so callers pass the ones they already took.
free_port() {
  local taken=" $* " p tries
  for tries in $(seq 1 200); do
    # below the ephemeral range (32768-60999), so no connect() takes it meanwhile
    p=$((10000 + (RANDOM * 32768 + RANDOM) % 22000))
    case "$taken" in *" $p "*) continue ;; esac
    if ! ss -Htln "sport = :$p" 2>/dev/null | grep -q .; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

# Pids of processes (not this shell or its ancestors) whose environment
# carries DDP_SLURM_CLUSTER=<dir> (the daemons and their job steps) or
# SLURM_CONF=<dir>/slurm.conf (tasks started through this cluster).
cluster_pids() {
  local dir=$1 keep=" " p=$$ e
  while [ -n "$p" ] && [ "$p" != 0 ] && [ "$p" != 1 ]; do
    keep+="$p "
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)
  done
  for e in /proc/[0-9]*/environ; do
    p=${e#/proc/}
    p=${p%/environ}
    case "$keep" in *" $p "*) continue ;; esac
    if tr '\0' '\n' 2>/dev/null <"$e" |
      grep -qxF -e "DDP_SLURM_CLUSTER=$dir" -e "SLURM_CONF=$dir/slurm.conf"; then
      echo "$p"
    fi
  done
}

# Sends TERM to the pids, waits up to $2 s for them to go, then KILLs.
stop_pids() {
  local pids=$1 grace=$2 p alive i
  [ -z "$pids" ] && return 0
  kill -TERM $pids 2>/dev/null
  for i in $(seq 1 $((grace * 10))); do
    alive=""
    for p in $pids; do kill -0 "$p" 2>/dev/null && alive+="$p "; done
    [ -z "$alive" ] && return 0
    sleep 0.1
  done
  kill -KILL $alive 2>/dev/null
  sleep 0.2
}

cmd_down() {
  local dir=${1:?down needs the cluster directory}
  dir=$(cd "$dir" 2>/dev/null && pwd) || return 0 # already gone
  [ -f "$dir/slurm.conf" ] || die "down: $dir is not a cluster directory (no slurm.conf)"
  # The watchdog first, unless it is the one calling.
  local w
  w=$(cat "$dir/watchdog.pid" 2>/dev/null)
  if [ -n "$w" ] && [ "$w" != "$$" ] && [ "$w" != "${DDP_SLURM_WATCHDOG:-}" ]; then
    kill -TERM "$w" 2>/dev/null
  fi
  if [ -f "$dir/up" ]; then
    # Jobs first, through Slurm, so job steps end their tasks themselves.
    SLURM_CONF=$dir/slurm.conf timeout 10 scancel --quiet --full --signal=KILL --user=root \
      >/dev/null 2>&1
    local i
    for i in $(seq 1 30); do
      [ -z "$(SLURM_CONF=$dir/slurm.conf timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local pids
  pids="$(cat "$dir"/slurmd*.pid "$dir/slurmctld.pid" 2>/dev/null | tr '\n' ' ')"
  stop_pids "$pids" 5
  stop_pids "$(cluster_pids "$dir" | tr '\n' ' ')" 2
  # Deleting a namespace removes its veth ends (and node 0's bridge).
  local ns
  for ns in $(cat "$dir/netns" 2>/dev/null); do ip netns del "$ns" 2>/dev/null; done
  rm -rf "$dir"
}

# Runs "$@" in node I's network namespace with DIR/hosts as /etc/hosts.
in_node() {
  local dir=$1 i=$2
  shift 2
  local ns
  ns=$(sed -n "$((i + 1))p" "$dir/netns")
  [ -n "$ns" ] || die "no node $i in $dir"
  exec nsenter --net="/run/netns/$ns" unshare --mount --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$dir/hosts" "$@"
}

cmd_run() {
  local dir=${1:?run needs the cluster directory}
  shift
  [ $# -gt 0 ] || die "run needs a command"
  dir=$(cd "$dir" && pwd) || die "run: no directory $1"
  if [ ! -f "$dir/netns" ]; then
    SLURM_CONF=$dir/slurm.conf exec "$@" # one node: nothing to enter
  fi
  SLURM_CONF=$dir/slurm.conf in_node "$dir" 0 "$@"
}

# Network namespaces for N nodes (see the header), named after this shell's
# pid; their names go to DIR/netns, one a line, node 0 first; DIR/hosts gets
# their addresses and the names ddpn<i>, with this host's name on node 0 (the
# controller's name must be the host's). Namespaces of an earlier cluster
# that no process is in any more (a cluster killed before its `down`) go first.
make_nodes() {
  local dir=$1 n=$2 host=$3 i ns br=ds$$br
  # (The `up` that made one, named in it, must be gone too: while it runs,
  # its namespaces may not have their daemons yet.)
  local owner
  for ns in $(ip netns list 2>/dev/null | sed -n 's/^\(ddpsl[0-9][0-9]*n[0-9]\)\b.*/\1/p'); do
    owner=${ns#ddpsl}
    owner=${owner%n*}
    kill -0 "$owner" 2>/dev/null && continue
    [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && ip netns del "$ns" 2>/dev/null
  done
  # Namespaces made so far go again when one step fails.
  nodes_fail() {
    local made
    for made in $(cat "$dir/netns"); do ip netns del "$made" 2>/dev/null; done
    rm -f "$dir/netns"
    cannot "$@"
  }
  : >"$dir/netns"
  printf '127.0.0.1 localhost\n' >"$dir/hosts"
  for i in $(seq 0 $((n - 1))); do
    ns=ddpsl$$n$i
    ip netns add "$ns" 2>"$dir/log/netns.err" || nodes_fail "ip netns add failed: $(cat "$dir/log/netns.err")"
    echo "$ns" >>"$dir/netns"
    ip -n "$ns" link set lo up || nodes_fail "lo up in $ns"
    if [ "$i" = 0 ]; then
      ip -n "$ns" link add "$br" type bridge 2>"$dir/log/netns.err" ||
        nodes_fail "cannot create a bridge: $(cat "$dir/log/netns.err")"
      ip -n "$ns" addr add 10.79.0.1/24 dev "$br" && ip -n "$ns" link set "$br" up ||
        nodes_fail "bridge address"
      printf '10.79.0.1 ddpn0 %s\n' "$host" >>"$dir/hosts"
    else
      local va=ds$$a$i vb=ds$$b$i first
      first=$(head -1 "$dir/netns")
      ip link add "$va" type veth peer name "$vb" 2>"$dir/log/netns.err" ||
        nodes_fail "cannot create a veth pair: $(cat "$dir/log/netns.err")"
      ip link set "$va" netns "$first" && ip link set "$vb" netns "$ns" || nodes_fail "moving veth ends"
      ip -n "$first" link set "$va" master "$br" && ip -n "$first" link set "$va" up || nodes_fail "bridge port"
      ip -n "$ns" addr add "10.79.0.$((i + 1))/24" dev "$vb" && ip -n "$ns" link set "$vb" up ||
        nodes_fail "veth address"
      printf '10.79.0.%d ddpn%d\n' $((i + 1)) "$i" >>"$dir/hosts"
    fi
  done
}

cmd_env() {
  local dir=${1:?env needs the cluster directory}
  dir=$(cd "$dir" && pwd) || die "env: no directory $1"
  echo "export SLURM_CONF=$dir/slurm.conf"
}

write_conf() {
  local dir=$1 host=$2 ctld_port=$3 slurmd_port=$4 nodes=$5
  # FirstJobId is random: ddp derives MASTER_PORT from SLURM_JOB_ID under
  # Slurm, and a fresh cluster would otherwise start every run at job 1.
  cat >"$dir/slurm.conf" <<EOF
# Generated by scripts/slurm-cluster.sh: a test cluster, no security.
ClusterName=ddptest
SlurmctldHost=$host$([ "$nodes" -gt 1 ] && echo "(10.79.0.1)")
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
# No munge: every message is trusted. Only for a private test cluster.
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
# %n: the node's name, so that several slurmd on this machine keep apart.
SlurmdSpoolDir=$dir/spool/%n
# The nodes' temporary file systems apart too: Slurm's PMIx plugin (srun
# --mpi=pmix) makes each step's client directory under it, whose name has no
# node in it, so a shared /tmp collides between two nodes of this machine.
TmpFS=$dir/tmp/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (containers rarely allow them): tasks are tracked by process group.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node below claims more CPUs than the machine has; config_overrides makes
# slurmd believe the config instead of draining the node as "low CPU count".
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId=$((1 + RANDOM % 30000))
InactiveLimit=0
KillWait=5
MinJobAge=4
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
$(node_lines "$host" "$nodes")
EOF
}

# The NodeName and PartitionName lines: one node on loopback named after this
# host, or ddpn0..ddpn<N-1> at 10.79.0.1.. (the namespaces' addresses).
node_lines() {
  local host=$1 nodes=$2 i
  if [ "$nodes" = 1 ]; then
    echo "NodeName=$host NodeAddr=127.0.0.1 CPUs=16 RealMemory=1000 State=UNKNOWN"
  else
    for i in $(seq 0 $((nodes - 1))); do
      echo "NodeName=ddpn$i NodeAddr=10.79.0.$((i + 1)) CPUs=8 RealMemory=1000 State=UNKNOWN"
    done
  fi
  echo "# MaxTime: no test job can outlive 10 minutes, whatever it does."
  if [ "$nodes" = 1 ]; then
    echo "PartitionName=debug Nodes=$host Default=YES MaxTime=10 State=UP"
  else
    echo "PartitionName=debug Nodes=ddpn[0-$((nodes - 1))] Default=YES MaxTime=10 State=UP"
  fi
}

cmd_up() {
  local owner="" dir="" nodes=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --owner) owner=${2:?--owner needs a pid}; shift 2 ;;
      --nodes) nodes=${2:?--nodes needs a count}; shift 2 ;;
      -h | --help) usage ;;
      -*) die "up: unknown option $1" ;;
      *) dir=$1; shift ;;
    esac
  done
  [ "$(id -u)" = 0 ] || cannot "needs root (slurmd runs jobs as their user and must be root)"
  local t
  for t in slurmctld slurmd sinfo srun sbatch scancel squeue; do
    command -v "$t" >/dev/null || cannot "no '$t' (scripts/install-deps.sh slurm installs it)"
  done
  command -v ss >/dev/null || cannot "no 'ss' (iproute2) to find free ports"
  case "$nodes" in [1-8]) ;; *) die "up: --nodes must be 1 to 8, not '$nodes'" ;; esac
  if [ "$nodes" -gt 1 ]; then
    for t in ip nsenter unshare; do
      command -v "$t" >/dev/null || cannot "no '$t' for the nodes' network namespaces"
    done
  fi
  if [ -z "$dir" ]; then
    dir=$(mktemp -d /tmp/ddp-slurm.XXXXXX) || die "mktemp failed"
  else
    mkdir -p "$dir" || die "cannot create $dir"
  fi
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  local host ctld_port slurmd_port names i name
  host=$(hostname -s)
  if [ "$nodes" = 1 ]; then
    ctld_port=$(free_port) && slurmd_port=$(free_port "$ctld_port") || die "no free port found"
    names=$host
  else
    # Nothing else listens in the nodes' namespaces: Slurm's usual ports.
    ctld_port=6817 slurmd_port=6818
    names=$(seq -f 'ddpn%g' 0 $((nodes - 1)))
    make_nodes "$dir" "$nodes" "$host"
  fi
  for name in $names; do mkdir -p "$dir/spool/$name" "$dir/tmp/$name"; done
  write_conf "$dir" "$host" "$ctld_port" "$slurmd_port" "$nodes"
  export SLURM_CONF=$dir/slurm.conf

  # The marker in the daemons' environment lets `down` find their job steps.
  # -D: stay in the foreground (we hold the pid); -i: ignore old state.
  # start_daemon NODE NAME CMD...: in node NODE's namespaces when there are
  # several nodes. The daemons write their own pid files; until they do, ours.
  start_daemon() {
    local node=$1 name=$2
    shift 2
    if [ "$nodes" = 1 ]; then
      DDP_SLURM_CLUSTER=$dir setsid "$@" >"$dir/log/$name.out" 2>&1 </dev/null &
    else
      (DDP_SLURM_CLUSTER=$dir in_node "$dir" "$node" setsid "$@") >"$dir/log/$name.out" 2>&1 </dev/null &
    fi
    echo $! >"$dir/$name.pid.start"
    cp "$dir/$name.pid.start" "$dir/$name.pid" 2>/dev/null
  }
  start_daemon 0 slurmctld slurmctld -D -i -f "$SLURM_CONF"
  i=0
  for name in $names; do
    start_daemon "$i" "slurmd-$name" slurmd -D -f "$SLURM_CONF" -N "$name"
    i=$((i + 1))
  done
  touch "$dir/up"

  if [ -n "$owner" ]; then
    (
      export DDP_SLURM_WATCHDOG=$BASHPID
      trap '' HUP INT
      while kill -0 "$owner" 2>/dev/null && [ -d "$dir" ]; do sleep 1; done
      [ -d "$dir" ] && "$0" down "$dir"
    ) </dev/null >/dev/null 2>&1 &
    echo $! >"$dir/watchdog.pid"
  fi

  local limit=${DDP_SLURM_UP_TIMEOUT:-60} start=$SECONDS state="" why="" f
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    for f in "$dir"/*.pid.start; do
      kill -0 "$(cat "$f")" 2>/dev/null || why="$(basename "$f" .pid.start) exited"
    done
    [ -n "$why" ] && break
    # The nodes' states, each once: "idle " alone once every node is up.
    state=$(timeout 5 "$0" run "$dir" sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ')
    case "$state" in
      "idle ") echo "$dir"; return 0 ;;
      *drain* | *drng* | *down* | *fail* | *inval*) why="node states are '$state'"; break ;;
    esac
    sleep 0.2
  done
  [ -z "$why" ] && why="nodes not idle after ${limit} s (states '${state:-none}')"
  {
    echo "slurm-cluster: $why; sinfo says: $(timeout 5 "$0" run "$dir" sinfo -h -N -o '%N %t %E' 2>&1 | head -8)"
    for f in "$dir"/log/*; do
      [ -s "$f" ] && { echo "--- tail of ${f##*/}"; tail -n 15 "$f"; }
    done
  } >&2
  cmd_down "$dir"
  cannot "$why"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) shift; cmd_down "$@" ;;
  env) shift; cmd_env "$@" ;;
  run) shift; cmd_run "$@" ;;
  *) usage ;;
esac
