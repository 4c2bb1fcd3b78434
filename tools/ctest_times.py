#!/usr/bin/env python3
"""Prints the time per ctest label and the slowest tests of the last run, so that growth shows in
every CI log:  ctest_times.py BUILD_DIR [N]   (N: how many of the slowest, default 10).
Reads BUILD_DIR/ctest-junit.xml (written by `ctest --output-junit ctest-junit.xml`, as the
Makefile's check and test targets run it) and the labels from `ctest --show-only=json-v1`."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET


def main(build, n=10):
    junit = os.path.join(build, "ctest-junit.xml")
    if not os.path.exists(junit):
        sys.exit(f"ctest_times: no {junit} (run ctest with --output-junit ctest-junit.xml)")
    shown = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True)
    labels = {}
    for t in json.loads(shown.stdout)["tests"]:
        for p in t.get("properties", []):
            if p["name"] == "LABELS":
                labels[t["name"]] = p["value"]
    runs = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = case.get("status", "run")
        if case.find("failure") is not None:
            status = "failed"
        elif case.find("skipped") is not None:
            status = "skipped"
        runs.append((float(case.get("time", 0)), case.get("name"), status))
    per_label = {}
    for took, name, _ in runs:
        for label in labels.get(name, ["(none)"]):
            count, total = per_label.get(label, (0, 0.0))
            per_label[label] = (count + 1, total + took)
    print(f"\nctest times ({len(runs)} entries; a label's time is the sum of its entries' own times,"
          " which run two at a time where both fit)")
    print(f"{'label':<12} {'entries':>7} {'seconds':>9}")
    for label, (count, total) in sorted(per_label.items(), key=lambda kv: -kv[1][1]):
        print(f"{label:<12} {count:>7} {total:>9.1f}")
    print(f"\nthe {n} slowest entries")
    for took, name, status in sorted(runs, reverse=True)[:n]:
        print(f"{took:>9.1f} s  {name}{'' if status == 'run' else '  (' + status + ')'}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
