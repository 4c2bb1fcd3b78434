"""tessel-data and the three data formats through tessel-train."""
import os
import shutil
import unittest

import numpy as np

from common import TmpDirTest, read_metrics, run, write_plan


def text_plan(tmp, fmt, path, out):
    return {"run": {"seed": 3, "output_dir": os.path.join(tmp, out)},
            "model": {"arch": "gpt2", "layers": 1, "hidden": 32, "heads": 2, "vocab_size": 257, "max_seq_len": 32},
            "training": {"device": "cpu", "steps": 3, "global_batch": 4, "micro_batch": 2, "seq_len": 32, "threads": 2},
            "data": {"format": fmt, "path": path, "shuffle": True},
            "logging": {"every": 1}}


class DataCli(TmpDirTest):
    def setUp(self):
        super().setUp()
        os.makedirs(self.path("txt"))
        for i in range(3):
            with open(self.path("txt", f"doc{i}.txt"), "w") as f:
                f.write(f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i) + "é\n")

    def test_text_and_megatron_train_identically(self):
        run("tessel-data", self.path("txt", "*.txt"), "--out", self.path("ds"))
        self.assertTrue(os.path.exists(self.path("ds.bin")) and os.path.exists(self.path("ds.idx")))
        # The .bin holds every byte of every file plus one end-of-document token per file.
        sizes = sum(os.path.getsize(self.path("txt", f)) for f in os.listdir(self.path("txt")))
        self.assertEqual(os.path.getsize(self.path("ds.bin")), 2 * (sizes + 3))
        run("tessel-train", write_plan(self.path("a.yaml"), text_plan(self.tmp, "text", [self.path("txt", "*.txt")], "a")))
        run("tessel-train", write_plan(self.path("b.yaml"), text_plan(self.tmp, "megatron", [self.path("ds")], "b")))
        a = [m["loss"] for m in read_metrics(self.path("a", "metrics.jsonl"))]
        b = [m["loss"] for m in read_metrics(self.path("b", "metrics.jsonl"))]
        self.assertEqual(len(a), 3)
        self.assertEqual(a, b)

    def test_corrupt_and_truncated_files(self):
        run("tessel-data", self.path("txt", "*.txt"), "--out", self.path("ds"))
        plan = write_plan(self.path("p.yaml"), text_plan(self.tmp, "megatron", [self.path("ds")], "r"))
        shutil.copy(self.path("ds.idx"), self.path("good.idx"))
        with open(self.path("ds.idx"), "r+b") as f:
            f.write(b"NOTMEGAT")
        p = run("tessel-train", plan, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("ds.idx: corrupt Megatron index: bad magic", p.stderr)
        shutil.copy(self.path("good.idx"), self.path("ds.idx"))
        size = os.path.getsize(self.path("ds.bin"))
        with open(self.path("ds.bin"), "r+b") as f:
            f.truncate(size - 10)
        p = run("tessel-train", plan, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"ds.bin: truncated: sequence 2 of {self.path('ds')}.idx needs bytes up to {size}", p.stderr)

    def test_out_of_range_token(self):
        toks = np.full(4000, 7, dtype="<u2")
        toks[100] = 5000
        toks.tofile(self.path("t.u16"))
        plan = text_plan(self.tmp, "tokens", [self.path("t.u16")], "t")
        plan["data"]["shuffle"] = False
        p = run("tessel-train", write_plan(self.path("p.yaml"), plan), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("t.u16 (token 100): token id 5000 is outside model.vocab_size 257 (sample 3)", p.stderr)


if __name__ == "__main__":
    unittest.main()
