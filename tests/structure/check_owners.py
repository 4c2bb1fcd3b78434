#!/usr/bin/env python3
"""Decisions that have one owner: code elsewhere asks the owner's interface, never the decision's
raw value. An architecture's name (plan::ModelArch) is compared only in core/plan/ (the plan) and
models/registry.cpp with the entries it registers (models/gpt2.cpp, models/llama.cpp): everything
above models/ asks models::features() what the architecture builds. The ZeRO stage (the plan's
parallel.zero, a number) is read only in core/plan/ (plan::Sharding, the one reading of it) and
parallel/dp/ (the synchronisation each stage is): everything else asks a Sharding, its flat
layout's or the plan's, what is sharded. Exits 1 naming each line outside its owner (comments
and string literals are not code). Usage: check_owners.py [ROOT]"""
import os
import re
import sys

from check_layers import tree_sources

# (what, pattern, owner paths: a folder ends with /)
RULES = [
    ("an architecture's name", re.compile(r"\bModelArch::k\w+"),
     ("core/plan/", "models/registry.cpp", "models/gpt2.cpp", "models/llama.cpp")),
    ("the ZeRO stage",
     re.compile(r"\bparallel\.zero\b|\.zero\(\)|\bzero\s*(==|!=|<=|>=|<|>)\s*\d|\d\s*(==|!=|<=|>=|<|>)\s*[\w.]*\bzero\b"),
     ("core/plan/", "parallel/dp/")),
]
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def owned(path, owners):
    return any(path.startswith(o) if o.endswith("/") else path == o for o in owners)


def violations(root):
    out = []
    for path in tree_sources(root):
        path = path.replace(os.sep, "/")
        if path.startswith("tests/"):
            continue
        with open(os.path.join(root, path), errors="replace") as f:
            lines = f.readlines()
        for what, pat, owners in RULES:
            if owned(path, owners):
                continue
            for n, line in enumerate(lines, 1):
                code = STRING.sub('""', line).split("//")[0]
                if pat.search(code):
                    out.append(f"{path}:{n}: {what} outside its owners ({', '.join(owners)}): {code.strip()}")
    return out


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    bad = violations(root)
    for line in bad:
        print(line)
    print(f"{len(bad)} decision(s) read outside their owners")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
