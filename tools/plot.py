#!/usr/bin/env python3
"""Plots a run's metrics.jsonl as PNGs: loss (train and validation), throughput and MFU, memory.

    tools/plot.py RUN_DIR_OR_METRICS_JSONL [more runs ...] [--out DIR] [--x step|tokens]

Several runs are drawn on the same axes (labelled by folder), e.g. to compare layouts. Writes
loss.png, throughput.png and memory.png into --out (default: the first run's folder). Needs
matplotlib: run by any python3, it re-runs itself with the first Python that has it among
$TESSEL_PYTHON, the checkout's .env and the per-user cache's environment
(${TESSEL_CACHE:-~/.cache/tessel}/py-torch*), where `make test` installs it.
"""
import argparse
import glob
import json
import os
import subprocess
import sys


def python_with_matplotlib():
    """A Python that can import matplotlib, or exits naming the ones it tried."""
    here = os.path.dirname(os.path.abspath(__file__))
    cache = os.environ.get("TESSEL_CACHE", os.path.expanduser("~/.cache/tessel"))
    tried = []
    for py in [os.environ.get("TESSEL_PYTHON"), os.path.join(here, "..", ".env", "bin", "python"),
               *sorted(glob.glob(os.path.join(cache, "py-torch*", "bin", "python")))]:
        if not py or not os.path.exists(py) or py in tried:
            continue
        tried.append(py)
        if subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode == 0:
            return py
    sys.exit("plot: matplotlib is missing from this Python (" + sys.executable + ")" +
             (" and from " + ", ".join(tried) if tried else "") +
             ": pip install matplotlib, or set TESSEL_PYTHON to a Python that has it")


def read(path):
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"plot: {path}:{n}: not JSON ({e})")
    if not any("loss" in r for r in rows):
        sys.exit(f"plot: {path}: no training steps logged")
    return path, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="run folders (run.output_dir) or metrics.jsonl files")
    ap.add_argument("--out", help="folder for the PNGs (default: the first run's folder)")
    ap.add_argument("--x", choices=["step", "tokens"], default="step", help="horizontal axis")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if os.environ.get("TESSEL_PLOT_REEXEC"):
            sys.exit("plot: matplotlib is missing")
        py = python_with_matplotlib()
        os.execve(py, [py, os.path.abspath(__file__), *sys.argv[1:]], dict(os.environ, TESSEL_PLOT_REEXEC="1"))
    runs = [read(p) for p in args.runs]
    out = args.out or os.path.dirname(os.path.abspath(runs[0][0]))
    os.makedirs(out, exist_ok=True)

    def series(rows, key):
        pts = [(r.get(args.x, r["step"]), r[key]) for r in rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    figures = {
        "loss.png": [("loss", "train loss", "-"), ("val_loss", "validation loss", "o--")],
        "throughput.png": [("tokens_per_s_global", "tokens/s (global)", "-"),
                           ("tokens_per_s_per_device", "tokens/s per device", "--")],
        "memory.png": [("mem_bytes", "memory (GiB)", "-")],
    }
    written = []
    for name, keys in figures.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for path, rows in runs:
            label = os.path.basename(os.path.dirname(os.path.abspath(path)))
            for key, what, style in keys:
                x, y = series(rows, key)
                if key == "mem_bytes":
                    y = [v / 2**30 for v in y]
                if x:
                    ax.plot(x, y, style, label=f"{label}: {what}" if len(runs) > 1 else what)
        handles = []
        if name == "throughput.png":  # MFU on its own axis, one labelled line per run
            ax2 = ax.twinx()
            for path, rows in runs:
                label = os.path.basename(os.path.dirname(os.path.abspath(path)))
                x, y = series(rows, "mfu")
                if x:
                    ax2.plot(x, [100 * v for v in y], ":", label=f"{label}: MFU" if len(runs) > 1 else "MFU")
            ax2.set_ylabel("MFU (%)")
            handles = ax2.get_legend_handles_labels()
        ax.set_xlabel("tokens consumed" if args.x == "tokens" else "step")
        ax.grid(alpha=0.3)
        h, lab = ax.get_legend_handles_labels()
        if handles:
            h, lab = h + handles[0], lab + handles[1]
        ax.legend(h, lab, loc="best", fontsize=8)
        ax.set_title(name[:-4])
        fig.tight_layout()
        target = os.path.join(out, name)
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    print("\n".join(written))


if __name__ == "__main__":
    main()
