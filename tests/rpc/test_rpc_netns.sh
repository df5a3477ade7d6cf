#!/usr/bin/env bash
# RPC between two "hosts": one worker in each of two network namespaces
# joined by a veth pair (tests/support/netns_pair.sh), meeting through a
# tcp:// rendezvous hosted by rank 0. Passes when bench_rpc's echo round trips
# (4 B, 64 KiB and 1 MiB, checked by bench_rpc: a wrong reply fails it) work
# and the transport between them is "tcp", with large tensors read across
# processes (the default) and with everything through TCP (DDP_RPC_NO_CMA=1).
# Needs root and `ip netns`; otherwise SKIP (exit 77). Every namespace and
# process is removed on every path.
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v tc >/dev/null || skip "no 'tc' command (iproute2)"
bench=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}/bench_rpc
[ -x "$bench" ] || fail "$bench is not built"
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
netns_pair_up rpct 10.97.0 10000

port=$((29600 + $$ % 300))
for cma in 0 1; do
  port=$((port + 1))
  for r in 0 1; do
    ns=$nsA; [ $r = 1 ] && ns=$nsB
    ip netns exec "$ns" env DDP_RPC_NO_CMA=$cma timeout 120 "$bench" --rank $r \
      --init "tcp://10.97.0.1:$port" --sizes 4,65536,1048576 --iters 50 >"$tmp/out$r" 2>"$tmp/err$r" &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  cat "$tmp/out0"
  [ $rc = 0 ] || fail "bench_rpc failed (DDP_RPC_NO_CMA=$cma): $(cat "$tmp/err0" "$tmp/err1")"
  [ "$(grep -c 'transport=tcp' "$tmp/out0")" = 3 ] || fail "expected 3 round trips over tcp"
done
echo "PASS"
