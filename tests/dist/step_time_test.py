"""The planner's step time on this CPU (--dry-run --device-profile cpu, its rates measured at start)
within 15% of the measured median step on five layouts of configs/default.yaml's size: one
process (gpt2 and llama), dp=2, tp=2 and pp=2 (1F1B) over loopback Gloo.

This machine's speed drifts by 15-25% between minutes (a shared VM: one CI run measured tp=2 at
-15.4% and -16.2% in two tries a minute apart, another at +2.8%; one dry run's 0.8 s of
measurement put pp=2's compute at 380 ms and the next two at 214 and 208), so each layout's
prediction is the mean of two dry runs, one just before its run and one just after, and a layout
outside the tolerance is measured and run again, up to three tries; the test fails when all three
miss."""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import unittest

BIN = os.environ.get("TESSEL_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin"))
ROOT = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
TOL = 0.15
LLAMA = ["model.arch=llama", "model.kv_heads=2"]
# name: (overrides, processes)
LAYOUTS = {
    "gpt2": ([], 1),
    "llama": (LLAMA, 1),
    "dp2": (["parallel.dp=2"], 2),
    "tp2": (["parallel.tp=2"], 2),
    "pp2_1f1b": (["parallel.pp=2", "parallel.pipeline.schedule=1f1b"], 2),
}


def attempt(tmp, name, sets, world):
    out = os.path.join(tmp, name)
    common = sets + [f"training.threads={2 // world}", "training.steps=16", "training.schedule.warmup_steps=4",
                     f"run.output_dir={out}", "training.eval_every=0", "logging.every=1", "checkpoint.every=0"]
    overrides = [a for s in common for a in ("--set", s)]

    def predict(when):
        plan = os.path.join(tmp, f"{name}.{when}.plan.json")
        p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(ROOT, "configs", "default.yaml"),
                            "--dry-run", "--device-profile", "cpu", "--world-size", str(world), "--plan-json", plan,
                            *overrides], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert p.returncode == 0, f"exit {p.returncode}: " + p.stdout[-2000:] + p.stderr[-2000:]
        with open(plan) as f:
            return json.load(f)

    before = predict("before")
    cmd = [os.path.join(BIN, "tessel-train"), os.path.join(ROOT, "configs", "default.yaml"), *overrides]
    if world > 1:
        cmd = [os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(world), "--"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    after = predict("after")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        ms = [json.loads(line)["ms_per_step"] for line in f if '"loss"' in line]
    measured = statistics.median(ms[6:])  # 10 steps after the first ones (allocator, caches)
    parts = ", ".join(f"{k} {1e3 * v:.0f}" for k, v in before["compute_parts_s"].items())
    return (500 * (before["step_s"] + after["step_s"]), measured,
            f"predicted {1e3 * before['step_s']:.0f} before the run and {1e3 * after['step_s']:.0f} after; before: "
            f"compute {1e3 * before['compute_s']:.0f} ms ({parts}), exposed communication "
            f"{1e3 * before['comm_exposed_s']:.0f}, bubble {1e3 * before['bubble_s']:.0f}")


class Formula(unittest.TestCase):
    """With the profile's rates pinned (--profile-set over the measured ones), the parts of the
    predicted step are the documented formulas: matmuls 6 FLOPs per weight and token at rate ×
    efficiency, attention 12·L·H·Q·T per token, the activation per element, and on tp=2 every
    collective (4 per block and micro-batch, one each for the embedding and the head's input, 3
    for the loss) paying the latency on top of its bytes."""

    def test_pinned_rates(self):
        pins = ["peak_tflops=0.1", "efficiency=0.8", "attention_tflops=0.05", "activation_ns=2", "op_us=10",
                "memory_gbps=20", "latency_us=1000", "intra_node_gbps=1", "gather_gbps=1", "p2p_gbps=1"]
        with tempfile.TemporaryDirectory() as tmp:
            got = {}
            for tp in (1, 2):
                plan = os.path.join(tmp, f"tp{tp}.json")
                p = subprocess.run([os.path.join(BIN, "tessel-train"), os.path.join(ROOT, "configs", "default.yaml"),
                                    "--dry-run", "--device-profile", "cpu", "--world-size", str(tp), "--plan-json", plan,
                                    "--set", f"parallel.tp={tp}", *[a for x in pins for a in ("--profile-set", x)]],
                                   capture_output=True, text=True, timeout=120, cwd=ROOT)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(plan) as f:
                    got[tp] = json.load(f)
        h, layers, vocab, tokens, seq, ffn = 192, 4, 257, 16 * 128, 128, 4 * 192
        block = 12 * h * h + 13 * h  # gpt2: weights and biases, two layer norms
        parts = got[1]["compute_parts_s"]
        self.assertAlmostEqual(parts["matmul"], 6 * (layers * block + vocab * h) * tokens / (0.1e12 * 0.8), delta=1e-9)
        self.assertAlmostEqual(parts["attention"], 12 * layers * h * seq * tokens / 0.05e12, delta=1e-9)
        self.assertAlmostEqual(parts["activation"], layers * tokens * ffn * 2e-9, delta=1e-9)
        self.assertEqual(got[1]["comm_exposed_s"], 0)
        # tp=2: 2 micro-batches × (4 blocks × 4 + 2) all-reduces of [1024, 192] fp32, 2 × 3 of the
        # loss's [1024] fp32, at 1 ms each plus their wire bytes (an all-reduce's buffer, for two
        # ranks) at 1 GB/s; plus the world's norm all-reduce on every step and the loss's two on
        # the steps logged (every 25th).
        row, loss = 1024 * h * 4, 1024 * 4
        tp_s = 42 * 1e-3 + (2 * 18 * row + 6 * loss) / 1e9
        self.assertAlmostEqual(got[2]["comm_s"]["tp"], tp_s, delta=1e-6)
        self.assertAlmostEqual(got[2]["comm_exposed_s"], tp_s + (1 + 2 / 25) * 1e-3, delta=1e-6)


class StepTime(unittest.TestCase):
    def test_five_layouts(self):
        lines = []
        with tempfile.TemporaryDirectory(prefix="tessel-steptime-") as tmp:
            for name, (sets, world) in LAYOUTS.items():
                with self.subTest(name):
                    tries = []
                    for _ in range(3):
                        pred, meas, why = attempt(tmp, name, sets, world)
                        tries.append((abs(pred - meas) / meas, pred, meas, why))
                        lines.append(f"{name}: predicted {pred:.1f} ms/step, measured {meas:.1f} "
                                     f"({100 * (pred - meas) / meas:+.1f}%): {why}")
                        if tries[-1][0] < TOL:
                            break
                    best = min(tries)
                    self.assertLess(best[0], TOL, f"{name}: predicted {best[1]:.1f} ms/step, measured {best[2]:.1f}")
        print("\n" + "\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
