"""Helpers shared by every Python test that runs the binaries: run them, write plans and token
files, read metrics. Free of torch (the parity table's runner starts in well under a second);
common.py adds the helpers that build Hugging Face models."""
import json
import os
import random
import socket
import subprocess
import tempfile
import unittest


BIN = os.environ.get("TESSEL_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin"))
ROOT = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))


def run(*args, check=True, timeout=600):
    """Runs a Tessel binary; returns the CompletedProcess (stdout/stderr as text)."""
    p = subprocess.run([os.path.join(BIN, args[0]), *map(str, args[1:])], capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def launch_plan(plan, world, check=True):
    """Writes plan beside its output_dir and trains it: one process, or `world` ranks forked from
    one tessel-train (spawn_ranks' way, where the launcher is not what a test is about: its own
    tests start it; a CUDA plan under tessel-launch). Returns a CompletedProcess whose stdout and stderr both hold every rank's
    output, each line prefixed "[rank R] " as tessel-launch prefixes it, then the parent's."""
    path = write_plan(plan["run"]["output_dir"] + ".yaml", plan)
    if world == 1:
        return run("tessel-train", path, check=check)
    if plan.get("training", {}).get("device", "cpu") != "cpu":  # the GPU suite: as users start it
        return run("tessel-launch", "--nproc-per-node", world, "--master-port", free_port(), "--",
                   os.path.join(BIN, "tessel-train"), path, check=check)
    with tempfile.TemporaryDirectory(prefix="tessel-ranks-") as logs:
        p = subprocess.run([os.path.join(BIN, "tessel-train"), path], capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, **rank_env(world), TESSEL_TEST_FORK_RANKS=str(world),
                                    TESSEL_TEST_FORK_LOGS=logs))
        out = ""
        for r in range(world):
            log = os.path.join(logs, f"rank{r}.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    out += "".join(f"[rank {r}] {line}" for line in f)
    out += p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"{path} on {world} ranks exited {p.returncode}\n{out[-6000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, out)


def rank_env(world):
    """The worker environment tessel-launch gives a node's ranks but RANK and LOCAL_RANK."""
    return dict(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), TESSEL_RESTART_COUNT="0")


def write_plan(path, plan):
    """YAML is a superset of JSON: a plan written as JSON is a valid YAML plan."""
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    return path


def read_metrics(path):
    """metrics.jsonl's lines; no MFU above 100% is ever written (every test reading metrics checks)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    over = [r for r in rows if r.get("mfu", 0) > 1.0]
    if over:
        raise AssertionError(f"{path}: MFU above 100% at step {over[0].get('step')}: {over[0]['mfu']}")
    return rows


def resume_on_two_ranks(test, run_dir, cut_dir, plan_path, step):
    """An interrupted run: run_dir's checkpoint at `step` as cut_dir's only one, resumed by
    `plan_path` (which writes to cut_dir) on two processes; every later step's loss and blend
    counts must be the uninterrupted run's (losses within 1e-5). Returns the resumed metrics."""
    import shutil
    os.makedirs(os.path.join(cut_dir, "checkpoints"))
    shutil.copytree(os.path.join(run_dir, "checkpoints", f"step_{step}"),
                    os.path.join(cut_dir, "checkpoints", f"step_{step}"))
    with open(os.path.join(cut_dir, "checkpoints", "latest"), "w") as f:
        f.write(f"step_{step}\n")
    p = run("tessel-launch", "--nproc-per-node", 2, "--", os.path.join(BIN, "tessel-train"), plan_path)
    test.assertIn("resumed from", p.stderr + p.stdout)
    whole = [m for m in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in m]
    tail = [m for m in read_metrics(os.path.join(cut_dir, "metrics.jsonl")) if "loss" in m]
    test.assertEqual([m["step"] for m in tail], [m["step"] for m in whole[step:]])
    for a, b in zip(whole[step:], tail, strict=True):
        test.assertLess(abs(a["loss"] - b["loss"]), 1e-5 * abs(a["loss"]), (whole, tail))
        test.assertEqual(a.get("blend_samples"), b.get("blend_samples"))
    return tail


def free_port():
    """A loopback port that is free now, and the next one too (for MASTER_PORT: tessel-launch's
    nodes meet at MASTER_PORT + 1; a busy neighbour failed a Slurm test with EADDRINUSE). Drawn
    below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 here): a port
    the kernel hands out itself (port 0) may be given to another test's Gloo connection between
    this check and the store's bind, which failed a parity row with EADDRINUSE under ctest -j2."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(10000, max(low, 12000) - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free loopback ports")


def read_text(path):
    with open(path) as f:
        return f.read()


def read_json(path):
    return json.loads(read_text(path))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


class TmpDirTest(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="tessel-ref-")
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)


# Tiny models: Tessel plan sections and the matching transformers models.
SEQ = 16


def model_plan(arch):
    if arch == "gpt2":
        return {"arch": "gpt2", "layers": 2, "hidden": 32, "heads": 4, "vocab_size": 300, "max_seq_len": 64,
                "norm_eps": 1e-5}
    return {"arch": "llama", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 80,
            "vocab_size": 300, "max_seq_len": 64, "norm_eps": 1e-6, "rope_theta": 5000.0}


def base_plan(tmp, arch, data_path, **training):
    t = {"device": "cpu", "dtype": "fp32", "steps": 3, "global_batch": 4, "micro_batch": 2, "seq_len": SEQ,
         "threads": 2}
    t.update(training)
    return {"run": {"name": "ref", "seed": 1, "output_dir": os.path.join(tmp, "run")},
            "model": model_plan(arch), "training": t,
            "data": {"format": "tokens", "path": [data_path], "shuffle": False, "token_dtype": "uint16"},
            "logging": {"every": 1, "peak_tflops": 1.0}}


def write_tokens(path, n, vocab=300, seed=2, period=None, eod=None):
    """Random uint16 tokens; with `period`, a repeated random pattern (learnable: the loss falls);
    with `eod`, that id ends a document after one token in eight on average (documents of 1 to
    dozens of tokens)."""
    import numpy as np  # here, not at the top: the GPU suite runs where numpy may be missing
    g = np.random.default_rng(seed)
    if period:
        toks = np.tile(g.integers(0, vocab, size=period), n // period + 1)[:n]
    else:
        toks = g.integers(0, vocab, size=n)
    if eod is not None:
        toks[np.random.default_rng(seed + 1).random(n) < 1 / 8] = eod
    toks.astype("<u2").tofile(path)
    return path


def write_fixed_tokens(path, n=60000, vocab=257):
    """A learnable stream free of any library's random generator: a 97-token phrase from a
    linear congruential sequence, repeated, one token in eight replaced by the sequence's next."""
    from array import array
    state, out = 12345, array("H")

    def nxt():
        nonlocal state
        state = (1103515245 * state + 12345) % (1 << 31)
        return (state >> 8) % vocab
    phrase = [nxt() for _ in range(97)]
    for i in range(n):
        out.append(nxt() if i % 8 == 7 else phrase[i % 97])
    with open(path, "wb") as f:
        out.tofile(f)
    return path


def spawn_ranks(plan, world, timeout=600):
    """Trains `plan` with `world` ranks of one node, each with the environment tessel-launch gives
    its workers (torchrun's names), without the launcher: for the parity rows, where the launcher
    proves nothing (launcher_test.py, operations_test.py and the Slurm tests do) and its own start
    would come before every row's ranks. One tessel-train loads LibTorch once and forks the ranks
    (TESSEL_TEST_FORK_RANKS, engine/cli/fork_ranks.h: 0.45 s of a core saved per rank). A rank that
    fails stops the others itself (the trainer's fail-fast); the parent kills any still running 60 s
    after, and all of them die with it when it is killed after `timeout` seconds. Raises naming
    each failed rank with its output's tail."""
    path = write_plan(plan["run"]["output_dir"] + ".yaml", plan)
    with tempfile.TemporaryDirectory(prefix="tessel-ranks-") as logs:
        # TESSEL_COUNT_HOST_READS: memory.json counts each step's host reads (parity.py checks them)
        env = dict(os.environ, **rank_env(world), TESSEL_COUNT_HOST_READS="1", TESSEL_TEST_FORK_RANKS=str(world),
                   TESSEL_TEST_FORK_LOGS=logs)
        p = subprocess.Popen([os.path.join(BIN, "tessel-train"), path], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        if p.returncode == 0:
            return
        tails = [out[-2000:]] if out.strip() else []
        for r in range(world):
            log = os.path.join(logs, f"rank{r}.log")
            if os.path.exists(log):
                with open(log, errors="replace") as f:
                    tails.append(f"rank {r}:\n{f.read()[-3000:]}")
        raise AssertionError(f"{path} on {world} ranks: exit {p.returncode}\n" + "\n".join(tails))
