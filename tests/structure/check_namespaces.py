#!/usr/bin/env python3
"""Holds that namespaces follow folders: every `namespace tessel...` a file of the code's folders
opens is its folder's (engine/ and core/ add no level: engine/run/ -> tessel::run, core/plan/ ->
tessel::plan, parallel/pp/ -> tessel::parallel::pp), or one below it (tessel::kernels::cpu in
core/kernels/), or holds only forward declarations of another folder's names. Prints one line
per offence (file:line, the namespace, the one expected) and exits 1 when there is any. Usage:
check_namespaces.py [ROOT]"""
import os
import re
import sys

SOURCES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
CODE = ("engine", "core", "models", "parallel", "launcher")
OPEN = re.compile(r"^namespace (tessel(?:::\w+)*) \{")
FORWARD = re.compile(r"^\s*(?:(?:class|struct) \w+;|//.*|)\s*$")


def expected(path):
    """tessel::a::b for a file at [engine/|core/]a/b/file."""
    parts = path.split("/")[:-1]
    if parts and parts[0] in ("engine", "core"):
        parts = parts[1:]
    return "::".join(["tessel"] + parts)


def offences(root, path):
    want = expected(path)
    with open(os.path.join(root, path), errors="replace") as f:
        lines = f.read().split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        m = OPEN.match(line)
        if not m or m.group(1) == want or m.group(1).startswith(want + "::"):
            continue
        body = []
        for later in lines[n:]:
            if later.startswith("}"):
                break
            body.append(later)
        if all(FORWARD.match(b) for b in body):
            continue  # forward declarations of another folder's names
        out.append(f"{path}:{n}: opens namespace {m.group(1)}; its folder's is {want}")
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    found, files = [], 0
    for top in CODE:
        for dirpath, _, names in sorted(os.walk(os.path.join(root, top))):
            for name in sorted(names):
                if name.endswith(SOURCES):
                    files += 1
                    found += offences(root, os.path.relpath(os.path.join(dirpath, name), root))
    for line in found:
        print(line)
    print(f"{len(found)} namespace(s) against their folder in {files} files of "
          f"{', '.join(t + '/' for t in CODE)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
