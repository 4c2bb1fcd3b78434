"""What the bench scripts share: the binaries, a token file, and one training run of a plan."""
import json
import os
import subprocess


# The checkout (build/bin), or an installed bundle (share/tessel beside bin/): TESSEL_BIN wins.
ROOT = os.environ.get("TESSEL_ROOT", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_installed = os.path.join(ROOT, "..", "..", "bin", "tessel-train")
BIN = os.environ.get("TESSEL_BIN", os.path.dirname(_installed) if os.path.exists(_installed)
                     else os.path.join(ROOT, "build", "bin"))


def token_file(out, n=400_000, vocab=512):
    """Random uint16 tokens in OUT/tokens.u16 (seed 0)."""
    path = os.path.join(out, "tokens.u16")
    import numpy as np  # here: gpu_bench.py runs where numpy may be missing
    np.random.default_rng(0).integers(0, vocab, size=n, dtype=np.uint16).tofile(path)
    return path


def train(out, name, world, port, data, model, parallel, training):
    """Trains a plan of these sections as OUT/NAME (metrics every step, no checkpoints) on `world`
    processes under tessel-launch; returns the launcher's stdout."""
    plan = {"run": {"name": name, "output_dir": os.path.join(out, name)}, "model": model, "parallel": parallel,
            "training": dict({"device": "cpu", "threads": 1, "schedule": {"warmup_steps": 1}}, **training),
            "data": {"format": "tokens", "path": [data], "token_dtype": "uint16"},
            "checkpoint": {"resume": "never", "every": 0, "dir": os.path.join(out, name, "ckpt")},
            "logging": {"every": 1}}
    path = os.path.join(out, name + ".yaml")
    with open(path, "w") as f:
        json.dump(plan, f)  # JSON is YAML
    return subprocess.run([os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(world), "--master-port",
                           str(port), "--", os.path.join(BIN, "tessel-train"), path],
                          check=True, capture_output=True, text=True).stdout
