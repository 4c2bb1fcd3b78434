"""Context parallelism beyond the parity table (tests/dist/layouts.py holds every method's same-run
checks, alone and in 4D): checkpoints of a cp run resume in other layouts and methods, and back."""
import os
import sys
import unittest


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import TmpDirTest, base_plan, launch_plan, read_metrics, rel, write_tokens  # noqa: E402

STEPS, VOCAB, LAYERS, BATCH, SEQ = 8, 301, 4, 8, 32
HALF = STEPS // 2  # the checkpoint resumed: past the warm-up (3 steps), in the LR decay


class ContextParity(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 12000, vocab=VOCAB, period=41)

    def plan(self, arch, name, cp=1, method="allgather", dp=1, tp=1, pp=1, sp=False, zero=0, **extra):
        plan = base_plan(self.tmp, arch, self.data, steps=STEPS, global_batch=BATCH, micro_batch=1, threads=1,
                         seq_len=SEQ, optimizer={"lr": 3e-3}, schedule={"warmup_steps": 3}, grad_clip=0.5,
                         eval_every=HALF, eval_batches=1)
        plan["model"].update(vocab_size=VOCAB, layers=LAYERS)
        plan["run"]["output_dir"] = self.path(name)
        plan["data"].update(shuffle=True, val_fraction=0.1)
        plan["parallel"] = {"cp": cp, "context": {"method": method}, "dp": dp, "tp": tp, "pp": pp,
                            "sequence_parallel": sp, "zero": zero, "timeout_s": 120}
        plan["checkpoint"] = {"resume": "never", "every": HALF}
        for section, values in extra.items():
            plan[section].update(values)
        return plan

    def train(self, arch, name, world, **layout):
        """The losses of an uninterrupted run."""
        launch_plan(self.plan(arch, name, **layout), world)
        return [m["loss"] for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]

    def check_continuation(self, plan, world, ref):
        # The steps of a run resumed from a half-way checkpoint against the uninterrupted run.
        name = os.path.basename(plan["run"]["output_dir"])
        launch_plan(plan, world)
        cont = [m for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]
        self.assertEqual([m["step"] for m in cont], list(range(HALF + 1, STEPS + 1)))
        worst = max(rel(m["loss"], ref[m["step"] - 1]) for m in cont)
        self.assertLess(worst, 1e-5, name)
        print(f"\n{name}: worst loss rel diff {worst:.2e} vs the uninterrupted run", file=sys.stderr)

    def test_alltoall_and_hybrid_checkpoints_cross_methods(self):
        # A cp=2 alltoall run of llama (grouped-query heads) saves half-way; it continues under
        # hybrid at cp=4 (pairs) and under ring at cp=2 x pp=2: the later steps match the
        # uninterrupted one-process run.
        ref = self.train("llama", "single_llama", 1)
        launch_plan(self.plan("llama", "a2a", cp=2, method="alltoall"), 2)
        saved = self.path("a2a", "checkpoints", f"step_{HALF}")
        for name, world, layout in (("a2a_to_hybrid", 4, {"cp": 4, "method": "hybrid"}),
                                    ("a2a_to_ring_pp2", 4, {"cp": 2, "method": "ring", "pp": 2})):
            plan = self.plan("llama", name, checkpoint={"resume": saved}, **layout)
            plan["parallel"]["context"]["alltoall_size"] = 2
            self.check_continuation(plan, world, ref)

    def test_checkpoints_cross_layouts(self):
        # A cp=2 ring run's half-way checkpoint continues in one process, and the one-process
        # run's continues at cp=4 (allgather) x dp=2: the later steps match the uninterrupted run.
        ref = self.train("gpt2", "single", 1)
        launch_plan(self.plan("gpt2", "cp2", cp=2, method="ring"), 2)
        for name, world, source, layout in (("cp2_to_one", 1, "cp2", {}),
                                            ("one_to_cp4dp2", 8, "single", {"cp": 4, "dp": 2})):
            plan = self.plan("gpt2", name, checkpoint={"resume": self.path(source, "checkpoints", f"step_{HALF}")},
                             **layout)
            self.check_continuation(plan, world, ref)


if __name__ == "__main__":
    unittest.main()
