"""Tessel against plain PyTorch on the same model, batch, optimizer and threads, side by side.

On CPU (always): configs/default.yaml's GPT-2 (4 layers, hidden 192, seq 128, global batch 16 in
micro-batches of 8, AdamW, clipping at 1.0) and a Llama of similar size, each
  - in one process (2 intra-op threads): Tessel against PyTorch eager with gradient accumulation;
  - data parallel over 2 processes on loopback Gloo (1 thread each): Tessel dp=2 against PyTorch
    DistributedDataParallel.
Rounds are interleaved (Tessel, PyTorch, Tessel, PyTorch, ...) so that drift in the machine's speed
falls on both. Each run's figure is the median step time after its warm-up steps; the table gives
the median over rounds, the ratio PyTorch ms / Tessel ms per round (median, lowest, highest) and
tokens/s. With CUDA present it also runs bench/gpu_bench.py's GPU plans (GPT-2 124M at seq 1024,
Llama-3 1B at seq 2048, bf16) against eager PyTorch and torch.compile.

  python bench/vs_pytorch.py OUT [--rounds 3] [--steps 40] [--only gpt2,llama] [--layouts 1,2]

Prints a Markdown table for bench/RESULTS.md and writes OUT/vs_pytorch.json. The PyTorch model is
bench/torch_reference.py (SDPA attention, tanh-GELU or SwiGLU, tied head for GPT-2)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from benchlib import BIN, ROOT  # noqa: E402

BATCH, MICRO, SEQ = 16, 8, 128
MODELS = {
    "gpt2": {"arch": "gpt2", "layers": 4, "hidden": 192, "heads": 6, "vocab_size": 257, "max_seq_len": SEQ},
    "llama": {"arch": "llama", "layers": 4, "hidden": 192, "heads": 6, "kv_heads": 2, "ffn_hidden": 512,
              "vocab_size": 257, "max_seq_len": SEQ},
}
WARMUP = 8  # steps left out of each run's median (allocator, thread pools, first-touch pages)


def token_file(out, vocab, n):
    path = os.path.join(out, f"tokens_{vocab}.u16")
    if not os.path.exists(path):
        from array import array
        import random
        rng = random.Random(0)
        array("H", (rng.randrange(vocab) for _ in range(n))).tofile(open(path, "wb"))
    return path


def run_tessel(out, name, model, world, steps):
    """Median ms/step after warm-up and the per-step losses of one Tessel run on `world` processes."""
    run_dir = os.path.join(out, name)
    sets = {"run.output_dir": run_dir, "training.steps": steps, "training.global_batch": BATCH,
            "training.micro_batch": MICRO, "training.seq_len": SEQ, "training.eval_every": 0,
            "training.threads": 2 // world, "training.device": "cpu", "training.dtype": "fp32",
            "training.schedule.warmup_steps": 2, "logging.every": 1, "checkpoint.every": 0,
            "checkpoint.resume": "never", "parallel.dp": world, "data.format": "tokens",
            "data.token_dtype": "uint16", "data.val_fraction": 0,
            "data.path": f"[{token_file(out, model['vocab_size'], BATCH * (SEQ + 1) * (steps + 4))}]"}
    sets.update({f"model.{k}": v for k, v in model.items()})
    cmd = [os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(world), "--",
           os.path.join(BIN, "tessel-train"), os.path.join(ROOT, "configs", "default.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"tessel-train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    return statistics.median(r["ms_per_step"] for r in rows[WARMUP:]), [r["loss"] for r in rows]


def torch_worker(spec):
    """One PyTorch process (rank RANK of WORLD_SIZE): the same steps as Tessel, timed per step."""
    import torch
    import torch.distributed as dist
    from torch_reference import Decoder
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    torch.set_num_threads(2 // world)
    torch.manual_seed(spec["seed"])
    model = Decoder(spec["model"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), fused=True)
    g = torch.Generator().manual_seed(rank)
    vocab, micro = int(spec["model"]["vocab_size"]), BATCH // (MICRO * world)
    times = []
    for _ in range(spec["steps"]):
        rows = torch.randint(0, vocab, (BATCH // world, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        for mb in rows.split(MICRO):
            loss = model(mb[:, :-1], mb[:, 1:]) / micro  # a mean over the rank's batch, as Tessel's
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # the step's end, as Tessel logs it
        times.append(1e3 * (time.perf_counter() - t0))
    if world > 1:
        dist.destroy_process_group()
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(times, f)


def run_torch(out, name, model, world, steps, port):
    """Median ms/step after warm-up of the PyTorch run on `world` processes (DDP when 2)."""
    result = os.path.join(out, name + ".json")
    spec = json.dumps({"model": model, "steps": steps, "seed": 1234, "result": result})
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=str(2 // world))
        procs.append(subprocess.Popen([sys.executable, __file__, "--torch-worker", spec], env=env))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"the PyTorch run {name} failed")
    with open(result) as f:
        return statistics.median(json.load(f)[WARMUP:])


def cpu_rows(out, models, layouts, rounds, steps):
    rows, port = [], 29700
    for name in models:
        for world in layouts:
            t_ms, p_ms, losses = [], [], None
            for r in range(rounds):
                tag = f"{name}_dp{world}_r{r}"
                ms, losses = run_tessel(out, "tessel_" + tag, MODELS[name], world, steps)
                t_ms.append(ms)
                port += 1
                p_ms.append(run_torch(out, "torch_" + tag, MODELS[name], world, steps, port))
                print(f"  {tag}: Tessel {ms:.1f} ms, PyTorch {p_ms[-1]:.1f} ms, "
                      f"x{p_ms[-1] / ms:.2f}", file=sys.stderr, flush=True)
            ratios = [p / t for p, t in zip(p_ms, t_ms)]
            rows.append({"model": name, "world": world, "tessel_ms": t_ms, "torch_ms": p_ms, "ratios": ratios,
                         "losses": losses})
    return rows


def table(rows, rounds):
    tokens = BATCH * SEQ
    print(f"| model | layout | Tessel ms/step | PyTorch ms/step | Tessel tok/s | PyTorch tok/s | "
          f"ratio median (min-max over {rounds} rounds) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        t, p = statistics.median(r["tessel_ms"]), statistics.median(r["torch_ms"])
        layout = "1 process, 2 threads" if r["world"] == 1 else "dp=2 Gloo, 1 thread each (PyTorch: DDP)"
        print(f"| {r['model']} | {layout} | {t:.1f} | {p:.1f} | {tokens / t * 1e3:.0f} | {tokens / p * 1e3:.0f} | "
              f"{statistics.median(r['ratios']):.2f}x ({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) |")


def commit():
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--torch-worker":
        return torch_worker(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", default="gpt2,llama", help="models, comma-separated (gpt2, llama)")
    ap.add_argument("--layouts", default="1,2", help="process counts, comma-separated (1, 2)")
    ap.add_argument("--no-gpu", action="store_true", help="skip the GPU plans even when CUDA is present")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch
    cpu = cpu_rows(a.out, a.only.split(","), [int(x) for x in a.layouts.split(",")], a.rounds, a.steps)
    print(f"# bench/vs_pytorch.py: CPU, {os.cpu_count()} cores, torch {torch.__version__}, commit {commit()}, "
          f"{time.strftime('%Y-%m-%d')}, {a.steps} steps per run ({WARMUP} warm-up), batch {BATCH}x{SEQ}")
    table(cpu, a.rounds)
    result = {"commit": commit(), "cpu": cpu}
    if torch.cuda.is_available() and not a.no_gpu:
        gpu_out = os.path.join(a.out, "gpu")
        subprocess.run([sys.executable, os.path.join(HERE, "gpu_bench.py"), gpu_out], check=True)
        with open(os.path.join(gpu_out, "gpu_bench.json")) as f:
            result["gpu"] = json.load(f)
    with open(os.path.join(a.out, "vs_pytorch.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
