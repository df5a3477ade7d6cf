#!/usr/bin/env bash
# Checks that every heap allocation in src/ goes through core's hooks
# (ddp_alloc, ddp_calloc, ddp_realloc, ddp_strdup, ddp_free; include/ddp/
# core.h, "Allocation"): a direct call to malloc, calloc, realloc, free,
# strdup, strndup, posix_memalign, aligned_alloc or reallocarray in src/, or
# one of them taken as a function pointer (`.release = free`), fails naming
# file:line, unless the allow-list below names its file, function and call.
# Comments and strings are not code; `ddp_free(`, `free_works` and
# `->free(` (a member) are other names.
#
# Usage: scripts/check-alloc.sh   (from anywhere; exits 1 naming each
# file:line). Python 3 standard library only; scripts/test.sh runs it
# before the builds.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys

# Memory that libc allocates stays libc's: (file, function, call, why).
# Keep it short; a new entry says where its memory comes from.
ALLOW = [
    ("src/core/alloc.c", "default_alloc", "posix_memalign",
     "the default hook itself: 64-byte aligned memory from libc"),
    ("src/core/alloc.c", "default_free", "free",
     "the default hook itself: gives default_alloc's memory back to libc"),
    ("src/launch/supervise.c", "ddp__job_print_summary", "free",
     "open_memstream's buffer comes from libc's malloc"),
    ("src/comm/flight/dump.c", "ddp__flight_to_json", "free",
     "open_memstream's buffer comes from libc's malloc (copied into ddp_alloc memory)"),
    ("src/comm/flight/verdict.c", "ddp__flight_verdict", "free",
     "open_memstream's buffer comes from libc's malloc (copied into ddp_alloc memory)"),
]

NAMES = ("malloc|calloc|realloc|free|strdup|strndup|posix_memalign|aligned_alloc|"
         "reallocarray")
# A call, or the name as a value; not a longer identifier (ddp_free,
# free_works), not a member (->free, .free) and not a declarator (*free).
USE = re.compile(r"(?<![A-Za-z0-9_>.*])(" + NAMES + r")\b")
SOURCE_EXT = (".c", ".h", ".cu", ".cuh", ".cpp")


def code_only(text):
    """text with comments and the insides of string and character literals
    blanked; newlines kept, so offsets and line numbers still hold."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + 1
            continue
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def without_directives(code):
    """code with preprocessor lines (and their continuations) blanked, so
    macros' braces do not count as functions' braces."""
    lines, cont = code.split("\n"), False
    for i, line in enumerate(lines):
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            lines[i] = " " * len(line)
    return "\n".join(lines)


def function_at(code):
    """For each offset, the name of the function whose body holds it (None
    outside functions): the identifier before the first '(' of the text
    between the previous top-level ';' or '}' and a top-level '{'. An
    `extern "C" {` block does not count as a level."""
    names = [None] * (len(code) + 1)
    depth, parens, start, current, opened = 0, 0, 0, None, []
    for i, c in enumerate(code):
        if c in "()" and depth == 0:
            parens = max(parens + (1 if c == "(" else -1), 0)
        elif parens:
            pass  # a brace in a parameter list (a struct type) opens no function
        elif c == "{":
            head = code[start:i]
            if depth == 0 and re.search(r'extern\s*"\s*"\s*$', head):
                opened.append(False)
                start = i + 1
                continue
            opened.append(True)
            if depth == 0:
                head = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", head, flags=re.S)
                calls = re.findall(r"([A-Za-z_]\w*)\s*\(", head)
                current = calls[0] if calls and "=" not in head.split("(")[0] else None
            depth += 1
        elif c == "}":
            if opened and not opened.pop():
                start = i + 1
                continue
            depth = max(depth - 1, 0)
            if depth == 0:
                current, start = None, i + 1
        elif c == ";" and depth == 0:
            start = i + 1
        names[i] = current if depth else None
    return names


def main():
    allow = {(f, fn, call) for f, fn, call, _ in ALLOW}
    used = set()
    problems = []
    for top, dirs, files in os.walk("src"):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(SOURCE_EXT):
                continue
            path = os.path.join(top, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            code = code_only(text)
            owner = function_at(without_directives(code))
            for m in USE.finditer(code):
                call = m.group(1)
                fn = owner[m.start()]
                if (path, fn, call) in allow:
                    used.add((path, fn, call))
                    continue
                line = text.count("\n", 0, m.start()) + 1
                src = text.split("\n")[line - 1].strip()
                problems.append(f"{path}:{line}: {call} in {fn or 'file scope'}: "
                                f"`{src}`: use ddp_alloc/ddp_calloc/ddp_realloc/"
                                f"ddp_strdup/ddp_free (include/ddp/core.h), or add an "
                                f"allow-list entry with its reason (scripts/check-alloc.sh)")
    for f, fn, call, _ in ALLOW:
        if (f, fn, call) not in used:
            problems.append(f"scripts/check-alloc.sh: allow-list entry ({f}, {fn}, {call}) "
                            f"matches nothing: remove it")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-alloc: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("check-alloc: every allocation in src/ goes through core's hooks "
          f"({len(ALLOW)} allow-listed libc uses)")
    return 0


sys.exit(main())
PY
