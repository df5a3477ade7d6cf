#!/usr/bin/env bash
# ddp-plot (issue 27): SVG drawn from ddp's own output, checked against the
# data by tests/tools/check_svg.py (Debian's /usr/bin/python3, xml.etree):
# axes, one path per series, every point (so each series' x and y range)
# where the data puts it.
#  - a 3-epoch-like synthetic log (1800 steps: the phases averaged over
#    bins of 9), alone and compared with two real short runs of ddp-train
#    (headtail on toydata, with accuracy; toy regression, without);
#  - bench-ddp.sh's scaling table: bars at the medians, efficiencies;
#  - bad input: each error names the file and the line, exits 1 and leaves
#    no output file; bad usage exits 2; --help and --version.
set -euo pipefail
bin=${DDP_BIN_DIR:?}
here=$(cd "$(dirname "$0")" && pwd)
py=/usr/bin/python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$py" "$here/make_logs.py" "$tmp"
"$bin/ddp-plot" "$tmp/three_epochs.jsonl" -o "$tmp/one.svg"
"$py" "$here/check_svg.py" train "$tmp/one.svg" "three_epochs=$tmp/three_epochs.jsonl"

"$bin/ddp-train" --model headtail --samples 4096 --batch-size 64 --lr 1e-4 --epochs 3 --eval-every 20 \
  --workers 0 --log "$tmp/headtail.jsonl" >/dev/null 2>&1 || fail "ddp-train headtail"
"$bin/ddp-train" --model toy --epochs 3 --eval-every 5 --workers 0 --log "$tmp/toy.jsonl" \
  >/dev/null 2>&1 || fail "ddp-train toy"
"$bin/ddp-plot" --log "$tmp/three_epochs.jsonl" --label "real headtail" "$tmp/headtail.jsonl" \
  "$tmp/toy.jsonl" --title "three runs" >"$tmp/three.svg"
"$py" "$here/check_svg.py" train "$tmp/three.svg" "three_epochs=$tmp/three_epochs.jsonl" \
  "real headtail=$tmp/headtail.jsonl" "toy=$tmp/toy.jsonl"
grep -q '>three runs</text>' "$tmp/three.svg" || fail "--title not drawn"

"$bin/ddp-plot" scaling "$tmp/scaling.tsv" -o "$tmp/scaling.svg"
"$py" "$here/check_svg.py" scaling "$tmp/scaling.svg" "$tmp/scaling.tsv"

# Bad input: exit 1, "ddp-plot: error: FILE[:LINE]: ...", no output file.
expect_error() { # WANT-IN-MESSAGE ARGS...
  local want=$1 rc=0; shift
  "$bin/ddp-plot" "$@" -o "$tmp/bad.svg" 2>"$tmp/err" >/dev/null || rc=$?
  [ "$rc" = 1 ] || fail "ddp-plot $* exited $rc, expected 1: $(cat "$tmp/err")"
  grep -qF -- "$want" "$tmp/err" || fail "ddp-plot $*: '$(cat "$tmp/err")' does not say '$want'"
  [ ! -e "$tmp/bad.svg" ] || fail "ddp-plot $* left $tmp/bad.svg"
  ls "$tmp" | grep -q 'bad.svg.tmp' && fail "ddp-plot $* left a temporary file"
  echo "refused: $(cat "$tmp/err")"
}
bad() { printf '%b' "$2" >"$tmp/$1"; }
expect_error "$tmp/missing.jsonl: No such file or directory" "$tmp/missing.jsonl"
bad notjson.jsonl '{"step": 1, "loss": 1, "step_ms": 1}\n\n{"step": 2, "loss": 1,, "step_ms": 1}\n'
expect_error "$tmp/notjson.jsonl:3: " "$tmp/notjson.jsonl"
bad nostep.jsonl '{"loss": 1, "step_ms": 1}\n'
expect_error "$tmp/nostep.jsonl:1: a record needs an integer \"step\"" "$tmp/nostep.jsonl"
bad string.jsonl '{"step": 1, "loss": 1, "step_ms": 1}\n{"step": 2, "loss": "low", "step_ms": 1}\n'
expect_error "$tmp/string.jsonl:2: \"loss\" is a string, expected a number or null" "$tmp/string.jsonl"
bad array.jsonl '[1, 2]\n'
expect_error "$tmp/array.jsonl:1: a record must be a JSON object, not an array" "$tmp/array.jsonl"
bad other.jsonl '{"step": 1, "epoch": 0}\n'
expect_error "$tmp/other.jsonl:1: neither a step record" "$tmp/other.jsonl"
bad nostepms.jsonl '{"step": 1, "loss": 0.5}\n'
expect_error "$tmp/nostepms.jsonl:1: a step record needs \"step_ms\" >= 0" "$tmp/nostepms.jsonl"
bad empty.jsonl '\n'
expect_error "$tmp/empty.jsonl: no records" "$tmp/empty.jsonl"
# A good log before a bad one: the bad one is named.
expect_error "$tmp/string.jsonl:2:" "$tmp/three_epochs.jsonl" "$tmp/string.jsonl"
bad noheader.tsv 'world\tsamples_per_s\n1\t100\n'
expect_error "$tmp/noheader.tsv:1: the header must name the columns side, world and samples_per_s" scaling "$tmp/noheader.tsv"
bad badworld.tsv 'side\tworld\tsamples_per_s\nddp\t1\t100\nddp\ttwo\t150\n'
expect_error "$tmp/badworld.tsv:3: world 'two' is not a positive integer" scaling "$tmp/badworld.tsv"
bad badrate.tsv 'side\tworld\tsamples_per_s\nddp\t1\t-5\n'
expect_error "$tmp/badrate.tsv:2: samples_per_s '-5' is not a positive number" scaling "$tmp/badrate.tsv"
bad short.tsv 'side\tworld\tsamples_per_s\nddp\t1\n'
expect_error "$tmp/short.tsv:2: 2 fields, the header has 3" scaling "$tmp/short.tsv"
bad noone.tsv 'side\tworld\tsamples_per_s\nddp\t1\t100\nPyTorch\t2\t150\n'
expect_error "side 'PyTorch' has no world-1 runs" scaling "$tmp/noone.tsv"
rc=0; "$bin/ddp-plot" "$tmp/three_epochs.jsonl" -o "$tmp/no/such/dir/x.svg" 2>"$tmp/err" || rc=$?
[ "$rc" = 1 ] && grep -qF "cannot create the temporary file $tmp/no/such/dir/x.svg.tmp." "$tmp/err" ||
  fail "an unwritable -o: exit $rc, '$(cat "$tmp/err")'"

# Usage: exit 2.
for args in "" "--bogus" "--label x" "scaling" "scaling a.tsv b.tsv" "-o"; do
  rc=0; "$bin/ddp-plot" $args >/dev/null 2>"$tmp/err" || rc=$?
  [ "$rc" = 2 ] || fail "ddp-plot $args exited $rc, expected 2"
  grep -q "ddp-plot --help" "$tmp/err" || fail "ddp-plot $args: no pointer to --help"
done
"$bin/ddp-plot" --help | grep -q "^usage: ddp-plot" || fail "--help"
"$bin/ddp-plot" --version | grep -q "^ddp-plot (ddp) [0-9]" || fail "--version"
echo ok
