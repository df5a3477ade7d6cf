#!/usr/bin/env bash
# Transports chosen per pair between real network namespaces: two namespaces
# joined by a veth pair (shaped to 1 Gbit/s with tbf), two rank processes in
# each (ranks 0, 1 in A; 2, 3 in B; rank 0 hosts the store). DDP_HOST_ID is
# NOT set: the ranks tell the hosts apart by their network namespace alone.
# A 16 MiB float32 allreduce a few times through the public API
# (bench_tcp_allreduce --counters), then every rank reports its transport
# towards each rank and what each transport carried. Passes when
#   - results are right;
#   - transports are "shm" inside a namespace and "tcp" across;
#   - ranks 1 and 3 (not their host's leader) sent and received no TCP byte
#     and moved their data through shared memory; ranks 0 and 2 carried the
#     traffic between the namespaces over TCP.
# The algorithm bandwidth is printed (the link carries N bytes each way per
# N-byte allreduce, the least any algorithm needs between 2 hosts).
# Needs root and `ip netns`; otherwise SKIP (exit 77). Names carry this
# shell's PID, so parallel runs do not collide; every namespace and process
# is removed on every path.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v tc >/dev/null || skip "no 'tc' command (iproute2)"
bench=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}/bench_tcp_allreduce
[ -x "$bench" ] || fail "$bench is not built"

bytes=${DDP_NETNS_BYTES:-16M}
tmp=$(mktemp -d)
. "$(dirname "$0")/../support/netns_pair.sh"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  netns_pair_down
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
netns_pair_up ddph 10.98.0 1000

store=10.98.0.1:29611
common=(--world 4 --store "$store" -b "$bytes" -e "$bytes" -n 3 -w 1 -c 1 --json --counters)
unset DDP_HOST_ID
for r in 0 1 2 3; do
  ns=$nsA
  [ $r -ge 2 ] && ns=$nsB
  extra=()
  [ $r = 0 ] && extra=(--serve)
  ip netns exec "$ns" timeout 120 "$bench" --rank $r "${extra[@]}" "${common[@]}" \
    >"$tmp/out$r" 2>"$tmp/err$r" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
pids=()
[ $rc = 0 ] || fail "a rank failed: $(cat "$tmp"/err*)"

field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p" <<<"$2"; }
line=$(grep '"op":"allreduce"' "$tmp/out0" | tail -1)
[ -n "$line" ] || fail "no result line from rank 0"
[ "$(field check "$line")" = true ] || fail "wrong allreduce results"
echo "allreduce $bytes, 4 ranks on 2 namespaces: algbw $(field algbw "$line") GB/s (link: 0.125 GB/s each way)"

want=("self,shm,tcp,tcp" "shm,self,tcp,tcp" "tcp,tcp,self,shm" "tcp,tcp,shm,self")
for r in 0 1 2 3; do
  c=$(grep '"transports"' "$tmp/out$r")
  [ -n "$c" ] || fail "rank $r printed no counters"
  echo "rank $r: $c"
  t=$(sed -n 's/.*"transports":"\([^"]*\)".*/\1/p' <<<"$c")
  [ "$t" = "${want[$r]}" ] || fail "rank $r's transports are $t, want ${want[$r]}"
  sent=$(sed -n 's/.*"tcp_bytes_sent":\([0-9]*\).*/\1/p' <<<"$c")
  recvd=$(sed -n 's/.*"tcp_bytes_received":\([0-9]*\).*/\1/p' <<<"$c")
  shm=$(sed -n 's/.*"shm_bytes":\([0-9]*\).*/\1/p' <<<"$c")
  [ "$shm" -gt 0 ] || fail "rank $r moved nothing through shared memory"
  if [ $r = 1 ] || [ $r = 3 ]; then
    [ "$sent" = 0 ] && [ "$recvd" = 0 ] ||
      fail "rank $r is not its host's leader, yet sent $sent and received $recvd TCP bytes"
  else
    # 5 allreduces of $bytes (1 warm-up, 3 timed, 1 checked): each leader
    # sends at least half of each over the link.
    [ "$sent" -gt $((5 * $(numfmt --from=iec "$bytes") / 2)) ] ||
      fail "leader rank $r sent only $sent TCP bytes"
  fi
done
echo PASS
