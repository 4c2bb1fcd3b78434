"""Data parallelism over Gloo on CPU: dp=2 and dp=4, with and without gradient accumulation,
against the single-process run of the same global batch: loss within 1e-5 relative at each of 20
steps, parameters within 1e-5 after them."""
import os
import sys
import unittest

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import (TmpDirTest, base_plan, read_metrics, rel, run, write_plan, write_tokens, free_port)  # noqa: E402

STEPS, GLOBAL = 20, 8


class DataParallelParity(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("data.u16"), 6000, period=37)

    def train(self, out, arch, nproc, micro_batch, extra=()):
        plan = base_plan(self.tmp, arch, self.data, steps=STEPS, global_batch=GLOBAL, micro_batch=micro_batch,
                         threads=1, optimizer={"lr": 3e-3}, schedule={"warmup_steps": 3})
        plan["run"]["output_dir"] = self.path(out)
        plan["data"]["shuffle"] = True
        plan["parallel"] = {"timeout_s": 120}
        path = write_plan(self.path(out + ".yaml"), plan)
        if nproc == 1:
            run("tessel-train", path, *extra)
        else:
            run("tessel-launch", "--nproc-per-node", nproc, "--master-port", free_port(), "--",
                os.path.join(os.environ.get("TESSEL_BIN", "../../build/bin"), "tessel-train"), path, *extra)
        losses = [m["loss"] for m in read_metrics(self.path(out, "metrics.jsonl")) if "loss" in m]
        weights = load_file(self.path(out, "checkpoints", f"step_{STEPS}", "rank_00000.safetensors"))
        return losses, {k: v for k, v in weights.items() if not k.startswith("optim.")}

    def check(self, arch, nproc, micro_batch):
        ref_losses, ref_weights = self.train("single", arch, 1, micro_batch)
        losses, weights = self.train(f"dp{nproc}", arch, nproc, micro_batch)
        self.assertEqual(len(losses), STEPS)
        worst = max(rel(a, b) for a, b in zip(losses, ref_losses, strict=True))
        self.assertLess(worst, 1e-5, f"{arch} dp={nproc} mb={micro_batch}: {losses} vs {ref_losses}")
        self.assertLess(ref_losses[-1], ref_losses[0] - 0.3, "the loss must fall")
        wdiff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        self.assertLess(wdiff, 1e-5, f"{arch} dp={nproc}: parameters differ by {wdiff}")
        print(f"\n{arch} dp={nproc} micro_batch={micro_batch} ({GLOBAL // (nproc * micro_batch)} micro-batches per rank): "
              f"worst loss rel diff {worst:.2e}, worst parameter diff {wdiff:.2e}", file=sys.stderr)

    def test_dp2_no_accumulation(self):
        self.check("gpt2", 2, 4)

    def test_dp2_accumulation(self):
        self.check("llama", 2, 1)

    def test_dp4_no_accumulation(self):
        self.check("llama", 4, 2)

    def test_dp4_accumulation(self):
        self.check("gpt2", 4, 1)


if __name__ == "__main__":
    unittest.main()
