"""Tensor parallelism beyond the parity table (tests/dist/layouts.py holds every tp layout's
same-run check): an out-of-range token stops every tp with the same words, and a tp=2 checkpoint
continues in one process as the uninterrupted run."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import (BIN, TmpDirTest, base_plan, read_metrics, rel, run, write_plan, write_tokens, free_port)  # noqa: E402
from parity import BASES, reference  # noqa: E402

STEPS, VOCAB = BASES["tp"]["training"]["steps"], 301
HALF = STEPS // 2  # the checkpoint resumed: past the warm-up, in the LR decay


class TensorParallelParity(TmpDirTest):
    def test_out_of_range_token_same_error_at_every_tp(self):
        import numpy as np
        toks = np.full(4000, 7, dtype="<u2")
        toks[40] = VOCAB + 5
        toks.tofile(self.path("bad.u16"))
        messages = []
        for tp in (1, 2):
            plan = base_plan(self.tmp, "gpt2", self.path("bad.u16"), steps=2, global_batch=4, micro_batch=2, threads=1)
            plan["model"]["vocab_size"] = VOCAB
            plan["parallel"] = {"tp": tp}
            path = write_plan(self.path(f"bad{tp}.yaml"), plan)
            if tp == 1:
                p = run("tessel-train", path, check=False)
                out = p.stderr
            else:
                p = run("tessel-launch", "--nproc-per-node", tp, "--master-port", free_port(), "--",
                        os.path.join(BIN, "tessel-train"), path, check=False)
                out = p.stdout
            self.assertNotEqual(p.returncode, 0)
            messages.append(out)
        for out in messages:  # found by the start-up scan, the same words with one or two ranks
            self.assertIn(f"bad.u16 (token 40): token id {VOCAB + 5} is outside model.vocab_size {VOCAB} "
                          f"(ids run from 0 to {VOCAB - 1}); found by the start-up scan", out)

    def test_resume_tp2_checkpoint_in_one_process(self):
        # A tp=2 run's half-way checkpoint, continued by one process: the later steps match the
        # uninterrupted single-process run (the checkpoint reshards to any layout).
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)
        ref_losses = reference("tp", "llama")["loss"]  # the parity table's, trained once
        plan = base_plan(self.tmp, "llama", self.data, steps=STEPS, global_batch=8, micro_batch=2, threads=1,
                         optimizer={"lr": 3e-3}, schedule=dict(BASES["tp"]["training"]["schedule"]), grad_clip=0.5)
        plan["model"]["vocab_size"] = VOCAB
        plan["data"]["shuffle"] = True
        plan["checkpoint"] = {"every": HALF}
        plan["run"]["output_dir"] = self.path("tp2")
        plan["parallel"] = {"tp": 2, "timeout_s": 120}
        run("tessel-launch", "--nproc-per-node", 2, "--master-port", free_port(), "--", os.path.join(BIN, "tessel-train"),
            write_plan(self.path("tp2.yaml"), plan))
        plan["run"]["output_dir"] = self.path("cont")
        plan["parallel"] = {"tp": 1}
        plan["checkpoint"]["resume"] = self.path("tp2", "checkpoints", f"step_{HALF}")
        run("tessel-train", write_plan(self.path("cont.yaml"), plan))
        cont = [m for m in read_metrics(self.path("cont", "metrics.jsonl")) if "loss" in m]
        self.assertEqual([m["step"] for m in cont], list(range(HALF + 1, STEPS + 1)))
        worst = max(rel(m["loss"], ref_losses[m["step"] - 1]) for m in cont)
        self.assertLess(worst, 1e-5)
        print(f"\nllama tp=2 -> tp=1 resume at step {HALF}: worst loss rel diff {worst:.2e} over steps {HALF + 1}-{STEPS}", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
