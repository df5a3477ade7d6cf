"""Reads the event files test_tensorboard.c wrote with the tensorboard
package's own reader and checks them against expected.jsonl (run with the
reference environment's Python: tensorboard and torch).

  tensorboard_check.py ROOT PID

For every run directory ROOT/<run>:
  - one file, named as SummaryWriter names it:
    events.out.tfevents.<10 digits>.<this host>.<PID>.<n>;
  - its TFRecords walked strictly with tensorboard's masked_crc32c (the
    reader itself stops quietly at a bad CRC, so it would not notice): the
    count expected, each record an Event that re-serializes to the same
    bytes (our encoder writes canonical protobuf), the first
    {file_version "brain.Event:2"}; a run marked partial ends inside a
    record;
  - EventAccumulator: the scalar tags exactly those expected, each tag's
    (step, value) list equal to the expected one, values compared as
    float32 bit patterns (and wall times where given); text events equal,
    byte for byte, to what torch.utils.tensorboard's summary.text() makes;
    the plugin accumulator TensorBoard's web UI reads puts the same values
    under the scalars plugin;
  - for a training run, the JSON-lines log: every step and evaluation
    record's non-null values are there at the same step under
    "<group>/<key>", the log's value being exactly the callback's (the log
    prints round-trip digits), TensorBoard's the float32 of the log's, and
    the log's nulls are absent.
Prints one line per run; exits 1 at the first difference, naming it."""
import glob
import json
import os
import re
import socket
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import plugin_event_accumulator as pea
from tensorboard.util import tensor_util
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import summary as torch_summary


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def f32(x):
    """x rounded to float32, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits(x):
    return struct.pack("<f", x)


def records(path, partial):
    """The file's records, each checked against both masked CRC-32Cs."""
    data = open(path, "rb").read()
    pos, out = 0, []
    while pos < len(data):
        if pos + 12 > len(data) or pos + 12 + struct.unpack("<Q", data[pos:pos + 8])[0] + 4 > len(data):
            if partial:
                return out, True
            fail("%s: record %d cut short at byte %d" % (path, len(out), pos))
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if hcrc != masked_crc32c(header):
            fail("%s: record %d: header CRC %08x, expected %08x" % (path, len(out), hcrc, masked_crc32c(header)))
        body = data[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if dcrc != masked_crc32c(body):
            fail("%s: record %d: data CRC %08x, expected %08x" % (path, len(out), dcrc, masked_crc32c(body)))
        out.append(body)
        pos += 16 + length
    return out, False


def check_records(run, path, want, pid):
    name = os.path.basename(path)
    pattern = r"events\.out\.tfevents\.\d{10}\.%s\.%d\.\d+$" % (re.escape(socket.gethostname()), pid)
    if not re.match(pattern, name):
        fail("%s: file name %s does not match %s" % (run, name, pattern))
    recs, cut = records(path, want.get("partial", False))
    if len(recs) != want["records"]:
        fail("%s: %d whole records, expected %d" % (run, len(recs), want["records"]))
    if want.get("partial") and not cut:
        fail("%s: expected a partial last record" % run)
    texts = {}
    for i, raw in enumerate(recs):
        ev = event_pb2.Event.FromString(raw)
        if ev.SerializeToString() != raw:
            fail("%s: record %d is not canonical protobuf:\n ours   %s\n python %s"
                 % (run, i, raw.hex(), ev.SerializeToString().hex()))
        if i == 0 and ev.file_version != "brain.Event:2":
            fail("%s: first record has file_version %r" % (run, ev.file_version))
        for v in ev.summary.value:
            if v.HasField("tensor"):
                base = v.tag[:-len("/text_summary")]
                text = v.tensor.string_val[0].decode("utf-8")
                torch_ev = event_pb2.Event(wall_time=ev.wall_time, step=ev.step,
                                           summary=torch_summary.text(base, text))
                if torch_ev.SerializeToString() != raw:
                    fail("%s: text record %d differs from SummaryWriter.add_text's:\n ours  %s\n torch %s"
                         % (run, i, raw.hex(), torch_ev.SerializeToString().hex()))
                texts[v.tag] = (ev.step, text)
    return texts


def check_scalars(run, run_dir, want_scalars):
    acc = ea.EventAccumulator(run_dir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    if acc.file_version != 2.0:
        fail("%s: EventAccumulator read file_version %r" % (run, acc.file_version))
    tags = sorted(acc.Tags()["scalars"])
    if tags != sorted(want_scalars):
        fail("%s: scalar tags %s, expected %s" % (run, tags, sorted(want_scalars)))
    count = 0
    for tag, want in want_scalars.items():
        got = acc.Scalars(tag)
        if [e.step for e in got] != [w["step"] for w in want]:
            fail("%s: %s steps %s, expected %s" % (run, tag, [e.step for e in got][:20], [w["step"] for w in want][:20]))
        for e, w in zip(got, want):
            if bits(e.value) != bits(f32(w["value"])):
                fail("%s: %s at step %d is %r, expected float32(%r) = %r"
                     % (run, tag, e.step, e.value, w["value"], f32(w["value"])))
            if "wall" in w and e.wall_time != w["wall"]:
                fail("%s: %s at step %d: wall time %r, expected %r" % (run, tag, e.step, e.wall_time, w["wall"]))
            count += 1
    # What TensorBoard's web UI reads: the plugin accumulator, which moves
    # simple_value into tensors under the scalars plugin.
    pacc = pea.EventAccumulator(run_dir, size_guidance={"tensors": 0})
    pacc.Reload()
    if sorted(pacc.PluginTagToContent("scalars")) != sorted(want_scalars):
        fail("%s: the scalars plugin sees %s" % (run, sorted(pacc.PluginTagToContent("scalars"))))
    for tag, want in want_scalars.items():
        got = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in pacc.Tensors(tag)]
        if got != [(w["step"], f32(w["value"])) for w in want]:
            fail("%s: the scalars plugin's %s differs: %s" % (run, tag, got[:5]))
    return acc, count


# The log's keys and the tags they are written under.
STEP_TAGS = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s",
             "load_ms": "phases/load_ms", "forward_ms": "phases/forward_ms",
             "backward_compute_ms": "phases/backward_compute_ms",
             "backward_comm_ms": "phases/backward_comm_ms", "optimizer_ms": "phases/optimizer_ms",
             "step_ms": "phases/step_ms", "preempted_ms": "phases/preempted_ms"}
EVAL_TAGS = {"test_loss": "test/loss", "test_accuracy": "test/accuracy"}


def check_log(run, acc, log_path, want_scalars):
    """Every value of the log at the same step in TensorBoard, and nothing
    the log has as null."""
    exact = {(tag, w["step"]): w["value"] for tag, ws in want_scalars.items() for w in ws}
    tb = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    seen = set()
    with open(log_path) as f:
        for n, line in enumerate(f, 1):
            rec = json.loads(line)
            keys = STEP_TAGS if "loss" in rec else EVAL_TAGS
            for key, tag in keys.items():
                where = (tag, rec["step"])
                if rec[key] is None:
                    if where in tb:
                        fail("%s: %s:%d has %s null, TensorBoard has %r" % (run, log_path, n, key, tb[where]))
                    continue
                if where not in tb:
                    fail("%s: %s:%d: %s = %r at step %d is missing from TensorBoard" % (run, log_path, n, key, rec[key], rec["step"]))
                if exact[where] != rec[key]:
                    fail("%s: %s:%d: %s = %r, but the callback saw %r" % (run, log_path, n, key, rec[key], exact[where]))
                if bits(tb[where]) != bits(f32(rec[key])):
                    fail("%s: %s at step %d: TensorBoard %r, float32 of the log's %r is %r"
                         % (run, tag, rec["step"], tb[where], rec[key], f32(rec[key])))
                seen.add(where)
    if seen != set(tb):
        fail("%s: TensorBoard has values the log does not: %s" % (run, sorted(set(tb) - seen)[:5]))
    return len(seen)


def main():
    root, pid = sys.argv[1], int(sys.argv[2])
    runs = {}
    with open(os.path.join(root, "expected.jsonl")) as f:
        for line in f:
            # parse_int=float: "-0" (a float -0.0 printed by C's %.17g) stays -0.0.
            rec = json.loads(line, parse_int=float)
            r = runs.setdefault(rec["run"], {"scalars": {}, "texts": {}})
            if "tag" in rec:
                r["scalars"].setdefault(rec["tag"], []).append(rec)
            elif "text_tag" in rec:
                r["texts"][rec["text_tag"]] = (rec["step"], rec["text"])
            else:
                r.update(rec)
            if "records" in rec:
                r["records"] = int(rec["records"])
    for run, want in sorted(runs.items()):
        files = glob.glob(os.path.join(root, run, "events.out.tfevents.*"))
        if len(files) != 1:
            fail("%s: %d event files, expected 1: %s" % (run, len(files), files))
        texts = check_records(run, files[0], want, pid)
        acc, count = check_scalars(run, os.path.join(root, run), want["scalars"])
        if "log" in want:
            want_rows = ["| `world_size` | `%d` |" % want["world_size"], "| `batch_size` | `16` |",
                         "| `optim.kind` | `sgd` |", "| `optim.lr` | `0.05` |",
                         "| `optim.sgd.momentum` | `0.9` |", "| `eval_every` | `10` |",
                         "| `ddp-train.model` | `toy` |", "| `ddp-train.data` | `regression\\|x` |"]
            step, text = texts.get("options/text_summary", (None, ""))
            missing = [r for r in want_rows if r not in text.splitlines()]
            if step != 0 or missing:
                fail("%s: options text at step %r lacks %s:\n%s" % (run, step, missing, text))
            logged = check_log(run, acc, want["log"], want["scalars"])
            if logged != count:
                fail("%s: the log has %d values, expected %d" % (run, logged, count))
        elif texts != want["texts"]:
            fail("%s: texts %r, expected %r" % (run, texts, want["texts"]))
        tensors = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
                   for t in acc.Tags()["tensors"]}
        if tensors != {t: [v] for t, v in texts.items()}:
            fail("%s: EventAccumulator's text tensors %r, the records' %r" % (run, tensors, texts))
        print("%s: %d records, %d scalars%s, %d texts equal" %
              (run, want["records"], count, " (and the log's)" if "log" in want else "", len(texts)))


if __name__ == "__main__":
    main()
