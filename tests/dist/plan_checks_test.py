"""Bad layouts fail within seconds, in --dry-run and at start under the launcher, before any
communicator exists, with messages that name the values."""
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import (BIN, TmpDirTest, base_plan, run, write_plan, write_tokens, free_port)  # noqa: E402


CASES = [
    ({"parallel": {"dp": 2}}, 3, "world size (3) must equal parallel.tp·cp·dp·pp (1·1·2·1 = 2)"),
    ({"parallel": {"tp": 3}}, 3, "model.heads (4) must be divisible by parallel.tp (3)"),
    ({"training": {"global_batch": 6, "micro_batch": 2}}, 2,
     "training.global_batch (6) must be divisible by parallel.dp·training.micro_batch (2·2 = 4)"),
    ({"parallel": {"pp": 4}}, 4, "model.layers (2) must be >= parallel.pp (4) x pipeline.virtual_stages (1)"),
    ({"parallel": {"cp": 3}}, 3, "training.seq_len (16) must be divisible by 2·parallel.cp (2·3 = 6)"),
    ({"parallel": {"cp": 2, "tp": 4, "sequence_parallel": True}, "training": {"seq_len": 12}}, 8,
     "training.seq_len (12) must be divisible by parallel.tp (4) x parallel.cp (2)"),
    ({"parallel": {"cp": 4, "tp": 2, "context": {"method": "alltoall"}}}, 8,
     "parallel.context.method alltoall splits each tp rank's query heads over parallel.cp: model.heads (4) / "
     "parallel.tp (2) = 2 heads are not divisible by parallel.cp (4); parallel.cp 2 would divide them, or use "
     "parallel.context.method ring or allgather"),
    ({"parallel": {"cp": 4, "context": {"method": "hybrid", "alltoall_size": 3}}}, 4,
     "parallel.context.alltoall_size (3) must divide parallel.cp (4)"),
]


class PlanChecks(TmpDirTest):
    def plan(self, overrides):
        plan = base_plan(self.tmp, "gpt2", write_tokens(self.path("d.u16"), 3000))
        for section, values in overrides.items():
            plan.setdefault(section, {}).update(values)
        return write_plan(self.path("p.yaml"), plan)

    def test_dry_run_names_the_values(self):
        for overrides, world, message in CASES:
            p = run("tessel-train", self.plan(overrides), "--dry-run", "--world-size", world, check=False)
            self.assertEqual(p.returncode, 2, p.stdout)
            self.assertIn(message, p.stderr)

    def test_zero3_gathered_units_of_an_expert_plan(self):
        # Mixtral under ZeRO-3 printed "the root unit -16780361728 B": its blocks were counted
        # with every expert, not the E/ep a rank holds.
        import re
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        p = run("tessel-train", os.path.join(root, "configs", "mixtral-8x7b.yaml"), "--dry-run", "--world-size", 64,
                "--set", "parallel.zero=3")
        units = re.findall(r"the root unit (-?[\d.]+) (\w+) and 2-3 blocks of up to ([\d.]+) MiB", p.stdout)
        self.assertEqual(len(units), 4, p.stdout)
        self.assertEqual(units[0][:2], ("125.00", "MiB"))  # the embedding table's shard
        self.assertTrue(all(float(u[0]) >= 0 for u in units), units)
        self.assertTrue(all(float(u[2]) == 712.08 for u in units), units)

    def test_fp8_runs_its_linear_layers_at_the_fp8_peak(self):
        # training.fp8: the blocks' linear layers' FLOPs (their declarations, models/flops.h) at
        # the card's dense fp8 peak, the rest at bf16's; MFU against the fp8 peak, named; a card
        # without float8 tensor cores refused.
        import json
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        got = {}
        for fp8 in ("off", "tensorwise"):
            out = self.path(f"{fp8}.json")
            p = run("tessel-train", os.path.join(root, "configs", "llama3-8b.yaml"), "--dry-run", "--world-size", 64,
                    "--device-profile", "h100", "--plan-json", out, "--set", f"training.fp8={fp8}")
            with open(out) as f:
                got[fp8] = (json.load(f), p.stdout)
        h, kv, f, layers, tokens = 4096, 1024, 14336, 32, 256 * 8192  # configs/llama3-8b.yaml
        plan8, out8 = got["tensorwise"]
        self.assertEqual(got["off"][0]["fp8_flops_per_step"], 0)
        # q, k, v, o and the three SwiGLU matrices of every layer, 6 FLOPs per weight and token
        self.assertAlmostEqual(plan8["fp8_flops_per_step"] / (6 * layers * (2 * h * h + 2 * h * kv + 3 * h * f) * tokens),
                               1.0, places=12)
        self.assertEqual(plan8["flops_per_step"], got["off"][0]["flops_per_step"])  # MFU counts the same FLOPs
        self.assertLess(plan8["step_s"], got["off"][0]["step_s"])
        self.assertIn("h100 (1979 TFLOP/s dense fp8 (training.fp8) peak", out8)
        p = run("tessel-train", os.path.join(root, "configs", "llama3-8b.yaml"), "--dry-run", "--world-size", 64,
                "--device-profile", "a100", "--set", "training.fp8=rowwise", check=False)
        self.assertEqual(p.returncode, 2, p.stdout)
        self.assertIn("training.fp8 rowwise: the device profile a100 has no float8 peak (fp8_tflops", p.stderr)

    def test_dry_run_prints_the_grid(self):
        plan = self.plan({"training": {"global_batch": 8, "micro_batch": 1}})
        brief = run("tessel-train", plan, "--dry-run", "--world-size", 4).stdout
        # What matters first (valid, memory, step time, MFU); the grid and the plan on request.
        self.assertTrue(brief.startswith("# plan "), brief[:200])
        self.assertIn("MFU", "\n".join(brief.splitlines()[:6]))
        self.assertNotIn("rank grid: world", brief)
        self.assertLess(len(brief.splitlines()), 20, brief)
        self.assertIn("# the resolved plan and the rank grid: --details", brief)
        p = run("tessel-train", plan, "--dry-run", "--world-size", 4, "--details")
        self.assertIn("rank grid: world 4 = tp 1 x cp 1 x dp 4 x pp 1", p.stdout)
        self.assertIn("rank   3: tp 0 cp 0 dp 3 pp 0 | tp [3] cp [3] dp [0,1,2,3]", p.stdout)
        self.assertIn("2 micro-batches of 1 sequences per data rank", p.stdout)

    def test_dry_run_prints_the_pipeline(self):
        plan = {"training": {"global_batch": 8, "micro_batch": 1}, "model": {"layers": 8},
                "parallel": {"pp": 2, "pipeline": {"schedule": "interleaved", "virtual_stages": 2,
                                                   "layers_per_stage": [3, 2, 2, 1]}}}
        p = run("tessel-train", self.plan(plan), "--dry-run", "--world-size", 4)
        self.assertIn("schedule interleaved: 2 stages, 4 micro-batches, 2 chunks per rank", p.stdout)
        self.assertIn("# predicted bubble 0.1250 of ideal step time (the paper's figure for interleaved: 0.1250)",
                      p.stdout)
        self.assertIn("# layers per stage (stage = chunk·pp + pipeline rank): 3 2 2 1", p.stdout)
        self.assertNotIn("refused", p.stdout)
        # The timeline per rank (two 5,408-character lines for configs/llama3-8b.yaml) on request.
        self.assertIn("# the schedule's timeline per rank: --details", p.stdout)
        self.assertNotIn("rank  0 |", p.stdout)
        root = os.environ.get("TESSEL_ROOT", os.path.join(os.path.dirname(__file__), "../.."))
        p = run("tessel-train", os.path.join(root, "configs", "llama3-8b.yaml"), "--dry-run", "--world-size", 64)
        self.assertLess(max(map(len, p.stdout.splitlines())), 400, p.stdout[:2000])

    def test_dry_run_prints_zero_bubble_schedules(self):
        # pp 4, 8 micro-batches: 1F1B's bubble 3/8, ZB-H1's a third of it, ZBV's a sixth.
        for schedule, v, bubble in (("1f1b", 1, 0.375), ("zb-h1", 1, 0.125), ("zbv", 2, 0.0625)):
            plan = {"training": {"global_batch": 8, "micro_batch": 1}, "model": {"layers": 8},
                    "parallel": {"pp": 4, "pipeline": {"schedule": schedule, "virtual_stages": v}}}
            p = run("tessel-train", self.plan(plan), "--dry-run", "--world-size", 4, "--details")
            self.assertIn(f"# predicted bubble {bubble:.4f} of ideal step time (the paper's figure for "
                          f"{schedule}: {bubble:.4f})", p.stdout)
            if schedule == "zbv":  # the V: rank 0 holds the first and the last stage
                self.assertIn("# layers per stage (stage = chunk 0: pipeline rank r, chunk 1: 2·pp − 1 − r)", p.stdout)
                self.assertIn("rank  0 | F0.0 F1.0 ", p.stdout)
                self.assertIn("W7.0", p.stdout)

    def test_dry_run_prints_the_context_split(self):
        plan = {"training": {"global_batch": 8, "micro_batch": 1},
                "parallel": {"cp": 2, "context": {"method": "ring"}}}
        p = run("tessel-train", self.plan(plan), "--dry-run", "--world-size", 4, "--details")
        self.assertIn("rank grid: world 4 = tp 1 x cp 2 x dp 2 x pp 1", p.stdout)
        self.assertIn("# context parallel: 2 ranks (ring), 8 tokens per rank per sequence (chunks r and 3-r of 4)",
                      p.stdout)
        self.assertNotIn("refused", p.stdout)

    def test_launched_bad_plan_fails_before_any_communicator(self):
        overrides, world, message = CASES[0]
        t0 = time.time()
        p = run("tessel-launch", "--nproc-per-node", world, "--master-port", free_port(), "--",
                os.path.join(BIN, "tessel-train"), self.plan(overrides), check=False)
        self.assertLess(time.time() - t0, 15)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(message, p.stdout)  # the workers' own message, [rank N]-prefixed
        self.assertIn("exited with code 2", p.stderr)
        self.assertNotIn("rendezvous", p.stdout)


if __name__ == "__main__":
    unittest.main()
