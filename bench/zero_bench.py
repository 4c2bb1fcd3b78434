"""ZeRO stages side by side at one data-parallel size (CPU, Gloo over loopback): exposed
communication and ms per step from metrics.jsonl, and each rank's state bytes from memory.json,
for fp32 and bf16. Exposed communication = host time waiting for gradient reductions backward did
not hide + the weight all-gather after the step (ZeRO-1/2) + ZeRO-3 gathers the prefetch did not
hide. Usage: bench/zero_bench.py OUT_DIR [--dp 2] [--hidden 256] [--layers 8] [--steps 20]
Needs build/bin (make build). Prints two Markdown tables; every run's files stay in OUT_DIR."""
import argparse
import json
import os

import numpy as np

import benchlib

a = argparse.ArgumentParser()
a.add_argument("out")
a.add_argument("--dp", type=int, default=2)
a.add_argument("--hidden", type=int, default=256)
a.add_argument("--layers", type=int, default=8)
a.add_argument("--seq", type=int, default=64)
a.add_argument("--microbatches", type=int, default=2, help="per data rank per step")
a.add_argument("--steps", type=int, default=20)
a.add_argument("--bucket-mb", type=float, default=1.0)
a.add_argument("--dtypes", default="fp32,bf16")
a.add_argument("--port", type=int, default=29650)
args = a.parse_args()
os.makedirs(args.out, exist_ok=True)
data = benchlib.token_file(args.out)


def train(name, zero, dtype):
    benchlib.train(args.out, name, args.dp, args.port, data,
                   {"arch": "llama", "layers": args.layers, "hidden": args.hidden, "heads": 4, "kv_heads": 2,
                    "vocab_size": 512, "max_seq_len": args.seq},
                   {"dp": args.dp, "zero": zero, "ddp": {"bucket_mb": args.bucket_mb}},
                   {"dtype": dtype, "steps": args.steps, "global_batch": args.dp * args.microbatches,
                    "micro_batch": 1, "seq_len": args.seq})
    with open(os.path.join(args.out, name, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "loss" in m][2:]  # the first steps warm up
    with open(os.path.join(args.out, name, "memory.json")) as f:
        mem = json.load(f)["ranks"][0]
    return steps, mem


mib = 1 / 2**20
timing, memory = [], []
for dtype in args.dtypes.split(","):
    for zero in range(4):
        steps, m = train(f"zero{zero}_{dtype}", zero, dtype)
        exposed = [s["comm_exposed_ms"] for s in steps]
        ms = [s["ms_per_step"] for s in steps]
        timing.append(f"| {zero} | {dtype} | {np.median(ms):.1f} | {np.median(exposed):.1f} | "
                      f"{np.percentile(exposed, 90):.1f} | {steps[-1]['loss']:.4f} |")
        psi = m["numel"]
        memory.append(f"| {zero} | {dtype} | {psi} | {m['params_bytes'] * mib:.3f} | {m['grads_bytes'] * mib:.3f} | "
                      f"{m['optimizer_bytes'] * mib:.3f} | "
                      f"{(m['params_bytes'] + m['grads_bytes'] + m['optimizer_bytes']) / psi:.2f} | "
                      f"{m['gathered_peak_bytes'] * mib:.3f} | {m['grad_bucket_peak_bytes'] * mib:.3f} |")

print(f"dp={args.dp}, llama {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
      f"{args.microbatches} micro-batches per rank, bucket_mb {args.bucket_mb}; steps 3-{args.steps}\n")
print("| zero | dtype | ms/step (median) | exposed comm ms (median) | exposed comm ms (p90) | loss at last step |")
print("|---|---|---|---|---|---|")
print("\n".join(timing))
print("\n| zero | dtype | Ψ per rank | weights MiB | gradients MiB | optimizer MiB | bytes per parameter |"
      " gathered peak MiB | gradient buckets peak MiB |")
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(memory))
