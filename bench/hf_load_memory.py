"""Host memory per rank loading Hugging Face weights (issue: sharded checkpoints without a copy
per rank). Writes a random Llama with transformers, as one file and as save_pretrained's shards,
then trains one step of it at tp2 x pp2 (4 processes on this machine) from each, and prints each
rank's resident-set peak during set-up (memory.json setup_peak_rss_bytes) against the model's size
and one rank's part. Usage:
  python3 bench/hf_load_memory.py OUT [--bin DIR ...] [--hidden 1024 --layers 16 --vocab 32000]
Each --bin DIR (a build's bin folder) is measured on the single file; the first also on the shards
and with no weights read at all (seeded init), the floor: the rank's part, its optimizer state and
the process.
"""
import argparse
import json
import os
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--bin", action="append", default=[])
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--layers", type=int, default=16)
ap.add_argument("--ffn", type=int, default=2816)
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--shard", default="200MB")
a = ap.parse_args()
bins = a.bin or [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "bin")]
os.makedirs(a.out, exist_ok=True)
one, shards = os.path.join(a.out, "one"), os.path.join(a.out, "shards")
if not os.path.exists(os.path.join(shards, "model.safetensors.index.json")):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=16,
                      num_key_value_heads=16, intermediate_size=a.ffn, vocab_size=a.vocab,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(one, safe_serialization=True, max_shard_size="100GB")
    model.save_pretrained(shards, safe_serialization=True, max_shard_size=a.shard)
with open(os.path.join(shards, "model.safetensors.index.json")) as f:
    params = json.load(f)["metadata"]["total_size"] // 4  # fp32 bytes
data = os.path.join(a.out, "tokens.u16")
with open(data, "wb") as f:
    from array import array
    array("H", ((i * 7919) % 251 for i in range(200000))).tofile(f)  # uint16 ids below 251


def run(bin_dir, weights, name):
    out = os.path.join(a.out, name)
    plan = {"run": {"name": name, "seed": 1, "output_dir": out},
            "model": {"arch": "llama", "layers": a.layers, "hidden": a.hidden, "heads": 16, "kv_heads": 16,
                      "ffn_hidden": a.ffn, "vocab_size": a.vocab, "max_seq_len": 256, "norm_eps": 1e-6,
                      "tie_embeddings": False, **({"init_from": weights} if weights else {})},
            "parallel": {"tp": 2, "pp": 2},
            "training": {"device": "cpu", "dtype": "fp32", "steps": 1, "global_batch": 2, "micro_batch": 1,
                         "seq_len": 64, "threads": 1},
            "data": {"format": "tokens", "path": [data], "token_dtype": "uint16"},
            "checkpoint": {"every": 0, "resume": "never"}, "logging": {"every": 1}}
    path = os.path.join(a.out, name + ".yaml")
    with open(path, "w") as f:
        json.dump(plan, f)
    subprocess.run([os.path.join(bin_dir, "tessel-launch"), "--nproc-per-node", "4", "--",
                    os.path.join(bin_dir, "tessel-train"), path], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "memory.json")) as f:
        ranks = json.load(f)["ranks"]
    return [r["setup_peak_rss_bytes"] for r in ranks]


print(f"model: {params / 1e6:.0f} M parameters, {4 * params / 2**30:.2f} GiB fp32; one rank's part at tp2 x pp2 "
      f"about {params / 4e6:.0f} M ({params / 2**30:.2f} GiB)")
cases = [(bins[0], None, "seeded"), (bins[0], shards, "shards")] + [(b, os.path.join(one, "model.safetensors"), f"one_{i}")
                                         for i, b in enumerate(bins)]
for b, weights, name in cases:
    peaks = run(b, weights, name)
    print(f"{name:8s} {os.path.relpath(b):40s} set-up peak RSS per rank (GiB): "
          + " ".join(f"{p / 2**30:.2f}" for p in peaks), flush=True)
