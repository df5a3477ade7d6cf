"""Checks a ddp-plot SVG against the data it was drawn from, reading the data
itself (an independent reader of the JSON-lines logs and the TSV table).

  check_svg.py train SVG LABEL=LOG ...
  check_svg.py scaling SVG TABLE.tsv

The SVG must parse as XML. Each panel (<g class="panel" id=...>) must have
a frame, an x and a y axis (a domain line and at least two ticks whose
labels are numbers in increasing order, or the categories expected), and
exactly the series paths expected (<path class="series ..."
data-series=...>), one per series. Each path's points are taken back to
data coordinates through the panel's data-domain and data-plot and compared
with the data point by point (so its x and y ranges too), within what the
SVG's 1/100-pixel rounding allows. Prints a line per panel; exits 1 at the
first difference, naming it."""
import json
import re
import sys
import xml.etree.ElementTree as ET

NS = "{http://www.w3.org/2000/svg}"
MAX_BINS = 200  # tools/ddp_plot/figures.h, FIGURE_MAX_BINS


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def classes(el):
    return el.get("class", "").split()


def panels(root):
    out = {}
    for g in root.iter(NS + "g"):
        if "panel" in classes(g):
            out[g.get("id")] = g
    return out


def tick_value(label):
    """A tick label's number: "2.5", "12k", "1.5M"."""
    scale = {"k": 1e3, "M": 1e6}.get(label[-1:], 1)
    return float(label[:-1] if scale != 1 else label) * scale


def check_axes(pid, g, categories=None):
    if not any("frame" in classes(r) for r in g.iter(NS + "rect")):
        fail("%s: no frame" % pid)
    for name in ("x", "y"):
        axes = [a for a in g.iter(NS + "g") if classes(a) == ["axis", name]]
        if len(axes) != 1:
            fail("%s: %d %s axes" % (pid, len(axes), name))
        axis = axes[0]
        if not any("domain" in classes(l) for l in axis.iter(NS + "line")):
            fail("%s: the %s axis has no domain line" % (pid, name))
        labels = [t.text for tick in axis.iter(NS + "g") if "tick" in classes(tick)
                  for t in tick.iter(NS + "text")]
        if name == "x" and categories is not None:
            if labels != categories:
                fail("%s: x categories %s, expected %s" % (pid, labels, categories))
            continue
        if len(labels) < 2:
            fail("%s: the %s axis has %d ticks" % (pid, name, len(labels)))
        values = [tick_value(v) for v in labels]
        if values != sorted(values) or len(set(values)) != len(values):
            fail("%s: %s tick labels not increasing: %s" % (pid, name, labels))
        if not [t for t in axis.iter(NS + "text") if "label" in classes(t) and t.text]:
            fail("%s: the %s axis has no label" % (pid, name))


def series(pid, g):
    out = {}
    for p in g.iter(NS + "path"):
        if "series" not in classes(p):
            continue
        name = p.get("data-series")
        if name in out:
            fail("%s: two paths for series %s" % (pid, name))
        out[name] = p
    return out


def to_data(g, path):
    """The path's subpaths as lists of (x, y) in data units, and the
    largest error rounding to 1/100 pixel can make on each axis."""
    x0, x1, y0, y1 = map(float, g.get("data-domain").split())
    left, top, width, height = map(float, g.get("data-plot").split())
    subpaths = []
    for op, xs, ys in re.findall(r"([MLZ])\s*(?:(-?[\d.]+)\s+(-?[\d.]+))?", path.get("d")):
        if op == "Z":
            continue
        px, py = float(xs), float(ys)
        pt = (x0 + (px - left) / width * (x1 - x0), y0 + (top + height - py) / height * (y1 - y0))
        if op == "M":
            subpaths.append([pt])
        else:
            subpaths[-1].append(pt)
    tol = (0.0051 * (x1 - x0) / width, 0.0051 * (y1 - y0) / height)
    return subpaths, tol


def same_points(pid, name, got, want, tol):
    if len(got) != len(want):
        fail("%s: %s has %d points, the data %d" % (pid, name, len(got), len(want)))
    for i, ((gx, gy), (wx, wy)) in enumerate(zip(got, want)):
        if abs(gx - wx) > tol[0] * (1 + 1e-9) + 1e-12 or abs(gy - wy) > tol[1] * (1 + 1e-9) + 1e-12:
            fail("%s: %s point %d is (%.6g, %.6g), the data (%.6g, %.6g)" % (pid, name, i, gx, gy, wx, wy))


def check_line(pid, g, paths, name, xs, ys):
    want = [(x, y) for x, y in zip(xs, ys) if x is not None and y is not None]
    if name not in paths:
        fail("%s: no series %s" % (pid, name))
    sub, tol = to_data(g, paths[name])
    got = [pt for s in sub for pt in s]
    same_points(pid, name, got, want, tol)
    if want:
        for axis in (0, 1):
            lo, hi = min(p[axis] for p in got), max(p[axis] for p in got)
            wlo, whi = min(p[axis] for p in want), max(p[axis] for p in want)
            if abs(lo - wlo) > tol[axis] * 1.01 or abs(hi - whi) > tol[axis] * 1.01:
                fail("%s: %s %s range [%g, %g], the data [%g, %g]" % (pid, name, "xy"[axis], lo, hi, wlo, whi))
    return len(want)


def read_log(path):
    """Step records, evaluations, and their training times: the sum of
    step_ms so far, in seconds (an evaluation's: at the step record
    before it)."""
    steps, evals, times, eval_times, clock = [], [], [], [], 0.0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "loss" in rec:
                clock += rec["step_ms"] / 1000
                steps.append(rec)
                times.append(clock)
            else:
                evals.append(rec)
                eval_times.append(clock)
    return steps, evals, times, eval_times


PHASES = [("load", "load_ms"), ("forward", "forward_ms"), ("backward compute", "backward_compute_ms"),
          ("backward comm", "backward_comm_ms"), ("optimizer", "optimizer_ms"), ("other", None)]


def phase_levels(steps):
    """Bins of k steps (k = ceil(n / MAX_BINS) past MAX_BINS steps): x the
    steps' mean, each layer's top the cumulative mean."""
    n = len(steps)
    k = -(-n // MAX_BINS) if n > MAX_BINS else 1
    xs, tops = [], [[] for _ in PHASES]
    for b in range(0, n, k):
        chunk = steps[b:b + k]
        xs.append(sum(r["step"] for r in chunk) / len(chunk))
        sums = [0.0] * len(PHASES)
        for r in chunk:
            parts = 0.0
            for i, (_, key) in enumerate(PHASES):
                if key:
                    v = r[key] if r[key] is not None else 0.0
                    parts += v
                else:
                    v = max(0.0, r["step_ms"] - parts)
                sums[i] += v
        level = 0.0
        for i in range(len(PHASES)):
            level += sums[i] / len(chunk)
            tops[i].append(level)
    return xs, tops, k


def check_train(svg_path, specs):
    root = ET.parse(svg_path).getroot()
    ps = panels(root)
    runs = []
    for spec in specs:
        label, path = spec.split("=", 1)
        runs.append((label, path) + read_log(path))
    want_ids = {"loss-steps", "loss-time", "accuracy-steps", "accuracy-time", "samples-steps"}
    want_ids |= {"phases-%d" % i for i in range(len(runs))}
    if set(ps) != want_ids:
        fail("panels %s, expected %s" % (sorted(ps), sorted(want_ids)))
    for pid, g in sorted(ps.items()):
        check_axes(pid, g)
        paths = series(pid, g)
        want_names, points = set(), 0
        for i, (label, _, steps, evals, times, eval_times) in enumerate(runs):
            if pid.startswith("loss-"):
                xs = [r["step"] for r in steps] if pid == "loss-steps" else times
                exs = [r["step"] for r in evals] if pid == "loss-steps" else eval_times
                points += check_line(pid, g, paths, label + "/loss", xs, [r["loss"] for r in steps])
                points += check_line(pid, g, paths, label + "/test_loss", exs, [r["test_loss"] for r in evals])
                want_names |= {label + "/loss", label + "/test_loss"}
            elif pid.startswith("accuracy-"):
                acc = [None if r["test_accuracy"] is None else 100 * r["test_accuracy"] for r in evals]
                if all(a is None for a in acc):
                    continue
                exs = [r["step"] for r in evals] if pid == "accuracy-steps" else eval_times
                points += check_line(pid, g, paths, label + "/test_accuracy", exs, acc)
                want_names.add(label + "/test_accuracy")
            elif pid == "samples-steps":
                points += check_line(pid, g, paths, label + "/samples_per_s", [r["step"] for r in steps],
                                     [r["samples_per_s"] for r in steps])
                want_names.add(label + "/samples_per_s")
            elif pid == "phases-%d" % i:
                xs, tops, k = phase_levels(steps)
                for j, (name, _) in enumerate(PHASES):
                    sname = "%s/%s" % (label, name)
                    want_names.add(sname)
                    if sname not in paths:
                        fail("%s: no series %s" % (pid, sname))
                    sub, tol = to_data(g, paths[sname])
                    if len(sub) != 1:
                        fail("%s: %s has %d subpaths, expected one band" % (pid, sname, len(sub)))
                    band = sub[0]
                    lows = tops[j - 1] if j else [0.0] * len(xs)
                    want = list(zip(xs, tops[j])) + list(reversed(list(zip(xs, lows))))
                    same_points(pid, sname, band, want, tol)
                    points += len(want)
        if set(paths) != want_names:
            fail("%s: series %s, expected %s" % (pid, sorted(paths), sorted(want_names)))
        print("%s: axes, %d series, %d points as in the data" % (pid, len(paths), points))


def median(values):
    s = sorted(values)
    return s[(len(s) + 1) // 2 - 1]


def check_scaling(svg_path, table):
    root = ET.parse(svg_path).getroot()
    ps = panels(root)
    rows = {}
    with open(table) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            if line.strip():
                r = dict(zip(header, line.rstrip("\n").split("\t")))
                rows.setdefault(r["side"], {}).setdefault(int(r["world"]), []).append(float(r["samples_per_s"]))
    worlds = sorted({w for side in rows.values() for w in side})
    if set(ps) != {"samples-world", "efficiency-world"}:
        fail("panels %s" % sorted(ps))
    for pid, g in sorted(ps.items()):
        check_axes(pid, g, categories=[str(w) for w in worlds])
        paths = series(pid, g)
        if set(paths) != set(rows):
            fail("%s: series %s, expected the sides %s" % (pid, sorted(paths), sorted(rows)))
        for side, by_world in rows.items():
            sub, tol = to_data(g, paths[side])
            if len(sub) != len(by_world):
                fail("%s: %s has %d bars, the table %d worlds" % (pid, side, len(sub), len(by_world)))
            bars = sorted(sub, key=lambda b: min(p[0] for p in b))
            for bar, w in zip(bars, sorted(by_world)):
                m = median(by_world[w])
                want = m if pid == "samples-world" else 100 * m / (w * median(by_world[1]))
                top = max(p[1] for p in bar)
                bottom = min(p[1] for p in bar)
                centre = (min(p[0] for p in bar) + max(p[0] for p in bar)) / 2
                if abs(top - want) > tol[1] * 1.01 or abs(bottom) > tol[1] * 1.01:
                    fail("%s: %s world %d bar from %g to %g, expected 0 to %g" % (pid, side, w, bottom, top, want))
                if abs(centre - worlds.index(w)) > 0.45:
                    fail("%s: %s world %d bar centred at %g, not in its group %d" % (pid, side, w, centre, worlds.index(w)))
        print("%s: axes, %d sides, bars as in the table" % (pid, len(paths)))


def main():
    mode, svg_path = sys.argv[1], sys.argv[2]
    if mode == "train":
        check_train(svg_path, sys.argv[3:])
    elif mode == "scaling":
        check_scaling(svg_path, sys.argv[3])
    else:
        fail("unknown mode %s" % mode)


main()
