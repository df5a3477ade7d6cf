#!/usr/bin/env bash
# Checks that layers meet through their headers (docs/architecture.md,
# "Layers and where they live"): a file may include headers of its own layer
# and of lower layers only; of a lower layer, its public headers
# (include/ddp/) and its ONE exported internal header; a public header
# includes only public headers, of its own or lower layers; examples include
# public headers only. tests/ and bench/ are not checked: they may include
# any internal header (they test and measure the internals).
#
# Usage: scripts/check-layers.sh   (from anywhere; exits 1 naming each
# file:line, the include and the rule it breaks). Python 3 standard library
# only; scripts/test.sh runs it before the builds.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys

# The layer order, lowest first: each layer may use the layers before it.
# A folder src/<layer>/ (with every subfolder, src/<layer>/<sub>/...) is that
# layer; a new layer is a new line here, in its place.
LAYERS = """
core tensor nn optim data io net store rendezvous comm rpc rpc_autograd
parallel pipeline ps train hpo launch tools
""".split()

# Public headers named otherwise than include/ddp/<layer>.h, and their layer.
PUBLIC_OWNER = {
    "tensorboard.h": "io",     # the TensorBoard event-file writer
    "zero.h": "parallel",      # ZeRO stages 1 and 2, beside the DDP wrapper
    "ddp.h": "tools",          # the umbrella: every public header; for tools and users
}

# Each layer's one internal header that higher layers may include (the path
# as written in #include, relative to src/). A layer not listed exports none.
EXPORTED = {
    "core": "core/core_internal.h",
    "tensor": "tensor/tape.h",
    "nn": "nn/module.h",
    "io": "io/io_internal.h",
    "net": "net/net.h",
    "store": "store/server_fork.h",
    "comm": "comm/flight/flight.h",
    "rpc": "rpc/rpc_internal.h",
    "launch": "launch/launch_internal.h",
}

# Exceptions: (including file, included header, why). Keep it short.
ALLOW = [
    ("src/optim/cuda/optim_kernels.cu", "tensor/cuda/runtime.h",
     "optim's fused CUDA step is device code on tensor's CUDA runtime (its "
     "stream, allocator and error check); CUDA is a device of tensor, not a layer"),
    ("src/comm/nccl/nccl.c", "tensor/cuda/runtime.h",
     "the NCCL backend orders its stream after the tensor layer's compute stream of the "
     "buffers' GPU (and makes that stream wait for a work): the stream is the tensor "
     "layer's, and CUDA is a device of tensor, not a layer"),
    ("tools/ddp-bench.c", "comm/pattern.h",
     "header-only test pattern on public headers only (ddp/comm.h, ddp/tensor.h), "
     "shared by tests/comm and `ddp-bench -c 1` so both check the same values"),
]

ROOT = os.getcwd()
LEVEL = {name: i for i, name in enumerate(LAYERS)}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
SOURCE_EXT = (".c", ".h", ".cu", ".cuh")


def layer_of(path):
    """The layer a repository path belongs to, or None (not checked here)."""
    parts = path.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] == "include" and parts[1] == "ddp":
        name = parts[-1]
        return PUBLIC_OWNER.get(name, name[:-2])
    if parts[0] in ("tools", "examples"):
        return parts[0]
    return None


def resolve(src, bracket, target):
    """The repository path an include names, as the compiler finds it (the
    including file's folder first for "", then include/, tools/, src/), or
    None for a system header."""
    dirs = [] if bracket == "<" else [os.path.dirname(src)]
    dirs += ["include"] + (["tools"] if src.startswith("tools/") else []) + ["src"]
    for d in dirs:
        p = os.path.normpath(os.path.join(d, target))
        if os.path.isfile(os.path.join(ROOT, p)):
            return p
    return None


def files():
    for top in ("src", "include", "tools", "examples"):
        for dirpath, dirnames, names in os.walk(top):
            dirnames.sort()
            for n in sorted(names):
                if n.endswith(SOURCE_EXT):
                    yield os.path.join(dirpath, n)


problems = []
checked = 0
allowed = {(f, h) for f, h, _ in ALLOW}
used_allow = set()
for src in files():
    layer = layer_of(src)
    if layer not in LEVEL and layer != "examples":
        problems.append(f"{src}: in no layer: add '{layer}' to LAYERS in "
                        "scripts/check-layers.sh (or its name to PUBLIC_OWNER)")
        continue
    is_public = src.startswith("include/")
    with open(src, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            m = INCLUDE_RE.match(line)
            if not m:
                continue
            bracket, target = m.groups()
            path = resolve(src, bracket, target)
            if path is None:
                continue
            checked += 1
            where = f'{src}:{lineno}: #include {bracket}{target}{">" if bracket == "<" else chr(34)}'
            other = layer_of(path)
            public = path.startswith("include/")
            if other not in LEVEL:
                problems.append(f"{where}: the header is in no layer")
                continue
            if (src, target) in allowed:
                used_allow.add((src, target))
                continue
            if layer == "examples":
                if not public:
                    problems.append(f"{where}: an example includes public headers only (include/ddp/)")
                continue
            if is_public and not public:
                problems.append(f"{where}: a public header includes an internal header")
                continue
            if other == layer:
                continue
            if LEVEL[other] > LEVEL[layer]:
                if path == "include/ddp/ddp.h":
                    problems.append(f"{where}: the umbrella header is for tools and users; "
                                    f"{layer} includes the public headers it needs")
                    continue
                kind = "a public" if public else "an internal"
                who = f"{layer}'s public header" if is_public else layer
                problems.append(f"{where}: {who} includes {kind} header of {other}, "
                                f"a higher layer ({layer} may use only: "
                                f"{' '.join(LAYERS[:LEVEL[layer]]) or 'nothing'})")
                continue
            if not public and target != EXPORTED.get(other):
                exp = EXPORTED.get(other)
                problems.append(f"{where}: {target} is not {other}'s exported internal header "
                                f"({other} exports {'only ' + exp if exp else 'no internal header'}; "
                                "higher layers see it through include/ddp/ and that one)")

for f, h, _ in ALLOW:
    if (f, h) not in used_allow:
        problems.append(f"scripts/check-layers.sh: stale ALLOW entry ({f}, {h}): no such include")

for p in problems:
    print(p, file=sys.stderr)
if problems:
    print(f"check-layers: {len(problems)} broken rule(s) in {checked} includes "
          "(layer order: " + " < ".join(LAYERS) + ")", file=sys.stderr)
    sys.exit(1)
print(f"check-layers: ok ({checked} includes of project headers checked)")
PY
