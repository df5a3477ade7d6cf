#!/usr/bin/env bash
# DDP_DEBUG=info (issue 27's debugging page; torch's TORCH_DISTRIBUTED_DEBUG=INFO):
# the data-parallel wrapper logs its layout on rank 0, at creation and after
# its re-layout: the options and each bucket's parameters. Checked on a
# 2-rank ConvNet run with three buckets (--bucket-cap-mb 0.02): each layout
# lists every one of the model's 10 parameters exactly once, the buckets'
# sizes add up to the model's 29034 floats, and nothing of it is logged
# without DDP_DEBUG.
set -euo pipefail
bin=${DDP_BIN_DIR:?DDP_BIN_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # OUT, then the environment's extra assignments
  local out=$1; shift
  env "$@" timeout 120 "$bin/ddprun" --nproc-per-node 2 "$bin/ddp-train" --model convnet --max-steps 3 \
    --bucket-cap-mb 0.02 --workers 0 --eval-every 0 --epochs 1 >"$tmp/$out.stdout" 2>"$tmp/$out" ||
    { cat "$tmp/$out"; echo "FAIL: ddprun exited $?"; exit 1; }
}
run info DDP_DEBUG=info
run quiet DDP_DEBUG=
if grep -q "ddp: wrapper\|ddp:   bucket" "$tmp/quiet"; then
  echo "FAIL: the layout was logged without DDP_DEBUG"; grep "ddp:" "$tmp/quiet" | head; exit 1
fi
/usr/bin/python3 - "$tmp/info" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
layouts, cur = [], None
for l in lines:
    m = re.search(r"\[ddp rank (\d+)\] I ddp: wrapper (.*?): 2 ranks, 10 parameters \(29034 floats\) in (\d+) buckets", l)
    if m:
        if m.group(1) != "0":
            sys.exit("FAIL: rank %s logged the layout (rank 0 only): %s" % (m.group(1), l))
        cur = {"when": m.group(2), "n": int(m.group(3)), "buckets": []}
        layouts.append(cur)
        continue
    m = re.search(r"I ddp:   bucket (\d+): (\d+) floats \([\d.]+ KiB\), (\d+) parameters: (.*)$", l)
    if m and cur is not None:
        names = m.group(4).split(", ")
        if len(names) != int(m.group(3)):
            sys.exit("FAIL: bucket line names %d parameters, says %s: %s" % (len(names), m.group(3), l))
        cur["buckets"].append((int(m.group(2)), names))
want = {"layer1.0.weight", "layer1.0.bias", "layer1.1.weight", "layer1.1.bias", "layer2.0.weight",
        "layer2.0.bias", "layer2.1.weight", "layer2.1.bias", "fc.weight", "fc.bias"}
if [l["when"] for l in layouts] != ["created", "re-laid out in the gradients' ready order"]:
    sys.exit("FAIL: expected the layout at creation and after the re-layout, got %r" % [l["when"] for l in layouts])
for l in layouts:
    names = [n for _, ns in l["buckets"] for n in ns]
    if len(l["buckets"]) != l["n"] or l["n"] < 2:
        sys.exit("FAIL: %s: %d bucket lines for %d buckets" % (l["when"], len(l["buckets"]), l["n"]))
    if sorted(names) != sorted(want):
        sys.exit("FAIL: %s: the buckets list %r" % (l["when"], names))
    if sum(f for f, _ in l["buckets"]) != 29034:
        sys.exit("FAIL: %s: the buckets hold %d floats" % (l["when"], sum(f for f, _ in l["buckets"])))
print("ok: %d layouts of %s buckets, every parameter once, 29034 floats" % (len(layouts), "/".join(str(l["n"]) for l in layouts)))
PY
