#!/usr/bin/env bash
# Seed 003's one-line change (examples/data_parallel.c), checked by what it
# prints: the loop with DataParallel over 2 replicas and SyncBatchNorm ends
# at the loss of the same loop on the model alone (the same mathematics,
# summed in another order: within 1e-4 after 10 steps, seen equal to 6
# digits; the default batch-norm rule, other mathematics, ends 1e-3 away),
# the default rule runs,
# and a batch smaller than the replicas is refused with a message that
# says so. A timeout on every run.
set -uo pipefail
fail() { echo "FAIL: $*"; exit 1; }
bin=${DDP_BIN_DIR:?}
[ -x "$bin/data_parallel" ] || fail "$bin/data_parallel is not built"
final() { sed -n 's/.*final loss \([0-9.]*\)$/\1/p'; }
plain=$(timeout 120 "$bin/data_parallel" --replicas 0 --steps 10 | final)
synced=$(timeout 120 "$bin/data_parallel" --replicas 2 --sync-bn --steps 10 | final)
[ -n "$plain" ] && [ -n "$synced" ] || fail "no final loss (plain '$plain', 2 replicas '$synced')"
awk -v a="$synced" -v b="$plain" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * b + 1e-5) }' ||
  fail "2 replicas with SyncBatchNorm end at loss $synced, the model alone at $plain"
echo "the model alone: final loss $plain; 2 replicas with SyncBatchNorm: $synced: ok"
rule=$(timeout 120 "$bin/data_parallel" --replicas 2 --steps 5 | final)
[ -n "$rule" ] || fail "2 replicas, default batch-norm rule: no final loss"
out=$(timeout 60 "$bin/data_parallel" --replicas 3 --batch 2 2>&1) && fail "a batch of 2 over 3 replicas ran"
grep -q "a batch of 2 rows .* cannot be scattered over 3 replicas" <<<"$out" ||
  fail "a batch of 2 over 3 replicas: unexpected message: $out"
echo "a batch of 2 over 3 replicas refused: ok"
