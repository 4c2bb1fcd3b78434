"""Tessel against PyTorch on one GPU, in one sitting: configs/default.yaml's model, GPT-2 124M at
seq 1024 and Llama-3 1B (configs/llama3-1b.yaml's model) at seq 2048, bf16, world size 1, then the
same model and batch in plain PyTorch (bench/torch_reference.py) eager and under torch.compile
(bf16 autocast, fp32 master weights, fused AdamW, clipping). Prints tokens/s, MFU, peak memory and
the ratios; writes OUT/gpu_bench.json. bench/gpu.sh (checkout) and bench/gpu-check.sh (checkout or
installed bundle) run it. Needs only torch: no transformers, no numpy.

Without a GPU (--cpu, or on a machine with no GPU) it runs the same path on the CPU with a tiny
model and a few steps: a check that the script works, not a figure to report."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import BIN, ROOT, unusable_gpu_reason  # noqa: E402

import torch  # noqa: E402

from torch_reference import Decoder  # noqa: E402

GPT2_124M = {"arch": "gpt2", "layers": 12, "hidden": 768, "heads": 12, "vocab_size": 50304, "max_seq_len": 1024}


def plans(cpu):
    """(name, model keys over configs/default.yaml's model, batch, seq, steps)."""
    if cpu:  # small stand-ins and a few steps: the path works, the figures mean nothing (one
        # per architecture: GPT-2 124M takes the default's code path, so it has no stand-in here)
        return [("default (cpu, 2 layers)", {"layers": 2}, 4, 64, 6),
                ("llama shape (cpu, 2x128, gqa)", {"arch": "llama", "layers": 2, "hidden": 128, "heads": 4,
                                                   "kv_heads": 2, "ffn_hidden": 256, "vocab_size": 4096}, 2, 64, 6)]
    return [("default", {}, 64, 128, 40), ("gpt2-124M", GPT2_124M, 8, 1024, 30),
            ("llama3-1B", plan_model("llama3-1b.yaml"), 4, 2048, 20)]


def plan_model(name):
    """The model section of configs/NAME (flat `key: value` lines; no YAML library needed)."""
    m, inside = {}, False
    with open(os.path.join(ROOT, "configs", name)) as f:
        for line in f:
            if line.startswith("model:"):
                inside = True
            elif inside and line.startswith("  ") and ":" in line:
                k, v = line.split("#")[0].strip().split(":", 1)
                m[k.strip()] = v.strip()
            elif inside and line.strip():
                break
    return m


def default_model():
    return plan_model("default.yaml")


def token_file(out, vocab, n):
    path = os.path.join(out, f"tokens_{vocab}.u16")
    if not os.path.exists(path):
        from array import array
        toks = torch.randint(0, int(vocab), (n,), generator=torch.Generator().manual_seed(0))
        with open(path, "wb") as f:
            array("H" if int(vocab) <= 65536 else "I", toks.tolist()).tofile(f)
    return path


class GraphNotCaptured(Exception):
    """A training.cuda_graph run whose step was never captured: its throughput is eager's, and is
    not reported as the graph's."""


def run_tessel(out, name, model, batch, seq, steps, cpu, graph=False, training=None):
    """Trains with tessel-train under tessel-launch (world 1); returns (tokens/s, MFU, GFLOP/token,
    peak TFLOP/s, the resolved model section). `graph`: with training.cuda_graph; `training`: more
    training keys (training.fp8)."""
    run_dir = os.path.join(out, re.sub(r"\W+", "_", name) + ("_graph" if graph else ""))
    sets = [f"run.output_dir={run_dir}", f"training.steps={steps}", f"training.global_batch={batch}",
            f"training.micro_batch={batch}", f"training.seq_len={seq}", "training.eval_every=0",
            "logging.every=1", "checkpoint.every=0", "checkpoint.resume=never",
            f"training.device={'cpu' if cpu else 'cuda'}", f"training.dtype={'fp32' if cpu else 'bf16'}",
            f"parallel.backend={'gloo' if cpu else 'nccl'}", "training.schedule.warmup_steps=2",
            f"training.cuda_graph={'true' if graph else 'false'}"]
    sets += [f"model.{k}={v}" for k, v in model.items()]
    sets += [f"training.{k}={v}" for k, v in (training or {}).items()]
    vocab = dict(default_model(), **model)["vocab_size"]
    sets.append(f"data.path=[{token_file(out, vocab, batch * (seq + 1) * (steps + 2) + 10)}]")
    sets += ["data.format=tokens", f"data.token_dtype={'uint16' if int(vocab) <= 65536 else 'uint32'}",
             "data.val_fraction=0"]
    cmd = [os.path.join(BIN, "tessel-launch"), "--nproc-per-node", "1", "--",
           os.path.join(BIN, "tessel-train"), os.path.join(ROOT, "configs", "default.yaml")]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"tessel-train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    if graph and not re.search(r"training\.cuda_graph: step \d+ captured", p.stdout + p.stderr):
        why = [ln for ln in (p.stdout + p.stderr).splitlines() if "cuda_graph" in ln]
        raise GraphNotCaptured(why[-1].strip() if why else "the log names no captured step")
    gflop = float(re.search(r"MFU: ([0-9.e+-]+) GFLOP/token", p.stdout).group(1))
    peak = float(re.search(r"peak ([0-9.e+-]+) TFLOP/s", p.stdout).group(1))
    with open(os.path.join(run_dir, "config.yaml")) as f:
        resolved = f.read()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    timed = rows[len(rows) // 4:]  # after warm-up
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    mem = max(r["mem_bytes"] for r in rows)
    return tps, mfu, gflop, peak, resolved, mem


def model_section(resolved):
    """The model keys of a resolved config.yaml (a flat YAML section)."""
    m, inside = {}, False
    for line in resolved.splitlines():
        if line.startswith("model:"):
            inside = True
            continue
        if inside and not line.startswith("  "):
            break
        if inside and ":" in line:
            k, v = line.strip().split(":", 1)
            m[k.strip()] = v.strip()
    return m


def run_pytorch(m, batch, seq, steps, cpu, compile_, convert=None):
    """The same decoder in plain PyTorch: (tokens/s median after warm-up, peak bytes allocated).
    `convert`: applied to the model first (bench/fp8_bench.py: torchao's float8 layers)."""
    dev = "cpu" if cpu else "cuda"
    model = Decoder(m).to(dev)
    if convert:
        convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not cpu)
    fwd = torch.compile(model) if compile_ else model
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, int(m["vocab_size"]), (batch, seq + 1), generator=g).to(dev)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=not cpu):
            loss = fwd(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    mem = torch.cuda.max_memory_allocated() if not cpu else 0
    del model, opt, fwd
    if not cpu:
        torch.cuda.empty_cache()
    return batch * seq / statistics.median(times[len(times) // 4:]), mem


def commit():
    """The checkout's commit, or the one an installed bundle was built from."""
    path = os.path.join(ROOT, "COMMIT")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--cpu", action="store_true", help="the CPU dry path (automatic without CUDA)")
    ap.add_argument("--compile-by", type=float, default=None, metavar="S",
                    help="start a torch.compile run only while the bench has run under S seconds "
                         "(compiling Llama-3 1B takes about 75 s on an H200); later rows say so")
    a = ap.parse_args()
    if not a.cpu and unusable_gpu_reason():  # no CPU figures passed off where a GPU should run
        raise SystemExit(f"gpu_bench: {unusable_gpu_reason()}")
    cpu = a.cpu or not torch.cuda.is_available()
    os.makedirs(a.out, exist_ok=True)
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    print(f"# bench/gpu.sh on {device}, torch {torch.__version__}, commit "
          f"{commit()}"
          f"{' (CPU dry path: not a figure to report)' if cpu else ''}", flush=True)
    print("| plan | batch x seq | Tessel tok/s | MFU | peak GiB | Tessel + CUDA graph tok/s | MFU | "
          "PyTorch eager tok/s | MFU | peak GiB | torch.compile tok/s | MFU | peak GiB | Tessel / eager | "
          "Tessel / compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    started = time.perf_counter()
    for name, model, batch, seq, steps in plans(cpu):
        tps, mfu, gflop, peak, resolved, mem = run_tessel(a.out, name, model, batch, seq, steps, cpu)
        m = model_section(resolved)
        row = {"plan": name, "batch": batch, "seq": seq, "tessel_tok_s": tps, "tessel_mfu": mfu,
               "tessel_mem": mem}
        if not cpu:  # the same plan with its step captured and replayed (training.cuda_graph)
            try:
                row["graph_tok_s"], row["graph_mfu"] = run_tessel(a.out, name, model, batch, seq, steps, cpu,
                                                                  graph=True)[:2]
            except GraphNotCaptured as e:
                row["graph_error"] = f"not captured: {e}"[:160]
        for label, comp in (("eager", False), ("compile", True)):
            elapsed = time.perf_counter() - started
            if comp and a.compile_by is not None and elapsed > a.compile_by:
                row[f"{label}_error"] = f"not run: {elapsed:.0f} s past --compile-by {a.compile_by:.0f}"
                continue
            try:
                t, pmem = run_pytorch(m, batch, seq, steps, cpu, comp)
                row[f"{label}_tok_s"] = t
                row[f"{label}_mem"] = pmem
                row[f"{label}_mfu"] = t * gflop * 1e9 / (peak * 1e12) if peak > 0 else 0.0
            except Exception as e:  # torch.compile needs a working toolchain; say why it is missing
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        results.append(row)
        # Each row as it is measured, and the JSON rewritten: a run stopped by a time limit keeps
        # the rows it finished.
        print(table_row(row), flush=True)
        with open(os.path.join(a.out, "gpu_bench.json"), "w") as f:
            json.dump({"device": device, "cpu_dry_path": cpu, "results": results}, f, indent=1)


def table_row(r):
    """One Markdown row of the report."""
    def cell(k):
        return f"{r[k + '_tok_s']:.0f} | {100 * r[k + '_mfu']:.1f}% | {r[k + '_mem'] / 2**30:.2f}" \
            if k + "_tok_s" in r else f"({r.get(k + '_error', 'n/a')}) | - | -"

    def ratio(k):
        return f"{r['tessel_tok_s'] / r[k + '_tok_s']:.2f}" if k + "_tok_s" in r else "-"
    return (f"| {r['plan']} | {r['batch']}x{r['seq']} | {r['tessel_tok_s']:.0f} | {100 * r['tessel_mfu']:.1f}% | "
            f"{r['tessel_mem'] / 2**30:.2f} | "
            + (f"{r['graph_tok_s']:.0f} | {100 * r['graph_mfu']:.1f}% | " if "graph_tok_s" in r
               else f"({r['graph_error']}) | - | " if "graph_error" in r else "- | - | ")
            + f"{cell('eager')} | {cell('compile')} | {ratio('eager')} | {ratio('compile')} |")


if __name__ == "__main__":
    main()
