"""Pipeline parallelism beyond the parity table (tests/dist/layouts.py holds every schedule's
same-run check, with the activations each schedule holds): Hugging Face weights loaded stage by
stage, and a pipeline checkpoint resharded into other layouts."""
import os
import sys
import unittest


sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import (BIN, TmpDirTest, base_plan, read_metrics, rel, run, write_plan, write_tokens, free_port)  # noqa: E402
from parity import BASES, reference  # noqa: E402

STEPS, VOCAB, LAYERS, BATCH = BASES["pp"]["training"]["steps"], 301, 8, 8
HALF = STEPS // 2  # the checkpoint resumed: past the warm-up, in the LR decay
EVAL_EVERY = BASES["pp"]["training"]["eval_every"]


class PipelineParity(TmpDirTest):
    def plan(self, arch, name, pp=1, schedule="1f1b", v=1, tp=1, dp=1, sp=False, **extra):
        plan = base_plan(self.tmp, arch, self.data, steps=STEPS, global_batch=BATCH, micro_batch=1, threads=1,
                         optimizer={"lr": 3e-3}, schedule=dict(BASES["pp"]["training"]["schedule"]), grad_clip=0.5,
                         eval_every=EVAL_EVERY, eval_batches=1)
        plan["model"].update(vocab_size=VOCAB, layers=LAYERS)
        plan["run"]["output_dir"] = self.path(name)
        plan["data"].update(shuffle=True, val_fraction=0.1)
        plan["parallel"] = {"tp": tp, "pp": pp, "dp": dp, "sequence_parallel": sp, "timeout_s": 120,
                            "pipeline": {"schedule": schedule, "virtual_stages": v}}
        plan["checkpoint"] = {"resume": "never"}
        for section, values in extra.items():
            plan[section].update(values)
        return plan

    def launch(self, plan, world):
        path = write_plan(os.path.join(plan["run"]["output_dir"] + ".yaml"), plan)
        if world == 1:
            return run("tessel-train", path)
        return run("tessel-launch", "--nproc-per-node", world, "--master-port", free_port(), "--",
                   os.path.join(BIN, "tessel-train"), path)

    def test_init_from_hugging_face_weights(self):
        # model.init_from with Hugging Face names: each stage takes its layers (and the last stage
        # its copy of the tied table) from the file; pp=2 interleaved matches one process.
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)
        # The parity table's single-process gpt2 run (trained once), exported with HF names.
        ref = reference("pp", "gpt2")
        weights = os.path.join(ref["out"], "hf", "model.safetensors")
        losses = []
        for name, pp, schedule, v in (("init1", 1, "1f1b", 1), ("init2", 2, "interleaved", 2)):
            plan = self.plan("gpt2", name, pp, schedule, v, model={"init_from": weights})
            plan["training"]["steps"] = 4
            p = self.launch(plan, pp)
            # Pipeline transfers go over one-way channels, one per direction between neighbours.
            out = p.stdout + p.stderr
            self.assertEqual("pp.0.p2p.0to1 [0,1]" in out and "pp.0.p2p.1to0 [1,0]" in out, pp == 2)
            losses.append([m["loss"] for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m])
        self.assertEqual(len(losses[1]), 4)
        # Starts from the trained weights: well below the untrained model's first loss (ln 301 = 5.71).
        self.assertLess(losses[0][0], ref["loss"][0] - 0.3, f"starts from the trained weights ({ref['loss']})")
        worst = max(rel(a, b) for a, b in zip(*losses, strict=True))
        self.assertLess(worst, 1e-5)
        print(f"\ngpt2 init_from HF weights, pp=2 interleaved vs one process: worst loss rel diff {worst:.2e}",
              file=sys.stderr)

    def continue_runs(self, saved, first, runs):
        """Trains `first` (saving half-way), then each of `runs` ((name, pp, schedule)) from that
        checkpoint: the later steps match the uninterrupted single-process run."""
        ref_losses = reference("pp", "gpt2")["loss"]
        par = first["parallel"]
        self.launch(first, par["pp"] * par["dp"])
        for name, pp, schedule in runs:
            v = 2 if schedule in ("interleaved", "zbv") else 1
            plan = self.plan("gpt2", name, pp, schedule, v,
                             checkpoint={"resume": self.path(saved, "checkpoints", f"step_{HALF}")})
            self.launch(plan, pp)
            cont = [m for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]
            self.assertEqual([m["step"] for m in cont], list(range(HALF + 1, STEPS + 1)))
            worst = max(rel(m["loss"], ref_losses[m["step"] - 1]) for m in cont)
            self.assertLess(worst, 1e-5)
            was = f"pp={par['pp']} dp={par['dp']} zero {par.get('zero', 0)} {par['pipeline']['schedule']}"
            print(f"\ngpt2 {was} -> pp={pp} {schedule} resume at step {HALF}: worst loss rel diff {worst:.2e}",
                  file=sys.stderr)

    def test_resume_pipeline_checkpoint_in_other_layouts(self):
        # A pp=2 interleaved run's half-way checkpoint, continued with pp=4 1F1B and with one process.
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)
        self.continue_runs("pp2", self.plan("gpt2", "pp2", 2, "interleaved", 2, checkpoint={"every": HALF}),
                           (("cont_pp4", 4, "1f1b"), ("cont_pp1", 1, "1f1b")))

    def test_resume_zero_bubble_checkpoint_in_other_schedules(self):
        # A pp=2 zbv run (the V: rank 0 holds the first and last stage and the one tied token
        # table), continued with zb-h1 at pp=4 and 1F1B at pp=2.
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)
        self.continue_runs("zbv", self.plan("gpt2", "zbv", 2, "zbv", 2, checkpoint={"every": HALF}),
                           (("cont_zbh1_pp4", 4, "zb-h1"), ("cont_1f1b_pp2", 2, "1f1b")))

    def test_resume_zero3_pipeline_checkpoint(self):
        # ZeRO-3 inside a pipeline (dp2 x pp2 zb-h1, units kept gathered): each data rank saves its
        # pieces of its stage; 1F1B at pp=2 in one data rank, and zbv, continue the run.
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)
        first = self.plan("gpt2", "z3", 2, "zb-h1", dp=2, checkpoint={"every": HALF})
        first["parallel"].update(zero=3, zero3={"keep_gathered": True})
        self.continue_runs("z3", first, (("cont_z3_1f1b", 2, "1f1b"), ("cont_z3_zbv", 2, "zbv")))


if __name__ == "__main__":
    unittest.main()
