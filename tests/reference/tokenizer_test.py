"""Real data end to end: a JSONL corpus tokenized with a Hugging Face tokenizer.json by tessel-data,
trained, exported with its tokenizer, loaded by transformers, and generated from by both."""
import json
import os
import random
import struct

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common import TmpDirTest, read_metrics, run, write_plan

WORDS = ("the quick brown fox jumps over a lazy dog while tessel trains small models on many ranks "
         "with data tensor pipeline and context parallel layouts").split()


def corpus(n, seed=0):
    rng = random.Random(seed)
    # Docs follow a few fixed phrases, so a small model learns them and its greedy choices are clear.
    phrases = [" ".join(WORDS[i:i + 6]) for i in range(0, len(WORDS) - 6, 3)]
    return [". ".join(rng.choice(phrases) for _ in range(rng.randint(3, 30))) + "." for _ in range(n)]


def bpe_tokenizer(path, docs, vocab=300):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return tok


def read_idx(prefix):
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    magic, version, code, n_seq, n_doc = head[:9], *struct.unpack("<QBQQ", head[9:34])
    assert magic == b"MMIDIDX\x00\x00", magic
    return code, n_seq


class Tokenize(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.docs = corpus(300)
        with open(self.path("corpus.jsonl"), "w") as f:
            for i, d in enumerate(self.docs):
                f.write(json.dumps({"id": i, "text": d}) + "\n")
                if i == 5:
                    f.write("\n")  # blank lines are skipped
        self.tok = bpe_tokenizer(self.path("tokenizer.json"), self.docs)

    def test_jsonl_equals_tokenizers_and_workers_do_not_change_it(self):
        ref = []
        for d in self.docs:
            ref += self.tok.encode(d).ids + [self.tok.token_to_id("<|endoftext|>")]
        outs = []
        for workers in (1, 2):
            p = run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("tokenizer.json"),
                    "--out", self.path(f"w{workers}"), "--workers", workers)
            self.assertIn("300 documents", p.stdout)
            with open(self.path(f"w{workers}.bin"), "rb") as f:
                outs.append(f.read())
            self.assertEqual(read_idx(self.path(f"w{workers}")), (8, 300))  # uint16, one sequence per doc
        self.assertEqual(outs[0], outs[1])
        got = np.frombuffer(outs[0], dtype=np.uint16)
        self.assertEqual(got.tolist(), ref)

    def test_large_vocabulary_is_32_bit(self):
        vocab = {f"w{i}": i for i in range(70000)}
        vocab["[UNK]"] = 70000
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.add_special_tokens(["</s>"])
        tok.save(self.path("big.json"))
        with open(self.path("big.txt"), "w") as f:
            f.write("w1 w69999 w65536 nothing w7")
        run("tessel-data", self.path("big.txt"), "--tokenizer", self.path("big.json"), "--out", self.path("big"))
        self.assertEqual(read_idx(self.path("big")), (4, 1))  # int32, as Megatron writes large vocabularies
        got = np.fromfile(self.path("big.bin"), dtype=np.int32).tolist()
        self.assertEqual(got, [1, 69999, 65536, 70000, 7, 70001])

    def test_vocabulary_record_refuses_a_mixed_blend_and_gives_the_eod(self):
        """tessel-data records each dataset's tokenizer and end-of-document id (PREFIX.tessel.json):
        a blend of two tokenizers' datasets is refused before any work naming the item, and
        data.document_mask needs no data.eod_token."""
        run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("tokenizer.json"),
            "--out", self.path("w"))
        with open(self.path("w.tessel.json")) as f:
            rec = json.load(f)
        eod = self.tok.token_to_id("<|endoftext|>")
        self.assertEqual((rec["eod"], rec["eod_token"], rec["vocab_size"]),
                         (eod, "<|endoftext|>", self.tok.get_vocab_size()))
        other = bpe_tokenizer(self.path("other.json"), corpus(50, seed=9), vocab=280)
        self.assertNotEqual(other.get_vocab(), self.tok.get_vocab())
        run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("other.json"),
            "--out", self.path("o"))
        plan = {"run": {"seed": 5, "output_dir": self.path("run")},
                "model": {"arch": "llama", "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 2,
                          "vocab_size": 300, "max_seq_len": 64},
                "training": {"device": "cpu", "steps": 2, "global_batch": 2, "micro_batch": 1, "seq_len": 64,
                             "threads": 1},
                "data": {"format": "megatron", "blend": [{"weight": 1, "path": [self.path("w")]},
                                                         {"weight": 1, "path": [self.path("o")]}]},
                "logging": {"every": 1}}
        p = run("tessel-train", write_plan(self.path("mixed.yaml"), plan), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"data.blend item 2 ({self.path('o')}) was tokenized by tokenizer "
                      f"{self.path('other.json')} [", p.stderr)
        self.assertFalse(os.path.exists(self.path("run", "metrics.jsonl")))
        plan["data"] = {"format": "megatron", "path": [self.path("w")], "document_mask": True}
        p = run("tessel-train", write_plan(self.path("masked.yaml"), plan))
        self.assertIn(f"| document mask after id {eod}", p.stderr + p.stdout)

    def test_bad_input_names_file_and_line(self):
        with open(self.path("bad.jsonl"), "w") as f:
            f.write('{"text": "fine"}\n{"body": "no text key"}\n')
        p = run("tessel-data", self.path("bad.jsonl"), "--tokenizer", self.path("tokenizer.json"),
                "--out", self.path("bad"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn('bad.jsonl:2: no field "text" (--text-key names the field); this line\'s fields: body',
                      p.stderr)
        # A "text" that is there but not a string says so (it used to read "keys here: text").
        with open(self.path("bad.jsonl"), "w") as f:
            f.write('{"text": 5}\n')
        p = run("tessel-data", self.path("bad.jsonl"), "--tokenizer", self.path("tokenizer.json"),
                "--out", self.path("bad"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn('bad.jsonl:1: field "text" is a number, not a string', p.stderr)
        self.assertFalse(os.path.exists(self.path("bad.bin")) or os.path.exists(self.path("bad.idx")))
        with open(self.path("bad.jsonl"), "w") as f:
            f.write('{"text": "fine"}\n{"text": broken\n')
        p = run("tessel-data", self.path("bad.jsonl"), "--out", self.path("bad"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("bad.jsonl:2: not a JSON object", p.stderr)
        p = run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("tokenizer.json"),
                "--eod", "<nope>", "--out", self.path("bad"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--eod '<nope>' is not a token", p.stderr)
        # An output folder that does not exist: an error, not an abort with threads running.
        p = run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("tokenizer.json"),
                "--out", self.path("no", "such", "dir", "ds"), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("cannot create", p.stderr)
        # Overlong UTF-8 (modified UTF-8's NUL) is refused by tessel-data, naming the file, before
        # the tokenizer's strict decoder sees it.
        with open(self.path("a.txt"), "w") as f:
            f.write("fine text")
        with open(self.path("b.txt"), "wb") as f:
            f.write(b"ab\xc0\x80cd")
        p = run("tessel-data", self.path("a.txt"), self.path("b.txt"), "--tokenizer", self.path("tokenizer.json"),
                "--out", self.path("bad"), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("b.txt: not UTF-8 (invalid byte at offset 2)", p.stderr)
        self.assertFalse(os.path.exists(self.path("bad.bin")) or os.path.exists(self.path("bad.idx")))

    def test_train_export_transformers_generate_llama(self):
        self.end_to_end("llama")

    def test_train_export_transformers_generate_gpt2(self):
        self.end_to_end("gpt2")

    def end_to_end(self, arch):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        run("tessel-data", self.path("corpus.jsonl"), "--tokenizer", self.path("tokenizer.json"),
            "--out", self.path("ds"))
        shape = {"kv_heads": 2} if arch == "llama" else {}
        plan = {"run": {"seed": 5, "output_dir": self.path("run")},
                "model": {"arch": arch, "layers": 2, "hidden": 64, "heads": 4, **shape,
                          "vocab_size": 300, "max_seq_len": 128},
                "training": {"device": "cpu", "steps": 60, "global_batch": 8, "micro_batch": 4, "seq_len": 64,
                             "threads": 2, "optimizer": {"lr": 0.01}, "schedule": {"warmup_steps": 5}},
                "data": {"format": "megatron", "path": [self.path("ds")], "val_fraction": 0.05},
                "checkpoint": {"every": 60},
                "logging": {"every": 10}}
        cfg = write_plan(self.path("plan.yaml"), plan)
        run("tessel-train", cfg)
        losses = [m["loss"] for m in read_metrics(self.path("run", "metrics.jsonl")) if "loss" in m]
        self.assertLess(losses[-1], 0.5 * losses[0], losses)  # it learned the phrases
        run("tessel-train", "export", self.path("run", "checkpoints"), "--format", "hf", "--out", self.path("hf"),
            "--tokenizer", self.path("tokenizer.json"))
        eos = self.tok.token_to_id("<|endoftext|>")
        with open(self.path("hf", "config.json")) as f:
            self.assertEqual(json.load(f)["eos_token_id"], eos)
        model = AutoModelForCausalLM.from_pretrained(self.path("hf")).eval()
        hf_tok = AutoTokenizer.from_pretrained(self.path("hf"))
        self.assertEqual(hf_tok.eos_token_id, eos)
        # The usual call works on the exported folder: no token_type_ids reach the model (the
        # tokenizer config names its inputs; generate used to fail on the unexpected argument).
        enc = hf_tok("the quick brown", return_tensors="pt")
        self.assertNotIn("token_type_ids", enc)
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=2, do_sample=False, pad_token_id=eos)
        for prompt in ("the quick brown", "tessel trains small", "data tensor"):
            ids = hf_tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=eos)[0, ids.shape[1]:]
            p = run("tessel-train", "generate", cfg, "--weights", self.path("hf", "model.safetensors"),
                    "--prompt", prompt, "--max-new-tokens", 24, "--json")
            out = json.loads(p.stdout.strip().splitlines()[-1])
            self.assertEqual(out["prompt_ids"], ids[0].tolist())
            self.assertEqual(out["ids"], ref.tolist(), prompt)
            self.assertEqual(out["text"], hf_tok.decode(ref))
            print(f"\n{prompt!r} -> {out['text']!r}")
        # Sampling: top-k 1 is greedy; a seed makes a sampled continuation repeatable.
        args = ["tessel-train", "generate", cfg, "--weights", self.path("hf", "model.safetensors"), "--prompt",
                "the quick", "--max-new-tokens", 12, "--json", "--no-stop"]
        greedy = json.loads(run(*args).stdout.splitlines()[-1])["ids"]
        top1 = json.loads(run(*args, "--temperature", 0.7, "--top-k", 1).stdout.splitlines()[-1])["ids"]
        self.assertEqual(top1, greedy)
        a, b = (json.loads(run(*args, "--temperature", 2.0, "--seed", 7).stdout.splitlines()[-1])["ids"]
                for _ in range(2))
        self.assertEqual(a, b)
        # And sampling changes what comes out (a sampler that ignored its options would pass the
        # lines above): seeds differ; every token drawn under --top-k 3 is among the model's three
        # most likely at its position (transformers' logits), and without it some are not; a tiny
        # temperature is greedy.
        def sample(*extra):
            return json.loads(run(*args, *extra).stdout.splitlines()[-1])["ids"]

        prompt_ids = hf_tok("the quick", return_tensors="pt").input_ids[0].tolist()

        def ranks(seq):  # how many tokens the model ranks above each drawn one
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + seq])).logits[0, len(prompt_ids) - 1:-1]
            return [int((logits[i] > logits[i, t]).sum()) for i, t in enumerate(seq)]

        hot = [sample("--temperature", 3.0, "--seed", s) for s in (1, 2, 3, 4)]
        self.assertEqual(len({tuple(h) for h in hot}), 4, hot)
        self.assertGreater(max(max(ranks(h)) for h in hot), 2, hot)
        top3 = [sample("--temperature", 3.0, "--top-k", 3, "--seed", s) for s in (1, 2, 3, 4)]
        self.assertLessEqual(max(max(ranks(h)) for h in top3), 2, top3)
        self.assertGreater(len({tuple(h) for h in top3}), 1, top3)
        self.assertEqual(sample("--temperature", 0.01, "--seed", 5), greedy)
        # score on the dataset equals transformers' loss on the same windows.
        p = run("tessel-train", "score", cfg, "--weights", self.path("hf", "model.safetensors"),
                "--data", self.path("ds"), "--max-rows", 6)
        got = json.loads(p.stdout.strip().splitlines()[-1])
        stream = np.fromfile(self.path("ds.bin"), dtype=np.uint16).astype(np.int64)
        rows = torch.from_numpy(np.stack([stream[i * 64:i * 64 + 65] for i in range(6)]))
        with torch.no_grad():
            logits = model(rows[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
        self.assertEqual(got["tokens"], 6 * 64)
        self.assertLess(abs(got["loss"] - ref) / ref, 1e-5, (got, ref))
        self.assertAlmostEqual(got["perplexity"], float(np.exp(got["loss"])), places=6)
        # score on text: tokenized with the tokenizer (document + eos), as transformers sees it.
        with open(self.path("doc.txt"), "w") as f:
            f.write(self.docs[7] + " " + self.docs[8])
        p = run("tessel-train", "score", cfg, "--weights", self.path("hf", "model.safetensors"),
                "--data", self.path("doc.txt"), "--tokenizer", self.path("tokenizer.json"))
        got = json.loads(p.stdout.strip().splitlines()[-1])
        ids = self.tok.encode(self.docs[7] + " " + self.docs[8]).ids + [eos]
        n = (len(ids) - 1) // 64
        rows = torch.tensor([ids[i * 64:i * 64 + 65] for i in range(n)])
        with torch.no_grad():
            logits = model(rows[:, :-1]).logits
        ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
        self.assertEqual(got["rows"], n)
        self.assertLess(abs(got["loss"] - ref) / ref, 1e-5, (got, ref))
