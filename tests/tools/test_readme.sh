#!/usr/bin/env bash
# The README's commands, so that the front page cannot rot (issue 44).
# Fenced blocks whose info string is `sh run` are run, line by line (a line
# ending in `\` continues), in one fresh temporary directory, each under a
# timeout, with `build/bin/` meaning this build's executables ($DDP_BIN_DIR)
# and these sizes made short so that CI can afford them:
#   ddp-train          --max-steps 3 added (unless the line sets it)
#   --generations N    50
#   -e SIZE (ddp-bench) 64K
# Each must exit 0. Blocks marked `sh check` or `sh setup` need a GPU, Slurm,
# MPI, several hosts or a fresh machine: for each line, every executable it
# names must exist (a script: `bash -n` passes), each of ddp's tools must
# answer --help, and every long option the line gives a tool must be one its
# --help documents; a system command (srun, ctest, ...) must be installed.
# Any other sh block is an error (say run or check). Usage: test_readme.sh
# [README] (DDP_BIN_DIR: the build's bin/, default build/bin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
readme=${1:-$root/README.md}
bin=${DDP_BIN_DIR:-$root/build/bin}
[ -x "$bin/ddp-train" ] || { echo "test_readme: no ddp-train in $bin (build first)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
exec python3 - "$readme" "$bin" "$root" "$work" <<'PY'
import os, re, shlex, shutil, subprocess, sys

readme, bindir, root, work = sys.argv[1:5]
TOOLS = {"ddprun", "ddp-train", "ddp-bench", "ddp-store", "ddp-hpo", "ddp-plot", "ddp-debug"}
failures = []

def blocks(text):
    """(kind, first line number, [(line number, command)]) per sh block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(sh|bash)\b\s*(\S*)", lines[i])
        if not m:
            i += 1
            continue
        kind, start, cmds, pending, pending_no = m.group(2) or "", i + 1, [], "", 0
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            line = lines[i].rstrip()
            if not pending:
                pending_no = i + 1
            if line.endswith("\\"):
                pending += line[:-1] + " "
            else:
                pending += line
                cmd = re.sub(r"\s+#.*$", "", pending).strip()
                if cmd and not cmd.startswith("#"):
                    cmds.append((pending_no, cmd))
                pending = ""
            i += 1
        yield kind, start, cmds
        i += 1

def shorten(cmd):
    if "ddp-train" in cmd and "--max-steps" not in cmd:
        cmd += " --max-steps 3"
    cmd = re.sub(r"--generations \d+", "--generations 50", cmd)
    if "ddp-bench" in cmd:
        cmd = re.sub(r"-e \S+", "-e 64K", cmd)
    return cmd

def localise(cmd):
    return cmd.replace("build/bin/", bindir.rstrip("/") + "/")

help_cache = {}
def tool_help(tool):
    if tool not in help_cache:
        p = subprocess.run([os.path.join(bindir, tool), "--help"], capture_output=True, text=True, timeout=30)
        help_cache[tool] = (p.returncode, p.stdout + p.stderr)
    return help_cache[tool]

def check_line(no, cmd):
    words = shlex.split(cmd.replace("(", " ").replace(")", " ").replace("&&", " && "))
    segments, current = [], None
    for w in words:
        if w.startswith("build/bin/") or w.startswith("scripts/") or w.startswith("examples/"):
            current = [w, []]
            segments.append(current)
        elif current is not None:
            current[1].append(w)
    if not segments:
        first = next((w for w in words if w not in ("cd", "build", "&&") and "=" not in w), None)
        if first is None or shutil.which(first) is None:
            failures.append(f"README:{no}: '{cmd}': names no ddp tool or script, and '{first}' is not installed")
        return
    for exe, args in segments:
        path = os.path.join(root, exe) if not exe.startswith("build/bin/") else os.path.join(bindir, exe[len("build/bin/"):])
        name = os.path.basename(exe)
        if not os.path.exists(path):
            failures.append(f"README:{no}: {exe} does not exist ({path})")
            continue
        if exe.endswith(".sh"):
            if subprocess.run(["bash", "-n", path]).returncode != 0:
                failures.append(f"README:{no}: {exe} does not parse (bash -n)")
            continue
        if name not in TOOLS:
            continue
        rc, text = tool_help(name)
        if rc != 0:
            failures.append(f"README:{no}: {name} --help exited {rc}")
            continue
        for a in args:
            opt = a.split("=")[0]
            if opt.startswith("--") and len(opt) > 2 and not re.search(re.escape(opt) + r"\b", text):
                failures.append(f"README:{no}: {name} does not know {opt} (not in its --help)")

def run_line(no, cmd):
    short = localise(shorten(cmd))
    print(f"README:{no}: {short}", flush=True)
    try:
        p = subprocess.run(["bash", "-c", short], cwd=work, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        failures.append(f"README:{no}: '{cmd}' did not finish in 300 s")
        return
    if p.returncode != 0:
        tail = "\n    ".join((p.stdout + p.stderr).strip().splitlines()[-6:])
        failures.append(f"README:{no}: '{cmd}' exited {p.returncode}:\n    {tail}")

ran = checked = 0
with open(readme) as f:
    text = f.read()
for kind, start, cmds in blocks(text):
    if kind == "run":
        for no, cmd in cmds:
            check_line(no, cmd)
            run_line(no, cmd)
            ran += 1
    elif kind in ("check", "setup"):
        for no, cmd in cmds:
            check_line(no, cmd)
            checked += 1
    else:
        failures.append(f"README:{start}: a sh block marked neither run nor check/setup ('{kind}')")
for f in failures:
    print("FAIL " + f)
print(f"test_readme: {ran} commands run, {checked} checked, {len(failures)} failed")
sys.exit(1 if failures or ran == 0 else 0)
PY
