#!/usr/bin/env bash
# RPC round trips, ddp against PyTorch's torch.distributed.rpc (TensorPipe),
# measured in the same go: the median round trip of rpc_sync echoing one
# float32 tensor of 4 B and 1 MiB between 2 workers.
#   ddp:     bench_rpc --sizes 4,1048576 --iters N            (bench/bench_rpc.c)
#   PyTorch: python ../shared/refs/torch_rpc_latency.py --sizes 4,1048576 --iters N
# Rounds alternate the sides (ddp first in odd rounds); each side's figure is
# the median of its rounds' medians; the ratio is PyTorch / ddp.
#   scripts/bench-rpc.sh [local|netns] [rounds=5] [iters=1000]
# local: both workers on this host (ddp: Unix sockets and cross-memory attach).
# netns: one worker in each of two network namespaces joined by a veth pair
# (tests/support/netns_pair.sh; shaped to BENCH_RATE_MBIT, default 100000,
# i.e. not limiting), so both sides go over TCP; PyTorch then runs the same
# loop as the reference (its echo, 100 warm-up calls, the median of N) from
# a copy that takes --rank and the master's address, one worker per
# namespace; each side runs a second time with large tensors forced through
# TCP (both ddp's cross-memory attach and TensorPipe's CMA channel work
# between network namespaces of one machine). Needs root; every namespace
# and process is removed on exit.
# Env: BENCH_BIN (default build/bin), TORCH_PY (default /opt/torch-venv/bin/python),
# DDP_SHARED_DIR (where refs/ is; default ../shared).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-local}
rounds=${2:-5}
iters=${3:-1000}
bin=${BENCH_BIN:-build/bin}
py=${TORCH_PY:-/opt/torch-venv/bin/python}
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_rpc_latency.py
die() { echo "bench-rpc: $*" >&2; exit 2; }
skip() { echo "bench-rpc: SKIP: $*" >&2; exit 77; }
fail() { die "$@"; }
[ -x "$bin/bench_rpc" ] || die "$bin/bench_rpc is not built (BENCH_BIN=...)"
[ -f "$ref" ] || die "no $ref"
tmp=$(mktemp -d)
pids=()
nsA='' nsB=''
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [ "$mode" = netns ]; then netns_pair_down; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

version=$("$py" -c 'import torch, torch.distributed.rpc as r; print(torch.__version__, "rpc.is_available() =", r.is_available())' 2>/dev/null) ||
  die "$py cannot import torch"
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $(uname -r); PyTorch $version; mode $mode, $rounds rounds x $iters calls"

# The reference's loop with --rank and --master (for the namespaces).
cat >"$tmp/torch_rpc_worker.py" <<'EOF'
import argparse, os, time
import torch, torch.distributed.rpc as rpc
def echo(x):
    return x
p = argparse.ArgumentParser()
p.add_argument("--rank", type=int); p.add_argument("--master"); p.add_argument("--port", type=int)
p.add_argument("--iters", type=int, default=2000); p.add_argument("--threads", type=int, default=4)
p.add_argument("--channels", default="")
p.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[4, 1048576])
a = p.parse_args()
os.environ["MASTER_ADDR"] = a.master; os.environ["MASTER_PORT"] = str(a.port)
kw = {"_channels": a.channels.split(",")} if a.channels else {}
opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=a.threads, **kw)
rpc.init_rpc(f"w{a.rank}", rank=a.rank, world_size=2, rpc_backend_options=opts)
if a.rank == 0:
    for nbytes in a.sizes:
        t = torch.ones(max(1, nbytes // 4))
        for _ in range(100):
            rpc.rpc_sync("w1", echo, args=(t,))
        times = []
        for _ in range(a.iters):
            s = time.perf_counter(); rpc.rpc_sync("w1", echo, args=(t,)); times.append(time.perf_counter() - s)
        times.sort()
        print(f"torch {torch.__version__} rpc_sync round trip bytes={nbytes} us={times[len(times) // 2] * 1e6:.1f}", flush=True)
rpc.shutdown()
EOF

if [ "$mode" = netns ]; then
  [ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
  . tests/support/netns_pair.sh
  netns_pair_up rpcb 10.98.0 "${BENCH_RATE_MBIT:-100000}"
fi

port=$((30000 + $$ % 2000))
# One run of a side; appends "side bytes us" lines to $tmp/results.
run_side() {
  local side=$1
  local out=$tmp/out.$side
  port=$((port + 1))
  if [ "$mode" = local ]; then
    if [ "$side" = ddp ]; then
      timeout 300 "$bin/bench_rpc" --sizes 4,1048576 --iters "$iters" --port "$port" >"$out" 2>"$tmp/err" ||
        { cat "$tmp/err" >&2; die "bench_rpc failed"; }
    else
      timeout 300 "$py" "$ref" --sizes 4,1048576 --iters "$iters" --port "$port" >"$out" 2>"$tmp/err" ||
        { tail -n 5 "$tmp/err" >&2; die "$ref failed"; }
    fi
  else
    local cmd0 cmd1 extra=() envs=()
    case $side in
      ddp-tcp) envs=(DDP_RPC_NO_CMA=1) ;;
      torch-tcp) extra=(--channels basic) ;;
    esac
    if [ "${side%-tcp}" = ddp ]; then
      cmd0=(env "${envs[@]}" "$bin/bench_rpc" --rank 0 --init "tcp://10.98.0.1:$port" --sizes 4,1048576 --iters "$iters")
      cmd1=(env "${envs[@]}" "$bin/bench_rpc" --rank 1 --init "tcp://10.98.0.1:$port" --sizes 4,1048576 --iters "$iters")
    else
      # Gloo (under init_rpc) and TensorPipe resolve the hostname otherwise,
      # which gives 127.0.0.1 here: name the veth ends.
      cmd0=(env GLOO_SOCKET_IFNAME="$vA" TP_SOCKET_IFNAME="$vA" "$py" "$tmp/torch_rpc_worker.py" --rank 0 --master 10.98.0.1 --port "$port" --sizes 4,1048576 --iters "$iters" "${extra[@]}")
      cmd1=(env GLOO_SOCKET_IFNAME="$vB" TP_SOCKET_IFNAME="$vB" "$py" "$tmp/torch_rpc_worker.py" --rank 1 --master 10.98.0.1 --port "$port" --sizes 4,1048576 --iters "$iters" "${extra[@]}")
    fi
    ip netns exec "$nsA" timeout 300 "${cmd0[@]}" >"$out" 2>"$tmp/err0" &
    pids+=($!)
    ip netns exec "$nsB" timeout 300 "${cmd1[@]}" >/dev/null 2>"$tmp/err1" &
    pids+=($!)
    local rc=0 p
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    pids=()
    [ $rc = 0 ] || { tail -n 5 "$tmp/err0" "$tmp/err1" >&2; die "$side failed in the namespaces"; }
  fi
  sed -n 's/.*round trip bytes=\([0-9]*\) us=\([0-9.]*\).*/'"$side"' \1 \2/p' "$out" | tee -a "$tmp/results"
}

# netns: each side also with large tensors through TCP (ddp: DDP_RPC_NO_CMA=1;
# PyTorch: TensorPipe's channels limited to "basic", since its CMA channel,
# like ddp's cross-memory attach, works between network namespaces of one
# machine).
pairs=("ddp torch")
[ "$mode" = netns ] && pairs+=("ddp-tcp torch-tcp")
for ((r = 1; r <= rounds; r++)); do
  echo "# round $r, load $(cut -d' ' -f1-3 /proc/loadavg)"
  for pair in "${pairs[@]}"; do
    set -- $pair
    if ((r % 2)); then run_side "$1"; run_side "$2"; else run_side "$2"; run_side "$1"; fi
  done
done

python3 - "$tmp/results" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
print("| path | bytes | ddp median us | PyTorch median us | PyTorch / ddp |")
print("|---|---|---|---|---|")
for suffix, path in (("", "default"), ("-tcp", "tensors through TCP")):
    for b in sorted({int(r[1]) for r in rows}):
        d = [float(r[2]) for r in rows if r[0] == "ddp" + suffix and int(r[1]) == b]
        t = [float(r[2]) for r in rows if r[0] == "torch" + suffix and int(r[1]) == b]
        if d and t:
            d, t = statistics.median(d), statistics.median(t)
            print(f"| {path} | {b} | {d:.1f} | {t:.1f} | {t / d:.1f}x |")
EOF
