"""Context parallelism at a long sequence (CPU, Gloo over loopback): per-rank activation memory
and step time against cp=1, for every method, from tessel-train runs; then the attention alone
(tessel-bench-cp: time and bytes moved per rank against theory). Activation memory = the process's
peak resident set at the end minus its peak before the first step (memory.json), which on CPU is
what the steps added. Usage: bench/cp_bench.py OUT_DIR [--seq 1024] [--cps 2,4] [--steps 6]
Needs build/bin (make build). Prints Markdown tables; every run's files stay in OUT_DIR."""
import argparse
import json
import os
import re
import subprocess

import numpy as np

import benchlib

a = argparse.ArgumentParser()
a.add_argument("out")
a.add_argument("--seq", type=int, default=1024)
a.add_argument("--cps", default="2,4")
a.add_argument("--steps", type=int, default=6)
a.add_argument("--hidden", type=int, default=256)
a.add_argument("--layers", type=int, default=4)
a.add_argument("--port", type=int, default=29670)
args = a.parse_args()
os.makedirs(args.out, exist_ok=True)
data = benchlib.token_file(args.out)


def train(cp, method):
    name = f"cp{cp}_{method}"
    log = benchlib.train(args.out, name, cp, args.port, data,
                         {"arch": "llama", "layers": args.layers, "hidden": args.hidden, "heads": 8, "kv_heads": 4,
                          "vocab_size": 512, "max_seq_len": args.seq},
                         {"cp": cp, "context": {"method": method}},
                         {"steps": args.steps, "global_batch": 1, "micro_batch": 1, "seq_len": args.seq})
    with open(os.path.join(args.out, name, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m][1:]  # the first step warms up
    with open(os.path.join(args.out, name, "memory.json")) as f:
        ranks = json.load(f)["ranks"]
    act = [(r["peak_rss_bytes"] - r["setup_peak_rss_bytes"]) / 2**20 for r in ranks]
    traffic = re.search(r"context-parallel traffic: (\d+) bytes per step per rank in collective payloads, (\d+) sent",
                        log)
    return (np.median([s["ms_per_step"] for s in steps]), act, steps[-1]["loss"],
            tuple(int(x) for x in traffic.groups()) if traffic else (0, 0))


print(f"llama {args.layers} layers, hidden {args.hidden}, 8 heads (4 key/value), seq {args.seq}, one sequence "
      f"per step, fp32, steps 2-{args.steps} timed\n")
print("| layout | ms/step (median) | activation MiB per rank (peak RSS growth) | loss at last step |"
      " cp traffic per step per rank: collective payload / p2p sent (B) |")
print("|---|---|---|---|---|")
ms, act, loss, _ = train(1, "allgather")
print(f"| cp=1 | {ms:.0f} | {act[0]:.1f} | {loss:.4f} | - |")
for cp in map(int, args.cps.split(",")):
    for method in ("allgather", "ring", "alltoall"):
        ms, act, loss, (coll, sent) = train(cp, method)
        print(f"| cp={cp} {method} | {ms:.0f} | {' / '.join(f'{x:.1f}' for x in act)} | {loss:.4f} | {coll} / {sent} |")
for cp in map(int, args.cps.split(",")):
    print()
    out = subprocess.run([os.path.join(benchlib.BIN, "tessel-launch"), "--nproc-per-node", str(cp), "--master-port",
                          str(args.port), "--", os.path.join(benchlib.BIN, "tessel-bench-cp"), "--seq", str(args.seq)],
                         check=True, capture_output=True, text=True).stdout
    print("\n".join(line.replace("[rank 0] ", "") for line in out.splitlines() if line.startswith("[rank 0]")))
