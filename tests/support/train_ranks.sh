# Sourced by the ddp-train tests that start ranks by hand (torchrun's
# variables set per process), after they define fail and set bin (the
# ddp-train binary), tmp (a scratch directory) and pids=() (killed by their
# cleanup). Every process runs under `timeout 180`.
#
# start N TAG ARGS...: N ranks in the background on a free port (pids in
#   $pids); rank r's stdout and stderr in $tmp/TAG.out.r and TAG.err.r.
# world N TAG ARGS...: start, then wait; every rank must exit 0.
# single TAG ARGS...: one process; stdout and stderr in $tmp/TAG.out, .err.
. "$(dirname "${BASH_SOURCE[0]}")/free_port.sh"

start() {
  local n=$1 tag=$2; shift 2
  local port; port=$(ddp_free_port) || fail "no free port"
  pids=()
  for ((r = 0; r < n; r++)); do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$n RANK=$r LOCAL_RANK=$r \
      LOCAL_WORLD_SIZE=$n timeout 180 "$bin" "$@" >"$tmp/$tag.out.$r" 2>"$tmp/$tag.err.$r" &
    pids+=($!)
  done
}

world() {
  local tag=$2
  start "$@"
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  [ $rc -eq 0 ] || { tail -n 5 "$tmp/$tag".err.*; fail "$tag: a rank exited $rc"; }
}

single() {
  local tag=$1; shift
  timeout 180 "$bin" "$@" >"$tmp/$tag.out" 2>"$tmp/$tag.err" ||
    { tail -n 5 "$tmp/$tag.err"; fail "$tag exited"; }
}
