"""Float8 training on one GPU (training.fp8): Tessel bf16, Tessel fp8 tensorwise and rowwise, and
torchao's float8 training (the same recipes, convert_to_float8_training on bench/torch_reference.py's
decoder, every linear layer but the head) under torch.compile, on Llama-3 1B (configs/llama3-1b.yaml's
model) and on Llama-3 8B's layer shapes cut to 4 layers (configs/llama3-8b.yaml's model), bf16,
world size 1. Prints one Markdown table; writes OUT/fp8_bench.json. bench/gpu-check.sh runs it after
bench/gpu_bench.py.

Without a GPU it runs the CPU dry path: a small llama-shaped model, Tessel fp8 tensorwise and
torchao tensorwise eager (torchao's rowwise recipe and torch.compile's float8 kernels need a GPU), a
few steps: a check that the script works, not a figure to report."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import unusable_gpu_reason  # noqa: E402
from gpu_bench import commit, model_section, plan_model, run_pytorch, run_tessel  # noqa: E402

import torch  # noqa: E402


def models(cpu):
    """(name, model keys, batch, seq, steps)."""
    if cpu:
        return [("llama shape (cpu, 2x128)", {"arch": "llama", "layers": 2, "hidden": 128, "heads": 4,
                                              "kv_heads": 2, "ffn_hidden": 256, "vocab_size": 4096}, 2, 64, 6)]
    return [("llama3-1B", plan_model("llama3-1b.yaml"), 4, 2048, 20),
            ("llama3-8B shapes, 4 layers", dict(plan_model("llama3-8b.yaml"), layers="4"), 2, 4096, 20)]


def run_torchao(m, batch, seq, steps, cpu, recipe):
    """torchao float8 (`recipe`) on the reference decoder, compiled on a GPU: tokens/s, peak bytes."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def convert(model):
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn != "head")
    return run_pytorch(m, batch, seq, steps, cpu, not cpu, convert)


def table_row(name, batch, seq, run, r, rows):
    """One Markdown row: the run's figures and its ratios to Tessel bf16 and to torchao's run of
    the same recipe (Tessel's rows only)."""
    if "error" in r:
        return f"| {name} | {batch}x{seq} | {run} | ({r['error']}) | - | - | - | - |"

    def ratio(other):
        o = rows.get(other, {}).get("tok_s")
        return f"{r['tok_s'] / o:.2f}" if o else "-"
    ao = ratio(f"torchao {run.split()[-1]}") if run.startswith("tessel") and not run.endswith("off") else "-"
    return (f"| {name} | {batch}x{seq} | {run} | {r['tok_s']:.0f} | {100 * r['mfu']:.1f}% | "
            f"{r['mem'] / 2**30:.2f} | {ratio('tessel off')} | {ao} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--cpu", action="store_true", help="the CPU dry path (automatic without CUDA)")
    a = ap.parse_args()
    if not a.cpu and unusable_gpu_reason():
        raise SystemExit(f"fp8_bench: {unusable_gpu_reason()}")
    cpu = a.cpu or not torch.cuda.is_available()
    os.makedirs(a.out, exist_ok=True)
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    print(f"# float8 on {device}, torch {torch.__version__}, commit {commit()}"
          f"{' (CPU dry path: not a figure to report)' if cpu else ''}", flush=True)
    print("| model | batch x seq | run | tok/s | MFU | peak GiB | / Tessel fp8 off | / torchao same recipe |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    recipes = ["tensorwise"] if cpu else ["tensorwise", "rowwise"]
    for name, model, batch, seq, steps in models(cpu):
        rows = {}
        for fp8 in ["off"] + recipes:
            try:
                tps, mfu, gflop, peak, resolved, mem = run_tessel(a.out, f"{name} fp8 {fp8}", model, batch, seq,
                                                                  steps, cpu, training={"fp8": fp8})
                rows[f"tessel {fp8}"] = {"tok_s": tps, "mfu": mfu, "mem": mem, "gflop": gflop, "peak": peak}
            except SystemExit as e:
                rows[f"tessel {fp8}"] = {"error": str(e).splitlines()[0][:160]}
        m = model_section(resolved)
        for recipe in recipes:
            ours = rows[f"tessel {recipe}"]
            try:
                t, mem = run_torchao(m, batch, seq, steps, cpu, recipe)
                # MFU against the peak Tessel's run of the recipe names (the fp8 peak on a GPU)
                mfu = t * ours["gflop"] * 1e9 / (ours["peak"] * 1e12) if "peak" in ours else float("nan")
                rows[f"torchao {recipe}"] = {"tok_s": t, "mem": mem, "mfu": mfu}
            except Exception as e:  # a missing torchao or toolchain: say why
                rows[f"torchao {recipe}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        for run, r in rows.items():
            print(table_row(name, batch, seq, run, r, rows), flush=True)
        results.append({"model": name, "batch": batch, "seq": seq, "runs": rows})
        with open(os.path.join(a.out, "fp8_bench.json"), "w") as f:
            json.dump({"device": device, "cpu_dry_path": cpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
