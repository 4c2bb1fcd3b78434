"""data.order megatron: Tessel's training samples are Megatron-Core's, token for token, in order.

Megatron-Core (the PyPI wheel megatron-core, installed for tests only) builds its GPTDataset and
BlendedDataset from the same .bin/.idx prefixes, weights, split, seed, sequence length and number
of samples; `tessel-train samples` writes what a Tessel run of the same plan reads."""
import logging
import os
import unittest
import warnings

import numpy as np

from common import TmpDirTest, read_metrics, resume_on_two_ranks, run, write_plan

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402


class _Tokenizer:  # what GPTDatasetConfig asks of a tokenizer
    pad, eod, eos, vocab_size = 0, 1, 1, 1000
    special_tokens_dict = {}
    unique_identifiers = {"tokenizer": "ids"}


class MegatronSamples(TmpDirTest):
    def prefix(self, name, docs, seed):
        """A Megatron dataset of `docs` documents of 1..90 tokens; dataset k's ids lie in
        [100k, 100k+100) so a sample shows which dataset it came from."""
        p = self.path(name)
        if not os.path.exists(p + ".idx"):
            rng = np.random.default_rng(seed)
            b = IndexedDatasetBuilder(p + ".bin", dtype=np.uint16)
            for _ in range(docs):
                n = int(rng.integers(1, 91))
                b.add_document(np.array(rng.integers(100 * seed, 100 * seed + 100, n), dtype=np.uint16), [n])
            b.finalize(p + ".idx")
        return p

    def megatron(self, blend, split, seed, seq_len, sizes):
        cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_len, blend=blend, split=split,
                               tokenizer=_Tokenizer(),
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()

    def tessel(self, data, seed, seq_len, steps, global_batch, split="train", count=None, tag="t"):
        plan = {"run": {"seed": seed, "output_dir": self.path(tag)},
                "model": {"arch": "gpt2", "layers": 1, "hidden": 32, "heads": 2, "vocab_size": 1000,
                          "max_seq_len": seq_len},
                "training": {"device": "cpu", "steps": steps, "global_batch": global_batch,
                             "micro_batch": global_batch, "seq_len": seq_len},
                "data": {"format": "megatron", "order": "megatron", **data}}
        path = write_plan(self.path(tag + ".yaml"), plan)
        count = count or steps * global_batch
        out = self.path(tag + ".i32")
        run("tessel-train", "samples", path, "--split", split, "--count", count, "--out", out)
        return np.fromfile(out, dtype="<i4").reshape(count, seq_len + 1)

    def same(self, mine, theirs, what):
        want = np.stack([np.concatenate([s["tokens"].numpy(), s["labels"].numpy()[-1:]]) for s in theirs])
        self.assertEqual(mine.shape, want.shape, what)
        bad = np.nonzero((mine != want).any(axis=1))[0]
        self.assertEqual(len(bad), 0, f"{what}: samples {bad[:10].tolist()} differ")

    def test_blends_seeds_and_splits(self):
        # Every split of every dataset holds documents (Megatron-Core loops forever on an empty one
        # it is asked samples of; Tessel refuses it, naming the dataset).
        a, b, c = (self.prefix(n, d, k) for n, d, k in (("a", 1500, 1), ("b", 900, 2), ("c", 700, 3)))
        cases = [  # weights, split, seed, seq_len, steps x global_batch
            ([0.3, 0.5, 0.2], "969,30,1", 1234, 32, (25, 8)),
            ([1, 3], "90,8,2", 7, 16, (300, 16)),  # 4,800 samples: b's share runs past one epoch
            ([2, 1, 1], "", 99, 64, (10, 12)),
        ]
        for weights, split, seed, seq_len, (steps, gb) in cases:
            prefixes = [a, b, c][:len(weights)]
            theirs = self.megatron((prefixes, [float(w) for w in weights]), split or "100,0,0", seed, seq_len,
                                   [steps * gb, 1, 1])[0]
            blend = [{"weight": w, "path": p} for w, p in zip(weights, prefixes)]
            mine = self.tessel({"blend": blend, **({"split": split} if split else {})}, seed, seq_len, steps, gb,
                               tag=f"blend{seed}")
            self.same(mine, [theirs[i] for i in range(steps * gb)], f"blend {weights} seed {seed}")

    def test_one_prefix_with_partial_final_epochs_and_its_splits(self):
        a = self.prefix("a", 60, 1)  # about 2,700 tokens: a few epochs of 16-token samples
        regimes = set()
        for steps, gb in ((30, 8), (44, 8), (13, 8)):
            theirs = self.megatron(([a], None), "98,2,0", 5, 16, [steps * gb, 10, None])
            mine = self.tessel({"path": [a], "split": "98,2,0"}, 5, 16, steps, gb, tag=f"one{steps}")
            self.same(mine, [theirs[0][i] for i in range(steps * gb)], f"train, {steps * gb} samples")
            # Which of Megatron-Core's epoch regimes this was: one epoch; a final partial epoch
            # under 80% of one, shuffled on its own; or one joined to the global shuffle.
            per_epoch = int(theirs[0].dataset.sequence_lengths[theirs[0].indices].sum())
            epochs = -(-(steps * gb * 16 + 1) // per_epoch)
            final = steps * gb - ((epochs - 1) * per_epoch - 1) // 16
            regimes.add("one" if epochs == 1 else "apart" if final < int(0.8 * ((per_epoch - 1) // 16)) else "joined")
        self.assertEqual(regimes, {"one", "apart", "joined"})
        # Validation: Megatron-Core's valid GPTDataset sized for one evaluation's rows.
        mine = self.tessel({"path": [a], "split": "90,10,0"}, 5, 16, 4, 5, split="valid", count=20, tag="valid")
        plan_eval_rows = 4 * 5  # training.eval_batches (4 by default) x global_batch
        theirs = self.megatron(([a], None), "90,10,0", 5, 16, [20, plan_eval_rows, None])[1]
        self.same(mine[:plan_eval_rows], [theirs[i] for i in range(plan_eval_rows)], "valid")
        # Test: one epoch of the test documents.
        theirs = self.megatron(([a], None), "80,10,10", 5, 16, [20, 5, None])[2]
        mine = self.tessel({"path": [a], "split": "80,10,10"}, 5, 16, 4, 5, split="test", count=len(theirs),
                           tag="test")
        self.same(mine, [theirs[i] for i in range(len(theirs))], "test")

    def test_unweighted_prefixes_blend_by_size(self):
        a, b = self.prefix("a", 300, 1), self.prefix("b", 150, 2)
        theirs = self.megatron(([a, b], None), "100,0,0", 11, 32, [300, None, None])[0]
        mine = self.tessel({"path": [a, b]}, 11, 32, 30, 10, tag="unweighted")
        self.same(mine, [theirs[i] for i in range(300)], "data.path a b")
        p = run("tessel-train", "samples", write_plan(self.path("big.yaml"), {
            "model": {"arch": "gpt2", "layers": 1, "hidden": 32, "heads": 2, "vocab_size": 1000},
            "training": {"device": "cpu", "steps": 1000, "global_batch": 10, "micro_batch": 10, "seq_len": 32},
            "data": {"format": "megatron", "order": "megatron", "path": [a, b]}}), "--out", self.path("x"),
            check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("never repeated", p.stderr)

    def test_resume_under_another_layout_reads_the_same_samples(self):
        a, b = self.prefix("a", 300, 1), self.prefix("b", 200, 2)

        def plan(out, **parallel):
            return {"run": {"seed": 21, "output_dir": self.path(out)},
                    "model": {"arch": "gpt2", "layers": 2, "hidden": 32, "heads": 2, "vocab_size": 300,
                              "max_seq_len": 16},
                    "parallel": parallel,
                    "training": {"device": "cpu", "steps": 6, "global_batch": 4, "micro_batch": 1, "seq_len": 16,
                                 "threads": 1, "eval_every": 3, "eval_batches": 2},
                    "data": {"format": "megatron", "order": "megatron", "split": "95,5",
                             "blend": [{"weight": 1, "path": a}, {"weight": 2, "path": b}]},
                    "logging": {"every": 1}, "checkpoint": {"every": 3}}
        run("tessel-train", write_plan(self.path("p.yaml"), plan("run")))
        resume_on_two_ranks(self, self.path("run"), self.path("cut"),
                            write_plan(self.path("r.yaml"), plan("cut", dp=2)), 3)
        # Evaluation per dataset (data.split's validation of each) on two data ranks: the
        # uninterrupted run's.
        evals = [[m for m in read_metrics(self.path(r, "metrics.jsonl")) if m.get("step") == 6 and "val_loss" in m]
                 for r in ("run", "cut")]
        (x,), (y,) = evals
        self.assertEqual(sorted(y["val_loss_by_dataset"]), ["data.blend item 1", "data.blend item 2"])
        for key, loss in x["val_loss_by_dataset"].items():
            self.assertLess(abs(loss - y["val_loss_by_dataset"][key]), 1e-5 * loss, (x, y))
        self.assertLess(abs(x["val_loss"] - y["val_loss"]), 1e-5 * x["val_loss"])
        # A new length is a new sample order (Megatron sizes its indices by it): never silent.
        longer = plan("cut")
        longer["training"]["steps"] = 8
        longer["training"]["schedule"] = {"decay": "constant"}
        p = run("tessel-train", write_plan(self.path("l.yaml"), longer), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("data.order megatron sizes its sample indices", p.stderr)


if __name__ == "__main__":
    unittest.main()
