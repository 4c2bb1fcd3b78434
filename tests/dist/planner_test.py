"""The --dry-run planner against measured counters: for small plans in several layouts, the
predicted per-rank weights, gradients and optimizer state (each against the bytes the CPU
allocator counted for it), step activation peak and bytes per group per step are within 15% of
what the run measured (memory.json, engine/run/step_counters.h); the context-parallel group's bytes
exactly, for every method."""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import spawn_ranks  # noqa: E402

BIN = os.environ.get("TESSEL_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin"))
TOL = 0.15

# name: (parallel overrides, training overrides, world, arch). Only what the parity table does
# not run: its check_planner (tests/dist/parity.py) holds every one of its rows, each a layout of
# processes, to tighter bounds than TOL (state exact, tp/cp/pp bytes exact, activations within
# 10%): dp, tp (+sp), every pipeline schedule, cp by every method, ZeRO 1/2/3 inside and outside
# pipelines, recomputation, the head's lean and whole logits, micro-batch pairs and MoE with
# expert parallelism. Here: one process of each kind (the table checks the planner on its rows,
# not on their one-process references) and one layout whose figures are checked against
# --dry-run --plan-json's (the trainer writes the same figures into memory.json).
LAYOUTS = {
    "single": ({}, {}, 1, "llama"),
    # mixture of experts (llama, 4 experts of width 64, top 2)
    "moe_single": ({}, {}, 1, "moe"),
    "zero2_dp2_pp2": ({"dp": 2, "pp": 2, "zero": 2, "pipeline": {"schedule": "1f1b"}}, {}, 4, "llama"),
}
MOE_TOL = 0.10
# Activation peaks the planner is known to miss by more than TOL (a planner defect to fix, not a
# tolerance; the parity table lists its own in PLANNER_ACTIVATION_MISSES): none since the planner
# walks backward parameter by parameter (2026-11-28: zero2_dp2_pp2 -2.0% and +10.7%,
# zero3_dp2_pp2_free -7.2% and +6.0%, where ZeRO-3 in a pipeline missed by +16.9% before).
ACTIVATION_MISSES = {}


def plan(tmp, name, par, tr, arch):
    model = {"arch": "llama" if arch == "moe" else arch, "layers": 4, "hidden": 64, "heads": 4,
             "kv_heads": 0 if arch == "gpt2" else 2, "vocab_size": 512, "max_seq_len": 64}
    if arch == "moe":
        model["moe"] = {"experts": 4, "top_k": 2, "ffn_hidden": 64}
    return {"run": {"seed": 1, "output_dir": os.path.join(tmp, name)},
            "model": model,
            "parallel": par,
            "training": {"device": "cpu", "steps": 2, "global_batch": 8, "micro_batch": 2, "seq_len": 64,
                         "threads": 1, **tr},
            "data": {"format": "tokens", "path": [os.path.join(tmp, "tokens.bin")], "token_dtype": "uint16"},
            # peak_tflops given: no matmul measured at each rank's start (MFU is not checked here)
            "checkpoint": {"every": 0}, "logging": {"every": 1, "peak_tflops": 1.0}}


def rel(pred, meas):
    return abs(pred - meas) / max(meas, 1)


class Planner(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmpdir = tempfile.TemporaryDirectory(prefix="tessel-plan-")
        cls.tmp = cls.tmpdir.name
        np.random.RandomState(0).randint(0, 512, size=100000).astype(np.uint16).tofile(
            os.path.join(cls.tmp, "tokens.bin"))

    @classmethod
    def tearDownClass(cls):
        cls.tmpdir.cleanup()

    def check(self, name):
        par, tr, world, arch = LAYOUTS[name]
        path = os.path.join(self.tmp, name + ".yaml")
        the_plan = plan(self.tmp, name, par, tr, arch)
        with open(path, "w") as f:
            json.dump(the_plan, f)
        if world > 1:  # the ranks without tessel-launch (its own tests prove it): one LibTorch start less
            spawn_ranks(the_plan, world)
        else:
            r = subprocess.run([os.path.join(BIN, "tessel-train"), path], capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-3000:])
        with open(os.path.join(self.tmp, name, "memory.json")) as f:
            meas = json.load(f)
        # The trainer writes --dry-run's figures for its own plan and layout beside what it
        # measured (no dry-run process per layout); one layout checks that they are the dry-run's.
        pred = {"ranks": meas["predicted"]}
        if name == "zero2_dp2_pp2":
            pj = os.path.join(self.tmp, name + ".plan.json")
            p = subprocess.run([os.path.join(BIN, "tessel-train"), path, "--dry-run", "--world-size", str(world),
                                "--plan-json", pj], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(pj) as f:
                dry = json.load(f)["ranks"]
            keys = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes_per_step")
            self.assertEqual([{k: r[k] for k in keys} for r in dry], [{k: r[k] for k in keys} for r in pred["ranks"]])
        pp = par.get("pp", 1)
        worst = 0
        lines = []
        for row in meas["ranks"]:
            stage = row["rank"] // (world // pp) if pp > 1 else 0  # order tp-cp-dp-pp: pp slowest
            est = pred["ranks"][stage]
            # The state as the CPU allocator counted it, each part on its own (a sum could hide
            # two errors that cancel; the optimizer's own tensor sizes would test nothing).
            pairs = [("weights", est["weights_bytes"], row["allocated_weights_bytes"]),
                     ("gradients", est["grads_bytes"], row["allocated_grads_bytes"]),
                     ("optimizer state", est["optimizer_bytes"], row["allocated_optimizer_bytes"]),
                     ("activations", est["activation_bytes"], row["step_peak_bytes"])]
            for part in ("weights", "grads", "optimizer"):
                self.assertGreater(row[f"allocated_{part}_bytes"], 0, f"{name}: nothing counted as {part}")
            for group, bytes_ in row["comm_bytes_per_step"].items():
                if group in ("mp", "world") or (bytes_ < 64 and group not in est["comm_bytes_per_step"]):
                    continue  # scalars: the gradient norm's sum
                pairs.append((group, est["comm_bytes_per_step"].get(group, 0), bytes_))
            for group in est["comm_bytes_per_step"]:
                self.assertIn(group, row["comm_bytes_per_step"], f"{name}: predicted traffic on {group}")
            for what, p_, m_ in pairs:
                e = rel(p_, m_)
                if what == "cp":  # context parallelism's bytes are counted exactly, every method
                    self.assertLess(e, 1e-9, f"{name} rank {row['rank']} cp bytes: predicted {p_}, measured {m_}")
                worst = max(worst, e)
                lines.append(f"{name} rank {row['rank']} {what}: predicted {p_:.0f}, measured {m_:.0f} "
                             f"({100 * (p_ - m_) / max(m_, 1):+.1f}%)")
                bound = MOE_TOL if name.startswith("moe") else TOL
                if what == "activations":
                    bound = ACTIVATION_MISSES.get(name, bound)
                self.assertLess(e, bound, f"{name} rank {row['rank']} {what}: predicted {p_}, measured {m_}")
        print("\n" + "\n".join(lines) + f"\n{name}: worst {100 * worst:.1f}%", file=sys.stderr)
        return meas

    def test_layouts(self):
        for name in LAYOUTS:
            with self.subTest(name):
                self.check(name)


class RecomputeTime(unittest.TestCase):
    """The predicted compute time counts the forward work recomputation reruns (it used to be the
    same for none, selective and full): full adds each block's forward (2 FLOPs per block weight
    plus a third of attention's 12·L·H·Q·T per token), selective each MLP's forward."""

    def test_compute_grows_with_recomputation(self):
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        figures = {}
        for mode in ("none", "selective", "full"):
            with tempfile.TemporaryDirectory() as tmp:
                pj = os.path.join(tmp, "plan.json")
                p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", "llama3-8b.yaml"),
                                    "--dry-run", "--world-size", "64", "--plan-json", pj,
                                    "--set", f"training.recompute={mode}"], capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(pj) as f:
                    figures[mode] = json.load(f)
        none, sel, full = (figures[m] for m in ("none", "selective", "full"))
        # Llama-3 8B: 32 blocks of 218 M weights (MLP 176 M), hidden 4096, seq 8192 (the plan's).
        with open(os.path.join(root, "configs", "llama3-8b.yaml")) as f:
            text = f.read()
        seq = int(re.search(r"seq_len: (\d+)", text).group(1))
        tokens = int(re.search(r"global_batch: (\d+)", text).group(1)) * seq
        self.assertEqual(none["recompute_flops_per_step"], 0)
        self.assertAlmostEqual(sel["recompute_flops_per_step"] / tokens, 2 * 32 * 3 * 4096 * 14336, delta=1e9)
        self.assertAlmostEqual(full["recompute_flops_per_step"] / tokens,
                               2 * 32 * 218.1e6 + 4 * 32 * 4096 * seq, delta=0.01 * 2 * 32 * 218.1e6)
        for mode, e in (("selective", sel), ("full", full)):
            ratio = e["compute_s"] / none["compute_s"]
            want = 1 + e["recompute_flops_per_step"] / none["flops_per_step"]
            self.assertAlmostEqual(ratio, want, places=6)
            self.assertAlmostEqual(e["mfu"] * e["step_s"], none["mfu"] * none["step_s"], places=6)  # model FLOPs
            print(f"\nllama3-8b on 64: compute {1e3 * e['compute_s']:.0f} ms with {mode} recomputation, "
                  f"{1e3 * none['compute_s']:.0f} ms without (x{ratio:.3f})", file=sys.stderr)
        self.assertGreater(full["compute_s"], sel["compute_s"])
        self.assertGreater(sel["compute_s"], none["compute_s"])


class OnePeak(unittest.TestCase):
    """The step time and the MFU of a plan use one peak: an fp32 plan with TF32 on used to be
    timed at the TF32 rate and divided by the plain fp32 peak (MFU 367.9% on h100)."""

    def test_mfu_never_exceeds_the_efficiency(self):
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        peaks = {("bf16", "true"): 989.4, ("fp32", "true"): 989.4 / 2, ("fp32", "false"): 66.9}
        for (dtype, tf32), peak in peaks.items():
            with tempfile.TemporaryDirectory() as tmp:
                pj = os.path.join(tmp, "plan.json")
                p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", "gpt2-124m.yaml"),
                                    "--dry-run", "--world-size", "8", "--plan-json", pj, "--set",
                                    f"training.dtype={dtype}", "--set", f"training.tf32={tf32}"],
                                   capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(pj) as f:
                    e = json.load(f)
            mfu = e["flops_per_step"] / e["step_s"] / e["world"] / (peak * 1e12)
            self.assertAlmostEqual(e["mfu"], mfu, places=9, msg=f"{dtype} tf32={tf32}")
            self.assertLessEqual(e["mfu"], e["device"]["efficiency"] + 1e-9, f"{dtype} tf32={tf32}")
            self.assertIn(f"MFU {100 * e['mfu']:.1f}%", p.stdout)

    def test_a_cpu_peak_pinned_below_the_attention_rate(self):
        # Attention was timed at its own measured rate but counted against the matmul peak: with
        # the peak pinned low, --dry-run printed MFU 489.8%.
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        with tempfile.TemporaryDirectory() as tmp:
            pj = os.path.join(tmp, "plan.json")
            p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", "default.yaml"),
                                "--dry-run", "--device-profile", "cpu", "--plan-json", pj,
                                "--profile-set", "peak_tflops=0.001", "--profile-set", "attention_tflops=0.05"],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(pj) as f:
                e = json.load(f)
        self.assertGreater(e["mfu"], 0.1)
        self.assertLessEqual(e["mfu"], e["device"]["efficiency"] + 1e-9, p.stdout)


class ShippedConfigs(unittest.TestCase):
    """configs/: each plan is valid at the world sizes it is written for and fits an H100."""
    # Every world size a plan's comments promise, with the overrides they name.
    CASES = [("gpt2-124m.yaml", 8, [], 1), ("gpt2-124m.yaml", 16, [], 1), ("gpt2-124m.yaml", 32, [], 1),
             ("gpt2-124m.yaml", 64, ["training.micro_batch=8"], 1), ("gpt2-124m.yaml", 64, ["parallel.tp=2"], 2),
             ("gpt2-124m.yaml", 32, ["parallel.tp=2", "parallel.pp=2"], 3),
             ("llama3-1b.yaml", 16, [], 3), ("llama3-1b.yaml", 32, [], 3), ("llama3-1b.yaml", 64, [], 3),
             ("llama3-8b.yaml", 32, [], 3), ("llama3-8b.yaml", 64, [], 4), ("mixtral-8x7b.yaml", 64, [], 3)]

    def test_a_clearly_faster_layout_is_named(self):
        # The 8B 4D layout at 64 GPUs is slower by the planner's own figures than layouts without
        # tensor parallelism: the dry-run names the fastest it tries (pp 1 too, although the plan's
        # schedule is interleaved; hybrid sharding too: it names dp 64, ZeRO-3 sharded over 8,
        # once rated below a cp 4 x pp 4 layout the plan's comment named), with the overrides for
        # it; that plan
        # is a fixpoint (no further suggestion, the same predicted step); and the percentages the
        # shipped plans' comments quote are the ones the dry-run prints.
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        claims = [("llama3-8b.yaml", 64, 30), ("llama3-1b.yaml", 64, 20)]
        for name, world, percent in claims:
            path = os.path.join(root, "configs", name)
            with open(path) as f:
                self.assertIn(f"{percent}%", f.read().split("\nrun:")[0], f"{name}'s comment")
            p = subprocess.run([os.path.join(BIN, "tessel-train"), path, "--dry-run", "--world-size", str(world)],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            m = re.search(r"# by these figures a faster layout on (\d+) processes: .*: step ([0-9.]+) ms, (\d+)% less "
                          r"than this plan's ([0-9.]+) ms.*\n#   (tessel-train .*)\n", p.stdout)
            self.assertIsNotNone(m, p.stdout[-2000:])
            self.assertEqual(int(m.group(3)), percent, f"{name} on {world}")
            args = m.group(5).split()[1:]
            q = subprocess.run([os.path.join(BIN, "tessel-train"), *args], capture_output=True, text=True)
            self.assertEqual(q.returncode, 0, q.stderr)
            self.assertNotIn("a faster layout", q.stdout)
            step = float(re.search(r"step ([0-9.]+) ms = compute", q.stdout).group(1))
            self.assertAlmostEqual(step, float(m.group(2)), delta=0.1)
            print(f"\n{name} on {world}: {m.group(4)} ms as shipped; {step} ms with {' '.join(args[4:])}",
                  file=sys.stderr)
        # A plan that is already the fastest gets no suggestion, nor one whose best alternative
        # is under the 10% margin (llama3-1b on 16: 9.9%, as its comment says).
        for name, world in (("gpt2-124m.yaml", 8), ("llama3-1b.yaml", 16)):
            p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", name),
                                "--dry-run", "--world-size", str(world)], capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertNotIn("a faster layout", p.stdout, name)

    def test_bad_profile_values_are_refused(self):
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        for kv, msg in (("gpus_per_node=0.5", "gpus_per_node must be a whole number, not '0.5'"),
                        ("efficiency=1.5", "efficiency is a fraction of the peak"),
                        ("peak_tflops=-3", "peak_tflops must be a positive number, not '-3'")):
            with self.subTest(kv):
                p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", "gpt2-124m.yaml"),
                                    "--dry-run", "--world-size", "8", "--profile-set", kv],
                                   capture_output=True, text=True)
                self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
                self.assertIn(msg, p.stderr)

    def test_dry_run(self):
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        with tempfile.TemporaryDirectory() as tmp:
            for name, world, sets, dims in self.CASES:
                with self.subTest(f"{name} on {world}"):
                    pj = os.path.join(tmp, "plan.json")
                    cmd = [os.path.join(BIN, "tessel-train"), os.path.join(root, "configs", name), "--dry-run",
                           "--world-size", str(world), "--plan-json", pj, "--details"]
                    for s in sets:
                        cmd += ["--set", s]
                    p = subprocess.run(cmd, capture_output=True, text=True)
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                    with open(pj) as f:
                        plan = json.load(f)
                    self.assertEqual(plan["world"], world)
                    sizes = {k: int(v) for k, v in re.findall(r"^  (dp|tp|pp|cp): (\d+)$", p.stdout, re.M)}
                    self.assertEqual(sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["cp"], world)
                    used = sum(1 for v in sizes.values() if v > 1)
                    self.assertGreaterEqual(used, dims, p.stdout)
                    for r in plan["ranks"]:
                        self.assertLess(r["total_bytes"], 80 * 2**30, f"{name} stage {r['stage']} does not fit an H100")
                    self.assertTrue(0.1 < plan["mfu"] < 0.7, plan["mfu"])
                    print(f"\n{name} on {world}: {max(r['total_bytes'] for r in plan['ranks']) / 2**30:.1f} GiB per rank, "
                          f"predicted {plan['step_s'] * 1e3:.0f} ms/step, {plan['tokens_per_s']:.0f} tok/s, "
                          f"MFU {100 * plan['mfu']:.1f}% on h100", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
