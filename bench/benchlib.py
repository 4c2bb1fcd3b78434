"""What the bench scripts share: the binaries, a token file, and one training run of a plan."""
import glob
import json
import os
import re
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


def gpu_hardware():
    """The NVIDIA GPUs this machine shows, whether or not torch can use them, read as
    core/device/cuda.h's gpu_hardware() reads them: (models from /proc/driver/nvidia/gpus, else the
    /dev/nvidia<N> nodes; the kernel driver's version or "")."""
    gpus = []
    for d in sorted(glob.glob("/proc/driver/nvidia/gpus/*")):
        model = os.path.basename(d)
        try:
            with open(os.path.join(d, "information")) as f:
                model = next((ln[6:].strip() for ln in f if ln.startswith("Model:")), model)
        except OSError:
            pass
        gpus.append(model)
    if not gpus:
        gpus = sorted(p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p))
    driver = ""
    try:
        with open("/proc/driver/nvidia/version") as f:
            driver = next((w for w in f.read().split() if re.fullmatch(r"\d+(\.\d+)+", w)), "")
    except OSError:
        pass
    return gpus, driver


def unusable_gpu_reason():
    """"" unless this machine has NVIDIA GPUs that torch cannot use; then what a GPU check fails
    with (it must not report "skipped" there): the GPUs, the driver, and what torch's CUDA needs."""
    import torch
    gpus, driver = gpu_hardware()
    if not gpus or torch.cuda.is_available():
        return ""
    cuda = torch.version.cuda or "none (a CPU-only torch)"
    need = {"13": "release 580 or newer", "12": "release 525 or newer"}.get(cuda.split(".")[0], "a newer one")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"this machine has {len(gpus)} NVIDIA GPU{'s' if len(gpus) > 1 else ''} ({', '.join(gpus)}; driver "
            f"{driver or 'version unknown'}), but torch {torch.__version__} sees none: its CUDA is {cuda}, which "
            f"needs an NVIDIA driver of {need}"
            + (f"; CUDA_VISIBLE_DEVICES='{visible}'" if visible is not None else ""))
