#!/usr/bin/env bash
# A search survives a killed rank: under ddprun --max-restarts 1, ddp-hpo
# with --checkpoint --resume on 2 workers (sphere, each evaluation slowed to
# 3 ms); one worker is SIGKILLed mid-search; ddprun names it and restarts
# the group, both workers resume from their journals, and the search
# completes with exactly 2 x 400 evaluations: every (worker, generation)
# once in rank 0's final population and once among the journals' own
# evaluations, none lost, none twice. Then a resume with other options is
# refused naming the difference.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}/ddp-hpo
ddprun=${DDP_BIN_DIR}/ddprun
py=$(command -v python3) || { echo "SKIP: no python3"; exit 77; }
tmp=$(mktemp -d)
job=""
cleanup() { [ -n "$job" ] && kill "$job" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
unset WORLD_SIZE RANK DDP_STORE_ADDR
export DDP_TIMEOUT=30
G=400
args=(--objective sphere --generations $G --eval-delay-ms 3 --checkpoint "$tmp/ckpt" --resume
      --checkpoint-interval 0.05 --log "$tmp/log.jsonl" --json)
timeout 120 "$ddprun" --max-restarts 1 --nproc-per-node 2 "$bin" "${args[@]}" >"$tmp/out" 2>"$tmp/err" &
job=$!
# Once worker 1 has committed a while, kill it.
for _ in $(seq 200); do
  [ "$(stat -c %s "$tmp/ckpt/worker-1.journal" 2>/dev/null || echo 0)" -gt 20000 ] && break
  sleep 0.05
done
victim=$(pgrep -f -- "ddp-hpo --objective sphere --generations $G" | while read -r p; do
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx 'RANK=1' && echo "$p"; done | head -n 1)
[ -n "$victim" ] || fail "no worker with RANK=1 to kill"
kill -KILL "$victim"
wait "$job"; rc=$?; job=""
[ $rc = 0 ] || { tail -n 20 "$tmp/err"; fail "the restarted search exited $rc"; }
grep -q "rank 1.*signal 9\|rank 1.*SIGKILL\|rank 1.*killed" "$tmp/err" || { cat "$tmp/err"; fail "ddprun did not name the killed rank"; }
grep -q "restart" "$tmp/err" || { cat "$tmp/err"; fail "ddprun did not restart"; }
"$py" - "$tmp/log.jsonl" "$tmp/out" "$tmp/ckpt" $G <<'PY' || fail "evaluations lost or doubled"
import glob, json, struct, sys
log_path, out_path, ckpt, G = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
summary = json.loads(open(out_path).read().splitlines()[-1])
assert summary["evaluations"] == 2 * G, summary
own = [(r["worker"], r["generation"]) for r in map(json.loads, open(log_path))]
assert sorted(own) == [(w, g) for w in (0, 1) for g in range(G)], "rank 0's population"
traits = 2
rec = 16 + 8 + 20 + 24 + 8 * traits
commit = 4 + 4 + 8 + 624 * 4 + 4 + 4 + 8
for w in (0, 1):
    data = open(f"{ckpt}/worker-{w}.journal", "rb").read()
    at, gens = 0, []
    while at < len(data):
        magic, = struct.unpack_from("<I", data, at)
        if magic == 0x43504844:  # commit
            at += commit
            continue
        assert magic == 0x32504844, (w, at, hex(magic))
        kind, = struct.unpack_from("<I", data, at + 4)
        gen, = struct.unpack_from("<q", data, at + 16)
        worker, island, current, steps, active = struct.unpack_from("<5i", data, at + 24)
        if kind == 1 and worker == w and steps == 0:
            gens.append(gen)
        at += rec
    assert at == len(data), (w, at, len(data))
    assert sorted(gens) == list(range(G)), (w, len(gens), len(set(gens)))
print("ok: 2 x", G, "evaluations, each once")
PY
echo "ok a killed worker: ddprun restarted the group, the search resumed and completed"
"$bin" --objective sphere --generations $G --pop-size 6 --checkpoint "$tmp/ckpt" --resume >/dev/null 2>"$tmp/e2"
rc=$?
[ $rc = 1 ] && grep -q "'workers=2' (saved) against 'workers=1' (now)\|'pop_size=4' (saved) against 'pop_size=6' (now)" "$tmp/e2" \
  || { cat "$tmp/e2"; fail "resume with other options: exit $rc"; }
echo "ok a resume with other options refused, naming the difference"
echo "all passed"
