"""fp16 with dynamic loss scaling, and the non-finite guard of every dtype.

fp16: the loss falls on the default model; an injected overflow (training.loss_scale.
inject_overflow_step multiplies that step's scaled loss by 1e30) is skipped and counted, the scale
backs off and the run goes on; a resumed fp16 run continues bitwise, loss scale included. fp32
and bf16: the same injected overflow stops the run with exit 2 and a message naming the step,
and no checkpoint of that step or later exists. (bf16 and fp16 under ZeRO tracking one process are
rows of the parity table, tests/dist/layouts.py.)"""
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import BIN, ROOT, TmpDirTest, base_plan, launch_plan, read_metrics, write_tokens  # noqa: E402

INITIAL = 1024.0


class Runs(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 20000, vocab=300, period=41)

    def plan(self, name, dtype="fp16", steps=20, **loss_scale):
        plan = base_plan(self.tmp, "gpt2", self.data, dtype=dtype, steps=steps, global_batch=4, micro_batch=2,
                         optimizer={"lr": 3e-3}, schedule={"warmup_steps": 2}, grad_clip=1.0,
                         loss_scale=dict({"initial": INITIAL, "growth_interval": 4}, **loss_scale))
        plan["run"]["output_dir"] = self.path(name)
        plan["checkpoint"] = {"resume": "never", "every": 10}
        return plan

    def metrics(self, name):
        return [m for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]

    def launch(self, plan, world, check=True):
        return launch_plan(plan, world, check)


class Fp16LossScaling(Runs):
    def test_loss_falls_on_the_default_model(self):
        # configs/default.yaml's model and data in fp16, on a shorter budget (fp16 matmuls are ~20x
        # slower than fp32 on CPU): 30 steps of 4 x 64 tokens.
        out = self.path("default")
        sets = {"training.dtype": "fp16", "training.steps": 30, "training.schedule.warmup_steps": 5,
                "training.global_batch": 4, "training.micro_batch": 4, "training.seq_len": 64,
                "training.eval_every": 0, "logging.every": 1, "run.output_dir": out}
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        # The default plan's data paths are relative to the checkout.
        subprocess.run([os.path.join(os.path.abspath(BIN), "tessel-train"), "configs/default.yaml", *args],
                       cwd=ROOT, check=True, capture_output=True, timeout=900)
        m = self.metrics("default")
        self.assertEqual(len(m), 30)
        first, last = sum(x["loss"] for x in m[:3]) / 3, sum(x["loss"] for x in m[-5:]) / 5
        print(f"\nfp16 default model: mean loss {first:.3f} over steps 1-3 -> {last:.3f} over steps 26-30, "
              f"loss scale {m[-1]['loss_scale']}, skipped {m[-1]['skipped_steps']}", file=sys.stderr)
        self.assertLess(last, first - 1.0)
        self.assertTrue(all(x["loss_scale"] >= 1 for x in m))

    def test_injected_overflow_is_skipped_and_the_scale_backs_off(self):
        self.launch(self.plan("clean"), 1)
        self.launch(self.plan("hit", inject_overflow_step=6), 1)
        clean, hit = self.metrics("clean"), self.metrics("hit")
        self.assertEqual([m["step"] for m in hit], list(range(1, 21)), "the run goes on to the end")
        by_step = {m["step"]: m for m in hit}
        # Growth every 4 clean steps: 1024 -> 2048 after step 4; step 6 overflows: halved, counted.
        self.assertEqual(by_step[5]["loss_scale"], 2 * INITIAL)
        self.assertEqual(by_step[6]["loss_scale"], INITIAL)
        self.assertEqual(by_step[5]["skipped_steps"], 0)
        self.assertEqual(by_step[6]["skipped_steps"], 1)
        self.assertEqual(hit[-1]["skipped_steps"], 1)
        # Up to the overflow the runs are the same; the skipped step left the weights unchanged, so
        # step 7 sees the weights of step 5 (unlike the clean run) and the loss still falls after.
        # (Two processes: within the parity bar, as AVX-512 matmuls round by buffer alignment.)
        same = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(hit[:6], clean[:6]))
        self.assertLess(same, 1e-5, [(a["loss"], b["loss"]) for a, b in zip(hit[:6], clean[:6])])
        self.assertGreater(abs(hit[6]["loss"] - clean[6]["loss"]) / abs(clean[6]["loss"]), 1e-5)
        self.assertLess(hit[-1]["loss"], hit[0]["loss"])
        self.assertEqual(clean[-1]["skipped_steps"], 0)

    def test_overflow_with_zero_over_two_ranks(self):
        # found_inf comes from the global gradient norm: every rank skips the same step.
        self.launch(self.plan("z2", inject_overflow_step=3) | {"parallel": {"dp": 2, "zero": 2}}, 2)
        m = self.metrics("z2")
        self.assertEqual(len(m), 20)
        self.assertEqual(m[-1]["skipped_steps"], 1)
        self.assertEqual(m[2]["loss_scale"], INITIAL / 2)

    def test_resume_is_bitwise_with_the_loss_scale(self):
        self.launch(self.plan("full", inject_overflow_step=3), 1)
        cont = self.plan("cont", inject_overflow_step=3)
        cont["checkpoint"]["resume"] = self.path("full", "checkpoints", "step_10")
        self.launch(cont, 1)
        full, resumed = self.metrics("full"), self.metrics("cont")
        self.assertEqual([(m["loss"], m["loss_scale"], m["skipped_steps"]) for m in resumed],
                         [(m["loss"], m["loss_scale"], m["skipped_steps"]) for m in full[10:]])

class NonFiniteStops(Runs):
    def test_fp32_and_bf16_stop_naming_the_step_and_save_nothing_of_it(self):
        for dtype in ("fp32", "bf16"):
            name = f"bad_{dtype}"
            plan = self.plan(name, dtype=dtype, inject_overflow_step=13)
            p = self.launch(plan, 1, check=False)
            print(f"\n{dtype}: {p.stderr.strip().splitlines()[-1][:240]}", file=sys.stderr)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("step 13:", p.stderr)
            self.assertIn("not finite", p.stderr)
            ckpt = self.path(name, "checkpoints")
            self.assertEqual(sorted(d for d in os.listdir(ckpt) if d.startswith("step_")), ["step_10"])
            self.assertEqual(max(m["step"] for m in self.metrics(name)), 12, "step 13 is never logged")


if __name__ == "__main__":
    unittest.main()
