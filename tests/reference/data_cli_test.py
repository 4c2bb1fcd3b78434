"""tessel-data and the three data formats through tessel-train."""
import json
import os
import shutil
import unittest

import numpy as np

from common import TmpDirTest, read_metrics, resume_on_two_ranks, run, write_plan


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
        # The same tokens in the same order: the same losses within the parity bar (the two
        # loaders' buffers sit at different alignments, by which AVX-512 matmuls round, ~1e-6);
        # other tokens would move the loss by far more.
        for x, y in zip(a, b, strict=True):
            self.assertLess(abs(x - y), 1e-5 * abs(x), (a, b))

    def test_never_reads_or_overwrites_its_own_output(self):
        # A glob over a folder holding a previous run's PREFIX.bin/.idx used to read them as text
        # input; an input named PREFIX.bin used to be overwritten.
        run("tessel-data", self.path("txt", "*"), "--out", self.path("txt", "ds"))
        first = open(self.path("txt", "ds.bin"), "rb").read()
        p = run("tessel-data", self.path("txt", "*"), "--out", self.path("txt", "ds"))
        self.assertIn("ds.bin: skipped: it is this run's output", p.stderr + p.stdout)
        self.assertIn("ds.tessel.json: skipped: it is this run's output", p.stderr + p.stdout)
        self.assertEqual(open(self.path("txt", "ds.bin"), "rb").read(), first, "the second run read its own output")
        shutil.copy(self.path("txt", "doc0.txt"), self.path("in.bin"))
        p = run("tessel-data", self.path("in.bin"), "--out", self.path("in"), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("in.bin: is an input and also what --out", p.stderr)
        with open(self.path("txt", "doc0.txt"), "rb") as a, open(self.path("in.bin"), "rb") as b:
            self.assertEqual(a.read(), b.read(), "the input was overwritten")

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

    def test_tokens_in_uint32_train_like_uint16(self):
        # data.token_dtype uint32 (vocabularies past 65,536): the same ids give the same losses.
        toks = np.random.default_rng(1).integers(0, 257, size=6000)
        toks.astype("<u2").tofile(self.path("t.u16"))
        toks.astype("<u4").tofile(self.path("t.u32"))
        losses = []
        for name, dtype in (("t.u16", "uint16"), ("t.u32", "uint32")):
            plan = text_plan(self.tmp, "tokens", [self.path(name)], dtype)
            plan["data"]["token_dtype"] = dtype
            run("tessel-train", write_plan(self.path(dtype + ".yaml"), plan))
            losses.append([m["loss"] for m in read_metrics(self.path(dtype, "metrics.jsonl"))])
        self.assertEqual(len(losses[0]), 3)
        self.assertEqual(losses[0], losses[1])
        # A uint16 file read as uint32 is refused when its size says so, or names the bad id.
        np.arange(3, dtype="<u2").tofile(self.path("odd.u16"))
        plan = text_plan(self.tmp, "tokens", [self.path("odd.u16")], "odd")
        plan["data"]["token_dtype"] = "uint32"
        p = run("tessel-train", write_plan(self.path("odd.yaml"), plan), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("odd.u16: size 6 bytes is not a multiple of 4 (data.token_dtype uint32)", p.stderr)

    def test_out_of_range_token_is_found_before_any_work(self):
        # An id of 5000 at token 1500 used to train until the sample holding it was drawn (steps
        # and checkpoints first), and a run that never drew it ended with exit 0. Now the start-up
        # scan names it, the run exits 2, and nothing is written: no metrics, no checkpoint.
        for fmt in ("tokens", "megatron"):
            toks = np.full(4000, 7, dtype="<u2")
            toks[1500] = 5000
            if fmt == "tokens":
                toks.tofile(self.path("t.u16"))
                path, where = self.path("t.u16"), "t.u16 (token 1500)"
            else:
                run("tessel-data", self.path("txt", "*.txt"), "--out", self.path("ds"))
                with open(self.path("ds.bin"), "r+b") as f:
                    f.seek(2 * 500)
                    f.write(np.array([5000], dtype="<u2").tobytes())
                path, where = self.path("ds"), "ds.bin (token 500)"
            plan = text_plan(self.tmp, fmt, [path], "o" + fmt)
            plan["data"]["shuffle"] = False
            plan["training"]["steps"] = 2  # reads samples 0-7: never the bad one
            plan["checkpoint"] = {"every": 1}
            p = run("tessel-train", write_plan(self.path("p.yaml"), plan), check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(f"{where}: token id 5000 is outside model.vocab_size 257 (ids run from 0 to 256); "
                          "found by the start-up scan of the data, before any training", p.stderr)
            out = self.path("o" + fmt)
            self.assertEqual(os.listdir(out) if os.path.exists(out) else [], [], "the refused run wrote")
        # Clean data: the scan says what it read and how fast.
        toks[1500] = 7
        toks.tofile(self.path("t.u16"))
        plan = text_plan(self.tmp, "tokens", [self.path("t.u16")], "clean")
        p = run("tessel-train", write_plan(self.path("c.yaml"), plan))
        self.assertRegex(p.stdout + p.stderr, r"data: token ids checked against model.vocab_size 257: 4000 tokens "
                                              r"\(0.008 MB\) in [0-9.]+ s \([0-9.]+ GB/s\)")

class Blend(TmpDirTest):
    """data.blend: weighted datasets with Megatron-Core's blending rule, resumable anywhere."""

    def blend_rule(self, weights, n):  # Megatron-Core's build_blending_indices, restated
        w = [x / sum(weights) for x in weights]
        taken, picks = [0] * len(w), []
        for i in range(n):
            err = [w[d] * max(i, 1) - taken[d] for d in range(len(w))]
            d = max(range(len(w)), key=lambda k: (err[k], -k))
            picks.append(d)
            taken[d] += 1
        return picks, taken

    def plan(self, out, **training):
        # Two token files whose ids name their dataset: 0-99 and 100-199.
        rng = np.random.default_rng(0)
        for name, lo, n in (("a.bin", 0, 4000), ("b.bin", 100, 9000)):
            if not os.path.exists(self.path(name)):
                rng.integers(lo, lo + 100, size=n).astype("<u2").tofile(self.path(name))
        return {"run": {"seed": 3, "output_dir": self.path(out)},
                "model": {"arch": "gpt2", "layers": 2, "hidden": 32, "heads": 2, "vocab_size": 256, "max_seq_len": 32},
                "training": {"device": "cpu", "steps": 6, "global_batch": 4, "micro_batch": 1, "seq_len": 16,
                             "threads": 1, **training},
                "data": {"format": "tokens", "val_fraction": 0.1,
                         "blend": [{"weight": 1, "path": self.path("a.bin")}, {"weight": 3, "path": [self.path("b.bin")]}]},
                "logging": {"every": 1}, "checkpoint": {"every": 3}}

    def test_samples_follow_the_rule_and_resume_anywhere(self):
        path = write_plan(self.path("p.yaml"), self.plan("run"))
        run("tessel-train", "samples", path, "--count", 40, "--out", self.path("s.i32"))
        rows = np.fromfile(self.path("s.i32"), dtype="<i4").reshape(40, 17)
        picks, taken = self.blend_rule([1, 3], 40)
        self.assertEqual([int(r[0] >= 100) for r in rows], picks)
        self.assertTrue(all((r >= 100).all() == (r[0] >= 100) for r in rows))  # one dataset per sample
        p = run("tessel-train", path, "--dry-run", "--world-size", 1)
        self.assertIn("item 1: weight 0.25, 6 samples", p.stdout)
        self.assertIn("item 2: weight 0.75, 18 samples", p.stdout)
        # The run: its metrics count each dataset's samples; resumed from step 3 under another
        # layout (two data ranks), every loss is the uninterrupted run's.
        run("tessel-train", path)
        whole = [m for m in read_metrics(self.path("run", "metrics.jsonl")) if "loss" in m]
        self.assertEqual([m["blend_samples"] for m in whole],
                         [self.blend_rule([1, 3], 4 * s)[1] for s in range(1, 7)])
        # An interrupted run: the checkpoint at step 3, resumed on two data ranks.
        resumed = self.plan("cut")
        resumed["parallel"] = {"dp": 2}
        resume_on_two_ranks(self, self.path("run"), self.path("cut"), write_plan(self.path("r.yaml"), resumed), 3)

    def test_bad_blends_name_the_item(self):
        plan = self.plan("x")
        plan["data"]["blend"][1]["path"] = [self.path("missing.bin")]
        p = run("tessel-train", write_plan(self.path("p.yaml"), plan), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("data.blend item 2", p.stderr)
        plan["data"]["path"] = [self.path("a.bin")]
        p = run("tessel-train", write_plan(self.path("q.yaml"), plan), "--dry-run", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("data.path and data.blend both name training data", p.stderr)


class Splits(TmpDirTest):
    """data.valid / data.test: datasets of their own, evaluated and scored dataset by dataset."""

    def test_validation_per_dataset_and_the_test_split(self):
        rng = np.random.default_rng(1)
        for name, lo, n in (("a.bin", 0, 3000), ("va.bin", 0, 700), ("vb.bin", 100, 900), ("t.bin", 100, 600)):
            rng.integers(lo, lo + 100, size=n).astype("<u2").tofile(self.path(name))
        plan = {"run": {"seed": 3, "output_dir": self.path("run")},
                "model": {"arch": "gpt2", "layers": 1, "hidden": 32, "heads": 2, "vocab_size": 256, "max_seq_len": 16},
                "training": {"device": "cpu", "steps": 4, "global_batch": 4, "micro_batch": 2, "seq_len": 16,
                             "threads": 1, "eval_every": 2, "eval_batches": 2},
                "data": {"format": "tokens", "path": [self.path("a.bin")],
                         "valid": [{"weight": 1, "path": self.path("va.bin")}, {"weight": 3, "path": self.path("vb.bin")}],
                         "test": [{"weight": 1, "path": self.path("t.bin")}]},
                "logging": {"every": 1}}
        path = write_plan(self.path("p.yaml"), plan)
        run("tessel-train", path)
        evals = [m for m in read_metrics(self.path("run", "metrics.jsonl")) if "val_loss" in m]
        self.assertEqual([m["step"] for m in evals], [2, 4])
        for m in evals:
            each = m["val_loss_by_dataset"]
            self.assertEqual(sorted(each), ["data.valid item 1", "data.valid item 2"])
            self.assertAlmostEqual(m["val_loss"], 0.25 * each["data.valid item 1"] + 0.75 * each["data.valid item 2"],
                                   places=12)
        # The validation split: each dataset's samples in turn (43 of va, then vb's).
        run("tessel-train", "samples", path, "--split", "valid", "--count", 50, "--out", self.path("v.i32"))
        rows = np.fromfile(self.path("v.i32"), dtype="<i4").reshape(50, 17)
        self.assertTrue((rows[:43] < 100).all() and (rows[43:] >= 100).all())
        # The test split scored, and the same rows written by `samples` scored as tokens.
        weights = self.path("run", "checkpoints")
        p = run("tessel-train", "score", path, "--weights", weights, "--split", "test")
        got = json.loads(p.stdout.strip().splitlines()[-1])
        n = (600 - 1) // 16
        self.assertEqual(got["by_dataset"]["data.test item 1"]["rows"], n)
        run("tessel-train", "samples", path, "--split", "test", "--count", n, "--out", self.path("t.i32"))
        p = run("tessel-train", "score", path, "--weights", weights, "--tokens", self.path("t.i32"))
        self.assertAlmostEqual(json.loads(p.stdout.strip().splitlines()[-1])["loss"], got["loss"], places=6)
        # A plan without a test split says so.
        del plan["data"]["test"]
        p = run("tessel-train", "score", write_plan(self.path("q.yaml"), plan), "--weights", weights, "--split",
                "test", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("holds no test data: give data.split", p.stderr)



class DocumentMask(TmpDirTest):
    """data.document_mask through tessel-train: text documents (each file one, ended by id 256)."""

    def plan(self, out, mask=True):
        return {"run": {"seed": 3, "output_dir": self.path(out)},
                "model": {"arch": "llama", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2,
                          "vocab_size": 257, "max_seq_len": 32},
                "training": {"device": "cpu", "steps": 6, "global_batch": 4, "micro_batch": 1, "seq_len": 32,
                             "threads": 1},
                "data": {"format": "text", "path": [self.path("docs", "*.txt")], "document_mask": mask},
                "logging": {"every": 1}, "checkpoint": {"every": 3}}

    def test_masked_run_reports_resumes_and_differs(self):
        rng = np.random.default_rng(5)
        os.makedirs(self.path("docs"))
        for i in range(60):  # documents of 3 to 40 bytes: several in every 32-token sample
            with open(self.path("docs", f"{i:02d}.txt"), "wb") as f:
                f.write(bytes(rng.integers(97, 123, size=int(rng.integers(3, 41))).tolist()))
        path = write_plan(self.path("p.yaml"), self.plan("run"))
        p = run("tessel-train", path, "--dry-run", "--world-size", 1)
        self.assertRegex(p.stdout, r"# document mask \(data.eod_token 256\): attention inside documents "
                                   r"does [0-9.]+% of a causal sequence's attention work")
        share = float(p.stdout.split("documents does ")[1].split("%")[0])
        # The same share from those samples themselves: Σ l(l+1) over samples·T(T+1).
        n = int(p.stdout.split("attention work on the first ")[1].split(" ")[0])
        run("tessel-train", "samples", path, "--count", n, "--out", self.path("s.i32"))
        rows = np.fromfile(self.path("s.i32"), dtype="<i4").reshape(n, 33)[:, :32]
        kept = 0
        for r in rows:
            cuts = [0] + [i + 1 for i in range(31) if r[i] == 256] + [32]
            kept += sum((b - a) * (b - a + 1) for a, b in zip(cuts, cuts[1:]))
        self.assertAlmostEqual(share, 100 * kept / (len(rows) * 32 * 33), delta=0.05)
        self.assertLess(share, 80)
        # Sized away from the data (a login node): the dry-run still answers, and says why the
        # mask's saving is not counted.
        away = self.plan("away")
        away["data"]["path"] = [self.path("elsewhere", "*.txt")]
        p = run("tessel-train", write_plan(self.path("away.yaml"), away), "--dry-run", "--world-size", 1)
        self.assertIn("# document mask: its attention share is measured on the data, which cannot be read "
                      "here (data.path: ", p.stdout)
        self.assertIn("# predicted on", p.stdout)
        p = run("tessel-train", path)
        self.assertIn("| document mask after id 256", p.stderr + p.stdout)
        masked = [m["loss"] for m in read_metrics(self.path("run", "metrics.jsonl")) if "loss" in m]
        run("tessel-train", write_plan(self.path("u.yaml"), self.plan("unmasked", mask=False)))
        unmasked = [m["loss"] for m in read_metrics(self.path("unmasked", "metrics.jsonl")) if "loss" in m]
        self.assertGreater(max(abs(a - b) for a, b in zip(masked, unmasked)), 1e-4)
        # Interrupted at step 3 and resumed on two data ranks: the uninterrupted run's losses.
        resumed = self.plan("cut")
        resumed["parallel"] = {"dp": 2}
        resume_on_two_ranks(self, self.path("run"), self.path("cut"), write_plan(self.path("r.yaml"), resumed), 3)


if __name__ == "__main__":
    unittest.main()
