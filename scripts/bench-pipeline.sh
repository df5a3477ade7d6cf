#!/usr/bin/env bash
# Pipeline parallelism's bubble and speed (issue 23), ddp against PyTorch's
# torch.distributed.pipelining in the same go. The model of
# refs/torch_pipeline.py: 8 x (Linear(1024, 1024), ReLU), MSE, batch 256,
# 2 ranks with a core each (2 stages of 4 layers; interleaved: 2 x v stages).
#   ddp:     build/bin/bench_pipeline --schedule S --microbatches M [--virtual-stages v]
#            (--schedule none: the unsplit model on one rank, M micro-batches accumulated)
#   PyTorch: /opt/torch-venv/bin/python refs/torch_pipeline.py --schedule 1f1b
#            --microbatches 8 (and --world 1, its unsplit model)
# Each round runs every configuration once; the order of the two sides
# alternates between rounds. Prints the medians over rounds: each schedule's
# measured idle fraction per rank against (p - 1) / (v M + p - 1) (stages
# of equal cost: bench_pipeline --input-grad; see ddp_runs), the
# speedup of 1F1B at M = 8 over the unsplit model against the ideal
# 2M / (M + 1), and ddp / PyTorch in samples/s.
#   scripts/bench-pipeline.sh [rounds=5] [steps=20]
# Env: BENCH_BIN (default build/bin), DDP_SHARED_DIR (default ../shared),
# TORCH_PY (default /opt/torch-venv/bin/python), BENCH_OUT (raw lines;
# default build/bench-pipeline).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
steps=${2:-20}
bin=${BENCH_BIN:-build/bin}
ref=${DDP_SHARED_DIR:-../shared}/refs/torch_pipeline.py
py=${TORCH_PY:-/opt/torch-venv/bin/python}
out=${BENCH_OUT:-build/bench-pipeline}
die() { echo "bench-pipeline: $*" >&2; exit 2; }
[ -x "$bin/bench_pipeline" ] || die "build $bin/bench_pipeline first"
[ -f "$ref" ] || die "$ref not found (set DDP_SHARED_DIR)"
"$py" -c "import torch.distributed.pipelining" 2>/dev/null || die "$py has no torch.distributed.pipelining"
mkdir -p "$out"
raw=$out/raw.txt
: >"$raw"

# Speed: the model as PyTorch's reference runs it (the input needs no
# gradient). Bubble: --input-grad, so both stages do the same 12 matrix
# products a micro-batch (the closed form's premise; without it the first
# stage skips its first layer's input gradient and idles that much more).
ddp_runs() {
  local r=$1
  "$bin/bench_pipeline" --schedule none --microbatches 8 --steps "$steps" | sed "s/^/round=$r /" >>"$raw"
  "$bin/bench_pipeline" --schedule 1f1b --microbatches 8 --steps "$steps" | sed "s/^/round=$r /" >>"$raw"
  for s in 1f1b gpipe; do
    for m in 4 8 16; do
      "$bin/bench_pipeline" --schedule $s --microbatches $m --steps "$steps" --input-grad |
        sed "s/^/round=$r /" >>"$raw"
    done
  done
  for m in 4 8 16; do
    "$bin/bench_pipeline" --schedule interleaved --virtual-stages 2 --microbatches $m --steps "$steps" \
      --input-grad | sed "s/^/round=$r /" >>"$raw"
  done
}
torch_runs() {
  local r=$1
  "$py" "$ref" --schedule 1f1b --microbatches 8 --steps "$steps" 2>/dev/null | tail -1 | sed "s/^/round=$r /" >>"$raw"
  "$py" "$ref" --world 1 --microbatches 8 --steps "$steps" 2>/dev/null | tail -1 | sed "s/^/round=$r /" >>"$raw"
}

for r in $(seq 1 "$rounds"); do
  echo "round $r/$rounds (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  if [ $((r % 2)) -eq 1 ]; then ddp_runs "$r"; torch_runs "$r"; else torch_runs "$r"; ddp_runs "$r"; fi
done

python3 - "$raw" <<'EOF'
import re, statistics, sys
rows = []
for line in open(sys.argv[1]):
    kv = dict(re.findall(r'(\w+)=([^\s]+)', line))
    kv['side'] = 'torch' if ' torch ' in f' {line} ' or 'torch' in line.split()[1] else 'ddp'
    rows.append(kv)
def med(xs): return statistics.median(xs) if xs else float('nan')
def pick(side, sched, world, m, v='1', grad='0'):
    return [r for r in rows if r['side'] == side and r['schedule'] == sched and r['world'] == world
            and r['microbatches'] == m and r.get('v', '1') == v and r.get('input_grad', '0') == grad]
print('Idle fraction per rank (median over rounds) against (p-1)/(vM+p-1),')
print('stages of equal cost (--input-grad):')
print('| schedule | v | M | rank 0 | rank 1 | ideal | rounds |')
print('|---|---|---|---|---|---|---|')
for sched, v in (('gpipe', '1'), ('1f1b', '1'), ('interleaved', '2')):
    for m in ('4', '8', '16'):
        rs = pick('ddp', sched, '2', m, v, '1')
        if not rs: continue
        i0 = med([float(r['idle'].split(',')[0]) for r in rs])
        i1 = med([float(r['idle'].split(',')[1]) for r in rs])
        print(f"| {sched} | {v} | {m} | {i0:.3f} | {i1:.3f} | {float(rs[0]['ideal_idle']):.3f} | {len(rs)} |")
single = [float(r['samples_per_s']) for r in pick('ddp', 'none', '1', '8')]
pipe = [float(r['samples_per_s']) for r in pick('ddp', '1f1b', '2', '8')]
asis = pick('ddp', '1f1b', '2', '8')
if asis:
    print(f"| 1f1b, the input without gradient (the speed runs) | 1 | 8 | "
          f"{med([float(r['idle'].split(',')[0]) for r in asis]):.3f} | "
          f"{med([float(r['idle'].split(',')[1]) for r in asis]):.3f} | "
          f"{float(asis[0]['ideal_idle']):.3f} | {len(asis)} |")
t_pipe = [float(r['samples_per_s']) for r in rows if r['side'] == 'torch' and r['world'] == '2']
t_single = [float(r['samples_per_s']) for r in rows if r['side'] == 'torch' and r['world'] == '1']
print()
print('Samples/s (median over rounds), 1F1B at M = 8:')
print('| side | unsplit, 1 rank | 2-stage 1F1B | speedup | of ideal 1.78x |')
print('|---|---|---|---|---|')
for side, s, p in (('ddp', single, pipe), ('PyTorch', t_single, t_pipe)):
    sp = med(p) / med(s) if s and p else float('nan')
    print(f'| {side} | {med(s):.1f} | {med(p):.1f} | {sp:.2f}x | {sp / (16 / 9) * 100:.0f} % |')
# Per round ratios (same go), then their median.
by_round = {}
for r in rows:
    by_round.setdefault(r['round'], []).append(r)
ratios = []
for rnd, rs in sorted(by_round.items()):
    d = [float(r['samples_per_s']) for r in rs if r['side'] == 'ddp' and r['schedule'] == '1f1b'
         and r['microbatches'] == '8' and r.get('input_grad', '0') == '0']
    t = [float(r['samples_per_s']) for r in rs if r['side'] == 'torch' and r['world'] == '2']
    if d and t: ratios.append(d[0] / t[0])
print()
print(f'ddp / PyTorch, 2-stage 1F1B at M = 8: ratio of medians {med(pipe) / med(t_pipe):.2f}x, '
      f'median of per-round ratios {med(ratios):.2f}x ({len(ratios)} rounds)')
EOF
