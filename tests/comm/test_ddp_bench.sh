#!/usr/bin/env bash
# ddp-bench, end to end: --help names every flag; a small sweep of every op
# at 3 processes with -c 1 --json (several dtypes and reductions, sizes not
# divisible by the world) parses as JSON with the promised fields and counts
# no wrong element; the same through --threads; two ranks get a CPU each by
# default (--report-bindings); bad flags (and --bind core with more ranks
# than CPUs) exit 2 with a message. Needs python3 for the JSON (SKIP, exit 77, without it).
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

bench=${DDP_BIN_DIR:?set DDP_BIN_DIR to the build bin directory}/ddp-bench
[ -x "$bench" ] || fail "$bench is not built"
py=$(command -v python3) || skip "no python3 to parse the JSON rows"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --help lists every flag and every op.
"$bench" --help >"$tmp/help" || fail "--help exited $?"
for word in -b -e -f -i -o -d -r -n -w -c --nproc --threads --json --transport --timeout --bind --report-bindings --help \
    allreduce broadcast reduce allgather gather scatter reduce_scatter alltoall barrier sendrecv \
    sum prod min max avg float half bfloat16 double int32 int64 algbw busbw memeff; do
  grep -q -- "$word" "$tmp/help" || fail "--help does not mention $word"
done

# One JSON object per row, every promised field, 0 wrong, the sizes asked for.
check_rows() { # FILE OP DTYPE RANKS
  "$py" - "$@" <<'PY' || exit 1
import json, sys
path, op, dtype, ranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [json.loads(line) for line in open(path) if line.strip()]
if not rows:
    sys.exit(f"FAIL: {op} {dtype}: no rows")
for row in rows:
    for field in ("op", "size", "count", "dtype", "time_us", "algbw", "busbw", "wrong", "ranks"):
        if field not in row:
            sys.exit(f"FAIL: {op} {dtype}: row without '{field}': {row}")
    if row["op"] != op or row["dtype"] != dtype or row["ranks"] != ranks:
        sys.exit(f"FAIL: {op} {dtype}: row describes something else: {row}")
    if row["wrong"] != 0:
        sys.exit(f"FAIL: {op} {dtype}: {row['wrong']} wrong elements: {row}")
    if not (row["time_us"] > 0 and row["algbw"] >= 0 and row["busbw"] >= 0):
        sys.exit(f"FAIL: {op} {dtype}: bad figures: {row}")
    # time_us is printed to 0.001 us, algbw to 0.0001 GB/s
    tol = row["algbw"] * (1e-3 + 0.0006 / row["time_us"]) + 1e-4
    if op != "barrier" and row["size"] and abs(row["algbw"] - row["size"] / row["time_us"] / 1e3) > tol:
        sys.exit(f"FAIL: {op} {dtype}: algbw is not size / time: {row}")
print(f"ok: {op} {dtype} ({len(rows)} rows)")
PY
}

run() { # OP DTYPE RANKS ARGS...
  local op=$1 dtype=$2 ranks=$3
  shift 3
  timeout 120 "$bench" "$op" -b 24 -e 12345 -f 8 -n 3 -w 1 -c 1 --json --timeout 60 "$@" \
    >"$tmp/out" 2>"$tmp/err" || fail "$op $*: exited $? ($(cat "$tmp/err"))"
  check_rows "$tmp/out" "$op" "$dtype" "$ranks"
}

run allreduce float32 3 --nproc 3
run allreduce bfloat16 3 --nproc 3 -d bfloat16 -o avg
run allreduce int64 3 --nproc 3 -d int64 -o prod
run broadcast float64 3 --nproc 3 -d double -r 2
run reduce float16 3 --nproc 3 -d half -o max -r 1
run allgather int32 3 --nproc 3 -d int32
run gather float32 3 --nproc 3 -r 1
run scatter float16 3 --nproc 3 -d half -r 2
run reduce_scatter float32 3 --nproc 3 -o min
run alltoall int64 3 --nproc 3 -d int64
run sendrecv bfloat16 3 --nproc 3 -d bfloat16
run barrier float32 3 --nproc 3
run allreduce float32 3 --nproc 3 -b 3000000 -e 3000000 # past the staging chunks
run allreduce float32 4 --threads 4 -o sum
# --bind core needs a CPU per rank (exit 2 otherwise); by default each rank
# gets one when there are enough, as --report-bindings says.
if [ "$(nproc)" -ge 2 ]; then
  run allgather float64 2 --nproc 2 -d double --bind core
  run allreduce float32 2 --nproc 2 --report-bindings
  [ "$(grep -c '^ddp-bench: rank [01] (pid [0-9]*) bound to CPU' "$tmp/err")" -eq 2 ] ||
    fail "--report-bindings: not two ranks bound by default ($(cat "$tmp/err"))"
else
  echo "note: $(nproc) CPU: --bind core and the default binding not checked"
fi
run reduce_scatter bfloat16 4 --threads 4 -d bfloat16 -o sum
# shared memory gets a memory efficiency; tcp gets none
grep -q '"memeff":[0-9]' "$tmp/out" || fail "no memeff over shared memory: $(head -1 "$tmp/out")"
run allreduce float32 2 --nproc 2 --transport tcp
grep -q '"memeff":null' "$tmp/out" || fail "memeff given over tcp: $(head -1 "$tmp/out")"

# The table: a header and one line per size.
timeout 60 "$bench" allreduce --nproc 2 -b 8 -e 64 -f 2 -n 2 -w 1 >"$tmp/table" 2>&1 ||
  fail "table run exited $?: $(cat "$tmp/table")"
[ "$(grep -c '^ ' "$tmp/table")" = 4 ] || fail "expected 4 rows: $(cat "$tmp/table")"
grep -q 'busbw' "$tmp/table" || fail "no header: $(cat "$tmp/table")"

# A rank killed mid-run: the others fail naming it, and the parent reaps
# everyone and exits 1 within seconds, naming the killed rank.
if command -v pgrep >/dev/null; then
  "$bench" allreduce --nproc 3 -b 64K -e 64K -n 100000000 -c 0 --timeout 60 >"$tmp/out" 2>"$tmp/err" &
  parent=$!
  victim=""
  for _ in $(seq 100); do
    victim=$(pgrep -P "$parent" | sed -n 2p)
    [ -n "$victim" ] && grep -q . "$tmp/out" 2>/dev/null && break
    sleep 0.1
  done
  [ -n "$victim" ] || { kill -9 "$parent"; fail "no rank processes under ddp-bench"; }
  sleep 0.5
  kill -9 "$victim"
  start=$SECONDS
  wait "$parent"
  rc=$?
  [ $rc = 1 ] || fail "after a rank was killed ddp-bench exited $rc, not 1"
  [ $((SECONDS - start)) -le 20 ] || fail "ddp-bench took $((SECONDS - start)) s to notice a dead rank"
  grep -q "killed by signal 9" "$tmp/err" || fail "the killed rank is not named: $(cat "$tmp/err")"
  echo "ok: a killed rank fails the run ($((SECONDS - start)) s)"
else
  echo "SKIP (part): no pgrep to find the rank processes"
fi

# Bad usage: exit 2 and a message.
bad() {
  "$bench" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  [ $rc = 2 ] || fail "'ddp-bench $*' exited $rc, not 2"
  [ -s "$tmp/err" ] || fail "'ddp-bench $*' gave no message"
}
bad
bad frobnicate --nproc 2
bad allreduce --nproc 2 --bogus
bad allreduce --nproc 2 -d complex
bad allreduce --nproc 2 -o xor
bad allreduce --nproc 2 -d int32 -o avg
bad allreduce --nproc 2 -b 1Q
bad allreduce --nproc 2 -b 1M -e 1K
bad allreduce --nproc 2 -n 0
bad allreduce --nproc 2 -c 2
bad allreduce --nproc 2 -f 1
bad allreduce --nproc 2 --threads 2
bad allreduce --nproc 0
bad broadcast --nproc 2 -r 2
bad sendrecv --nproc 1
bad allreduce --nproc 2 --bind tile
bad allreduce --nproc "$(($(nproc) + 1))" --bind core # more ranks than CPUs
bad allreduce --nproc
echo "ok: bad usage exits 2"
echo PASS
