"""Pipeline bubble as the executor measures it (idle time / step time per stage, steps after the
first) beside the schedule's theory, for GPipe, 1F1B, interleaved 1F1B and the zero-bubble ZB-H1
and ZBV on CPU (Gloo over loopback). Usage: bench/pp_bubble.py OUT_DIR [--pp 4] [--microbatches 8] [--hidden 128] [--layers-per-stage 5,3]
Needs build/bin (make build). Prints a Markdown table; each run's pipeline.json stays in OUT_DIR."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "bin")

a = argparse.ArgumentParser()
a.add_argument("out")
a.add_argument("--pp", type=int, default=4)
a.add_argument("--microbatches", type=int, default=8)
a.add_argument("--hidden", type=int, default=128)
a.add_argument("--layers", type=int, default=8)
a.add_argument("--seq", type=int, default=64)
a.add_argument("--steps", type=int, default=12)
a.add_argument("--port", type=int, default=29630)
a.add_argument("--layers-per-stage", default="", help="comma-separated, e.g. 5,3 (default: even)")
a.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb-h1,zbv")
args = a.parse_args()
os.makedirs(args.out, exist_ok=True)
data = os.path.join(args.out, "tokens.u16")
np.random.default_rng(0).integers(0, 512, size=200_000, dtype=np.uint16).tofile(data)

print(f"| schedule | p | m | v | theory | measured per stage (idle / step) | ms/step | activations held per stage |")
print("|---|---|---|---|---|---|---|---|")
for schedule in args.schedules.split(","):
    v = 2 if schedule in ("interleaved", "zbv") else 1
    per_stage = [int(x) for x in args.layers_per_stage.split(",")] if args.layers_per_stage else []
    name = f"{schedule}_p{args.pp}_m{args.microbatches}_v{v}"
    plan = {"run": {"name": name, "output_dir": os.path.join(args.out, name)},
            "model": {"arch": "gpt2", "layers": args.layers, "hidden": args.hidden, "heads": 4,
                      "vocab_size": 512, "max_seq_len": args.seq},
            "parallel": {"pp": args.pp, "pipeline": {"schedule": schedule, "virtual_stages": v,
                                                      "layers_per_stage": per_stage}},
            "training": {"device": "cpu", "steps": args.steps, "global_batch": args.microbatches,
                         "micro_batch": 1, "seq_len": args.seq, "threads": 1,
                         "schedule": {"warmup_steps": 1}},
            "data": {"format": "tokens", "path": [data], "token_dtype": "uint16"},
            "checkpoint": {"resume": "never", "every": 0, "dir": os.path.join(args.out, name, "ckpt")},
            "logging": {"every": args.steps}}
    path = os.path.join(args.out, name + ".yaml")
    with open(path, "w") as f:
        json.dump(plan, f)  # JSON is YAML
    subprocess.run([os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(args.pp), "--master-port",
                    str(args.port), "--", os.path.join(BIN, "tessel-train"), path],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(args.out, name, "pipeline.json")) as f:
        p = json.load(f)
    ranks = sorted(p["ranks"], key=lambda r: r["pp"])
    measured = " ".join("%.3f" % r["bubble"] for r in ranks)
    held = " ".join(str(r["peak_activations"]) for r in ranks)
    step_ms = np.mean([r["step_ms"] for r in ranks])
    print(f"| {schedule} | {args.pp} | {args.microbatches} | {v} | {p['theory_bubble']:.3f} | {measured} | "
          f"{step_ms:.1f} | {held} |")
    sys.stdout.flush()
