"""Mixture of experts beyond the parity table (tests/dist/layouts.py holds the same-run rows):
a checkpoint saved (half-way) with the experts split over 2 ranks continues with them split over 4, held
whole by one process, and inside a pipeline, with the same losses as the uninterrupted run; and
bad MoE plans are refused before start-up, naming the keys and their values."""
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import BIN, TmpDirTest, read_metrics, rel, run, write_plan, free_port  # noqa: E402
from parity import BASES, Row, Runs, reference  # noqa: E402


class MoeResume(TmpDirTest):
    def plan(self, name, parallel, base="moe", **checkpoint):
        plan = Runs().plan(Row(name, base, "llama", 1), parallel)
        plan["run"]["output_dir"] = self.path(name)
        plan["checkpoint"] = {"resume": "never", **checkpoint}
        return plan

    def launch(self, plan, world):
        path = write_plan(plan["run"]["output_dir"] + ".yaml", plan)
        if world == 1:
            return run("tessel-train", path)
        return run("tessel-launch", "--nproc-per-node", world, "--master-port", free_port(), "--",
                   os.path.join(BIN, "tessel-train"), path)

    def continue_runs(self, saved, first, world, runs, base="moe"):
        """Trains `first` (saving half-way, past the warm-up), then each of `runs` ((name, parallel,
        world)) from that checkpoint: the later steps match the uninterrupted single-process run."""
        ref = reference(base, "llama")["loss"]
        steps = BASES[base]["training"]["steps"]
        half = steps // 2
        self.launch(self.plan(saved, first, base, every=half), world)
        saved_step = self.path(saved, "checkpoints", f"step_{half}")
        for name, parallel, world in runs:
            self.launch(self.plan(name, parallel, base, resume=saved_step), world)
            cont = [m for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]
            self.assertEqual([m["step"] for m in cont], list(range(half + 1, steps + 1)), name)
            worst = max(rel(m["loss"], ref[m["step"] - 1]) for m in cont)
            self.assertLess(worst, 1e-5, name)
            print(f"\n{base} {first} -> {parallel} resume at step {half}: worst loss rel diff {worst:.2e}",
                  file=sys.stderr)

    def host_reads(self, name, base, parallel, world):
        """The most host reads one training step made on any rank (memory.json, counted with
        TESSEL_COUNT_HOST_READS=1: LibTorch's item/nonzero/... and Tessel's own copies)."""
        plan = self.plan(name, parallel, base)
        plan["training"]["steps"] = 3
        os.environ["TESSEL_COUNT_HOST_READS"] = "1"
        try:
            self.launch(plan, world)
        finally:
            del os.environ["TESSEL_COUNT_HOST_READS"]
        with open(self.path(name, "memory.json")) as f:
            return max(r["host_reads_per_step"] for r in json.load(f)["ranks"])

    def test_host_reads_per_step(self):
        # A dense step reads nothing on the host; nor does an MoE step whose experts stay on one
        # rank, dropless or with a capacity (the dropped rows no longer need a count on the host).
        # With experts split over ranks the exchange's split sizes are read once per MoE layer and
        # micro-batch: 4 MoE layers x 4 micro-batches per rank. The code before this test also
        # read on the host once per MoE layer and micro-batch with a capacity (its item()), and
        # in fp32 on a GPU nine times more (the grouped matmul's fallback); the first two plans
        # also made one read per step (the learning rate's item()), which a GPU run did not wait on.
        counts = {"dense": self.host_reads("dense", "tp", {"dp": 2}, 2),
                  "moe": self.host_reads("moe", "moe", {}, 1),
                  "capacity": self.host_reads("cap", "moe_capacity", {}, 1),
                  "ep2": self.host_reads("ep2r", "moe", {"dp": 2, "ep": 2}, 2),
                  "ep2_capacity": self.host_reads("ep2c", "moe_capacity", {"dp": 2, "ep": 2}, 2)}
        print(f"\nhost reads per step: {counts}", file=sys.stderr)
        self.assertEqual(counts, {"dense": 0, "moe": 0, "capacity": 0, "ep2": 16, "ep2_capacity": 16})

    def test_resume_across_expert_parallel_sizes(self):
        self.continue_runs("ep2", {"dp": 2, "ep": 2}, 2,
                           (("ep4", {"dp": 4, "ep": 4}, 4), ("one", {}, 1),
                            ("ep2_pp2", {"dp": 2, "ep": 2, "pp": 2}, 4)))

    def test_resume_balance_bias(self):
        # The balance biases are state the checkpoint carries (fp32, not trained).
        self.continue_runs("bias_ep2", {"dp": 2, "ep": 2}, 2, (("bias_one", {}, 1),), base="moe_bias")

    def test_resume_zero_expert_state(self):
        # ZeRO-2 with the experts' state split over the 2 ranks holding each expert half: every
        # rank saves its pieces; ep 4 without ZeRO and ZeRO-3 at ep 2 continue the run.
        self.continue_runs("z2", {"dp": 4, "ep": 2, "zero": 2}, 4,
                           (("z0_ep4", {"dp": 4, "ep": 4}, 4), ("z3_ep2", {"dp": 2, "ep": 2, "zero": 3}, 2)))


class MoePlanChecks(TmpDirTest):
    """Each bad plan exits 2 before any process group exists, with a message naming the keys."""

    def refused(self, sets, world, *needles):
        plan = Runs().plan(Row("bad", "moe", "llama", 1), {})
        plan["run"]["output_dir"] = self.path("bad")
        path = write_plan(self.path("bad.yaml"), plan)
        args = ["tessel-train", path, "--dry-run", "--world-size", world]
        for s in sets:
            args += ["--set", s]
        p = run(*args, check=False)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        for n in needles:
            self.assertIn(n, p.stderr)

    def test_bad_plans_are_named(self):
        self.refused(["parallel.dp=3", "parallel.ep=3"], 3, "model.moe.experts (4) must be divisible by "
                     "parallel.ep (3)")
        self.refused(["model.moe.experts=8", "parallel.dp=2", "parallel.ep=4"], 2,
                     "parallel.ep (4) must divide parallel.dp (2)")
        self.refused(["model.moe.top_k=5"], 1, "model.moe.top_k (5) must be <= model.moe.experts (4)")
        self.refused(["model.moe.experts=0", "parallel.dp=2", "parallel.ep=2"], 2,
                     "parallel.ep (2) needs a mixture of experts")
        self.refused(["model.moe.capacity_factor=1.5", "parallel.cp=2"], 2, "model.moe.capacity_factor (1.5)",
                     "parallel.cp (2)")
        self.refused(["model.arch=gpt2", "model.kv_heads=4"], 1, "model.moe.experts (4) builds llama-family")
        self.refused(["model.moe.every=9"], 1, "model.moe.every (9) leaves no MoE layer")
        self.refused(["training.dtype=bf16", "model.moe.ffn_hidden=30"], 1,
                     "model.hidden (32) and model.moe.ffn_hidden (30) to be multiples of 8")


if __name__ == "__main__":
    unittest.main()
