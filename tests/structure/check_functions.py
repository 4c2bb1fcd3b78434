#!/usr/bin/env python3
"""Lists every function body longer than the limit (default 60 lines) in the folders whose code
should read as its steps. Usage: check_functions.py [ROOT] [--limit N] [--all] (--all: print
every function over 40 lines, longest first). Exit 1 when any is over the limit.

A function body is a brace block at namespace or class scope whose head (the text since the
previous `;`, `{` or `}`) ends with `)`, a qualifier after it, or a constructor's initialiser
list. Comments, strings and raw strings are blanked first, so braces in them do not count."""
import os
import re
import sys

FOLDERS = ["engine", "models", "parallel", "core", "launcher", "tools"]
SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b[^()]*$|extern\s+\"C\"\s*$")
HEAD = re.compile(r"\)\s*(const|override|final|noexcept|mutable|->\s*[\w:<>,\s*&]+|\s)*$")


def blank(text):
    """Comments, character and string literals (raw ones too) replaced by spaces; newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i) + 2
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            delim = text[i + 2:text.find("(", i)]
            j = text.find(")" + delim + '"', i) + len(delim) + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            out.append(c)
            i += 1
            continue
        out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
        i = j
    return "".join(out)


def functions(text):
    """(first line, line count, head) of each function body at namespace or class scope."""
    code = blank(text)
    stack, found, start = [], [], 0  # stack: "scope" | "fn" | "other" per open brace
    for i, c in enumerate(code):
        if c in ";{}":
            head = code[start:i].strip()
            if c == "{":
                in_fn = any(k == "fn" for k, _ in stack)
                if SCOPE.search(head) and not in_fn:
                    stack.append(("scope", i))
                elif not in_fn and (HEAD.search(head) or re.search(r"\)\s*:\s*[\w:]+[({]", head)
                                    or re.search(r"[)}]\s*$", head) and ") :" in head):
                    stack.append(("fn", i))
                else:
                    stack.append(("other", i))
            elif c == "}" and stack:
                kind, at = stack.pop()
                if kind == "fn":
                    first = code.count("\n", 0, at) + 1
                    last = code.count("\n", 0, i) + 1
                    head_start = code.rfind("\n", 0, at)
                    found.append((first, last - first + 1, code[head_start + 1:at].strip()[:70]))
            start = i + 1
    return found


def long_functions(root, limit):
    out = []
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if name.endswith((".h", ".cpp", ".cu")):
                    path = os.path.join(dirpath, name)
                    with open(path, errors="replace") as f:
                        for line, n, head in functions(f.read()):
                            if n > limit:
                                out.append((n, os.path.relpath(path, root), line, head))
    return sorted(out, reverse=True)


def main():
    args = sys.argv[1:]
    limit = 60
    if "--limit" in args:
        limit = int(args[args.index("--limit") + 1])
        del args[args.index("--limit"):args.index("--limit") + 2]
    show_all = "--all" in args
    args = [a for a in args if a != "--all"]
    root = args[0] if args else os.path.join(os.path.dirname(__file__), "..", "..")
    for n, path, line, head in long_functions(os.path.abspath(root), 40 if show_all else limit):
        print(f"{path}:{line}: {n} lines: {head}")
    over = [f for f in long_functions(os.path.abspath(root), limit)]
    print(f"{len(over)} function(s) over {limit} lines in {', '.join(f + '/' for f in FOLDERS)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
