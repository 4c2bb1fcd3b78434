#!/usr/bin/env python3
"""Reads every #include "..." of the tree and reports each that runs against LAYERS (the layer
order, top to bottom). Prints one line per offence (file:line, the two folders, the two layers)
and exits 1 when there is any; files in no declared folder are offences too. Usage:
check_layers.py [ROOT] [--diagram] (--diagram: print the layers, their folders and which folders
each folder includes, the picture in docs/architecture.md)"""
import os
import re
import subprocess
import sys

SOURCES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def read_layers(root):
    """{folder: (rank, layer)}; rank 0 is the top."""
    folders, rank = {}, 0
    with open(os.path.join(root, "LAYERS")) as f:
        for line in (l.split("#")[0].strip() for l in f):
            if not line:
                continue
            name, _, members = line.partition(":")
            for m in members.split():
                folders[m] = (rank, name.strip())
            rank += 1
    return folders


def folder_of(path, layers=None):
    """The declared folder a path lies in: the longest of its leading folders that LAYERS names
    (engine/run for engine/run/train.cpp), else its top folder."""
    parts = path.split("/")
    for k in range(len(parts) - 1, 0, -1):
        if layers and "/".join(parts[:k]) in layers:
            return "/".join(parts[:k])
    return parts[0]


def top_of(path):
    return path.split("/", 1)[0]


def ignored(root, names):
    """The top-level folders git ignores: build outputs beside the sources (build-no-toolkit/,
    which a test makes and removes while others run)."""
    try:
        p = subprocess.run(["git", "-C", root, "check-ignore", *names], capture_output=True, text=True)
    except OSError:
        return set()
    return set(p.stdout.split())


def tree_sources(root):
    """The path relative to root of every source file of the tree (build outputs, docs, configs
    and what git ignores left out), in a stable order."""
    skip = {".git", "build", "third_party", ".env", "docs", "configs", "examples"}
    tops = sorted(os.listdir(root))
    skip |= ignored(root, tops)
    for top in tops:
        if top in skip or not os.path.isdir(os.path.join(root, top)) or top.startswith("."):
            continue
        for dirpath, _, files in sorted(os.walk(os.path.join(root, top))):
            for name in sorted(files):
                if name.endswith(SOURCES):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def sources(root, layers):
    """(path relative to root, its declared folder) of every source file of the tree."""
    for path in tree_sources(root):
        yield path, folder_of(path, layers)


def includes(root, path):
    """(line number, included path) of each quoted include with a folder in it."""
    with open(os.path.join(root, path), errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m and "/" in m.group(1):
                yield n, m.group(1)


def diagram(root):
    """Text picture: each layer, top to bottom, with each folder and the folders it includes."""
    layers = read_layers(root)
    uses = {}
    for path, src in sources(root, layers):
        for _, inc in includes(root, path):
            if folder_of(inc, layers) != src:
                uses.setdefault(src, set()).add(folder_of(inc, layers))
    out, last = [], None
    for folder, (rank, layer) in sorted(layers.items(), key=lambda kv: (kv[1][0], kv[0])):
        if layer != last:
            out.append(f"{'':-<78}" if last else "")
            out.append(f"[{layer}]")
            last = layer
        targets = sorted(uses.get(folder, ()), key=lambda f: (layers.get(f, (99,))[0], f))
        out.append(f"  {folder + '/':<17} -> {' '.join(t + '/' for t in targets) or '(nothing of ours)'}")
    tops = {}
    for a, bs in top_uses(root, layers).items():
        for b in bs:
            tops.setdefault(a, set()).add(b)
    out.append(f"{'':-<78}")
    out.append("[top-level folders] " + "; ".join(f"{a}/ -> {' '.join(b + '/' for b in sorted(tops[a]))}"
                                                  for a in sorted(tops)))
    return "\n".join(out[1:])


def top_uses(root, layers):
    """{top folder: {top folder it includes: first (path, line, include) doing so}}."""
    uses = {}
    for path, _ in sources(root, layers):
        for n, inc in includes(root, path):
            a, b = top_of(path), top_of(inc)
            if a != b:
                uses.setdefault(a, {}).setdefault(b, (path, n, inc))
    return uses


def top_circles(root, layers):
    """Each include from one top-level folder into another that includes it back, directly or
    through others (LAYERS may order subfolders so that no include runs upward, yet interleave two
    top-level folders: those must stay one way)."""
    uses = top_uses(root, layers)
    def reach(a):
        seen, todo = set(), [a]
        while todo:
            for b in uses.get(todo.pop(), {}):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    out = []
    for a in sorted(uses):
        for b, (path, n, inc) in sorted(uses[a].items()):
            if a in reach(b):
                out.append(f"{path}:{n}: includes {inc}: top-level folders {a}/ and {b}/ include each "
                           f"other (a circle)")
    return out


def offences(root):
    layers = read_layers(root)
    out = []
    for path, src in sources(root, layers):
        if src not in layers:
            out.append(f"{path}: folder {src}/ is in no layer of LAYERS")
            continue
        for n, inc in includes(root, path):
            dst = folder_of(inc, layers)
            if dst not in layers:
                out.append(f"{path}:{n}: includes {inc}: folder {dst}/ is in no layer of LAYERS")
            elif layers[dst][0] < layers[src][0]:
                out.append(f"{path}:{n}: includes {inc}: {src}/ ({layers[src][1]}) may not "
                           f"include {dst}/ ({layers[dst][1]}), a layer above it")
    return out or top_circles(root, layers)  # a circle with an upward include is named above


def main():
    args = [a for a in sys.argv[1:] if a != "--diagram"]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "..")
    if "--diagram" in sys.argv:
        print(diagram(os.path.abspath(root)))
        return 0
    bad = offences(os.path.abspath(root))
    for line in bad:
        print(line)
    order = " > ".join(f"{l}" for l in dict.fromkeys(l for _, l in sorted(read_layers(root).values())))
    print(f"{len(bad)} include(s) against the layer order ({order})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
