#!/usr/bin/env python3
"""Finds every comparison of a typed plan choice (a `Choice<E>` member of core/plan/config.h)
with a string literal outside core/plan/: those keys are compared with their enum values, so that
a new value is found by the compiler. A choice is found under its member's name and under its
key's last part, whether as a member (`c.training.kernels`, `m_.score`) or as a plain variable
or parameter that carries it (`kernels`, `score`); so is a communicator's kind read from c10d
(`getBackendName()`), which Group reads once. Also names the enumerated keys still held as strings (a
`.one_of(...)` field of core/plan/config_fields.cpp). Exits 1 on any comparison. Usage:
check_choices.py [ROOT]"""
import os
import re
import sys

from check_layers import tree_sources



def typed_members(root):
    with open(os.path.join(root, "core", "plan", "config.h")) as f:
        return sorted(set(re.findall(r"^\s*Choice<\w+>\s+(\w+);", f.read(), re.M)))


def string_choice_keys(root, typed):
    """Keys declared with .one_of(...) whose member is not a Choice."""
    with open(os.path.join(root, "core", "plan", "config_fields.cpp")) as f:
        text = f.read()
    out = []
    for m in re.finditer(r'add\("([\w.]+)",\s*&c\.[\w.]*?(\w+),(.*?)\);[ \t]*$', text, re.S | re.M):
        if ".one_of(" in m.group(3) and m.group(2) not in typed:
            out.append(m.group(1))
    return out


def choice_names(root, typed):
    """The typed members and the last part of each typed key ("score" for model.moe.router.score)."""
    with open(os.path.join(root, "core", "plan", "config_fields.cpp")) as f:
        text = f.read()
    names = set(typed)
    for m in re.finditer(r'add\("([\w.]+)",\s*&c\.[\w.]*?(\w+),', text):
        if m.group(2) in typed:
            names.add(m.group(1).split(".")[-1])
    return sorted(names)


def comparisons(root, typed):
    if not typed:
        return []
    names = "|".join(choice_names(root, typed) + [r"getBackendName\(\)", r"backend_name\(\)"])
    pat = re.compile(r'(?<![\w"])(' + names + r')\s*(==|!=)\s*"|"\s*(==|!=)\s*(?:[\w\]\)]+(?:\.|->))*(' +
                     names + r')(?!\w)')
    out = []
    plan_dir = os.path.join("core", "plan") + os.sep
    for path in tree_sources(root):
        if path.startswith(plan_dir):
            continue
        with open(os.path.join(root, path), errors="replace") as f:
            for n, line in enumerate(f, 1):
                code = line.split("//")[0]
                m = pat.search(code)
                if m:
                    out.append(f"{path}:{n}: plan choice {m.group(1) or m.group(4)} compared with a "
                               f"string: {code.strip()}")
    return out


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    typed = typed_members(root)
    bad = comparisons(root, typed)
    for line in bad:
        print(line)
    pending = string_choice_keys(root, typed)
    print(f"{len(bad)} comparison(s) of a typed plan choice with a string outside core/plan/ "
          f"(typed: {', '.join(typed) or 'none'}; enumerated keys still held as strings: "
          f"{len(pending)}: {', '.join(pending)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
