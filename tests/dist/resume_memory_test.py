"""Resuming reads a checkpoint one tensor at a time, only the tensors this rank holds, from the
mapped files (whose pages are dropped once copied): the resident memory a resume adds stays near
the largest tensor, not the checkpoint's size. Measured as the peak resident set before the first
step (memory.json) of a resumed run against a fresh run of the same plan, and the resumed run
equal to the uninterrupted one."""
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import TmpDirTest, base_plan, read_metrics, run, write_plan, write_tokens  # noqa: E402


class ResumeMemory(TmpDirTest):
    def plan(self, name, steps, **checkpoint):
        plan = base_plan(self.tmp, "gpt2", self.data, steps=steps, global_batch=2, micro_batch=2, threads=1)
        plan["model"].update({"layers": 2, "hidden": 512, "heads": 8, "vocab_size": 24000})
        plan["data"]["token_dtype"] = "uint16"
        plan["run"]["output_dir"] = self.path(name)
        plan["checkpoint"] = dict({"every": 1, "dir": self.path("ckpt")}, **checkpoint)
        return write_plan(self.path(name + ".yaml"), plan)

    def setup_rss(self, name):
        with open(self.path(name, "memory.json")) as f:
            return json.load(f)["ranks"][0]["setup_peak_rss_bytes"]

    def test_resume_adds_about_one_tensor_not_the_checkpoint(self):
        self.data = write_tokens(self.path("d.u16"), 20000, vocab=24000)
        run("tessel-train", self.plan("fresh", 3, resume="never"))  # saves ckpt/step_1..3
        run("tessel-train", self.plan("resumed", 3, resume=self.path("ckpt", "step_1")))
        ckpt = sum(os.path.getsize(os.path.join(self.path("ckpt", "step_1"), f))
                   for f in os.listdir(self.path("ckpt", "step_1")))
        largest = 24000 * 512 * 4  # the token table, fp32
        added = self.setup_rss("resumed") - self.setup_rss("fresh")
        print(f"\nresume: checkpoint {ckpt / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, "
              f"peak resident set before the first step +{added / 2**20:.1f} MiB over a fresh start",
              file=sys.stderr)
        self.assertGreater(ckpt, 4 * largest)
        # One global tensor, its coverage mask (1 byte per element) and allocator slack at most;
        # reading the checkpoint whole would add about twice its size.
        self.assertLess(added, 1.6 * largest)
        full = [m["loss"] for m in read_metrics(self.path("fresh", "metrics.jsonl"))]
        resumed = [m["loss"] for m in read_metrics(self.path("resumed", "metrics.jsonl"))]
        self.assertEqual(resumed, full[1:])


if __name__ == "__main__":
    unittest.main()
