"""Hostile inputs on the data surfaces (issue 61): files that are not regular files, data.split of
any length, vocabulary records out of range, `samples --out` over what it did not make, a blend's
far position, Megatron's --data-path written in data.path, an export of an index that does not
hold the model; and model.init_from's config.json read as a new user expects. Each case ends in exit 2 within seconds, naming the key and the file, and writes
nothing (every case here failed before its fix: a hang, a crash, a silent acceptance or a file
destroyed)."""
import json
import os
import time
import unittest

from plans import TmpDirTest, base_plan, read_metrics, run, write_plan, write_tokens

FAST = 20  # seconds: every refusal comes before any work


class HostileData(TmpDirTest):
    def refused(self, *args, message, timeout=FAST):
        t0 = time.time()
        p = run(*args, check=False, timeout=timeout)
        self.assertEqual(p.returncode, 2, f"{args}: {p.stderr[-2000:]}")
        self.assertIn(message, p.stderr)
        self.assertLess(time.time() - t0, timeout)
        self.assertNotIn("stod", p.stderr)
        return p.stderr

    def plan(self, name="p", **data):
        plan = base_plan(self.tmp, "gpt2", write_tokens(self.path("t.u16"), 3000), steps=2)
        plan["run"]["output_dir"] = self.path(name)
        plan["data"].update(data)
        return write_plan(self.path(name + ".yaml"), plan)

    def megatron(self, name="m"):
        """A byte-token Megatron dataset of 40 documents, with its vocabulary record."""
        with open(self.path("c.jsonl"), "w") as f:
            for i in range(40):
                f.write(json.dumps({"text": f"document {i} says hello to the world again"}) + "\n")
        run("tessel-data", self.path("c.jsonl"), "--out", self.path(name), "--no-progress")
        plan = base_plan(self.tmp, "gpt2", self.path(name), steps=2)
        plan["model"]["vocab_size"] = 257
        plan["data"] = {"format": "megatron", "path": [self.path(name)], "document_mask": True}
        plan["run"]["output_dir"] = self.path("mrun")
        return write_plan(self.path("m.yaml"), plan)

    def test_non_regular_files_are_refused_at_once(self):
        # A FIFO used to block start-up for ever (and defer SIGTERM); a device was mapped as data.
        os.mkfifo(self.path("fifo"))
        for path, kind in ((self.path("fifo"), "is a FIFO (named pipe)"), ("/dev/zero", "is a character device")):
            self.refused("tessel-train", self.plan(), "--set", f"data.path={path}",
                         message=f"data.path: {path} {kind}, not a regular file")
            self.refused("tessel-train", self.plan(),
                         "--set", f"data.blend=[{{weight: 1, path: {self.path('t.u16')}}}, {{weight: 1, path: {path}}}]",
                         "--set", "data.path=[]", message=f"data.blend item 2: {path} {kind}")
        # A megatron prefix's index and its vocabulary record.
        plan = self.megatron()
        for ext in (".idx", ".tessel.json"):
            os.rename(self.path("m" + ext), self.path("m.keep"))
            os.mkfifo(self.path("m" + ext))
            self.refused("tessel-train", plan, message=f"data.path: {self.path('m' + ext)} is a FIFO")
            os.remove(self.path("m" + ext))
            os.rename(self.path("m.keep"), self.path("m" + ext))
        self.assertFalse(os.path.exists(self.path("mrun", "metrics.jsonl")))

    def test_data_split_of_any_length(self):
        # 100,000 digits crashed (a recursive regex), in --dry-run too; 400 gave "error: stod".
        for digits in (400, 20000, 100000):
            for extra in ([], ["--dry-run"]):
                self.refused("tessel-train", self.plan(), "--set", "data.split=" + "9" * digits, *extra,
                             message=f"data.split '{'9' * 40}... ({digits} characters)' does not parse: "
                                     f"a share of {digits} characters (at most 32)")
        # ",," used to be read as no split at all.
        self.refused("tessel-train", self.plan(), "--set", "data.split=,,", "--dry-run",
                     message="data.split ',,' does not parse: an empty share")
        self.refused("tessel-train", self.plan(), "--set", "data.split=1,,2", "--dry-run",
                     message="an empty share")
        # A split that leaves training no sample names data.split.
        self.refused("tessel-train", self.plan(), "--set", "data.split=1,100000",
                     message="hold 0 training tokens under data.split 1,100000 (its first share is training's)")

    def test_vocabulary_records_are_validated(self):
        # eod 300 >= vocab_size was taken: "document mask after id 300", and no mask at all.
        plan = self.megatron()
        with open(self.path("m.tessel.json")) as f:
            good = json.load(f)
        for field, value, why in (("eod", 300, "field eod is 300: an id of the vocabulary, in [0, vocab_size 257)"),
                                  ("eod", -1, "field eod is -1"),
                                  ("eod", 2.5, "field eod is 2.5, not an integer"),
                                  ("eod", "7", "field eod is \"7\", not an integer"),
                                  ("vocab_size", 0, "field vocab_size is 0: it must be positive"),
                                  ("vocab_size", 1.5e9, "field vocab_size is 1500000000.0, not an integer")):
            with open(self.path("m.tessel.json"), "w") as f:
                json.dump(dict(good, **{field: value}), f)
            self.refused("tessel-train", plan, message=f"data.path: {self.path('m.tessel.json')}: not a vocabulary "
                                                       f"record tessel-data wrote ({why}")
        self.assertFalse(os.path.exists(self.path("mrun", "metrics.jsonl")))

    def test_samples_out_never_destroys_what_it_did_not_make(self):
        # It used to rename its output over the plan's own input (exit 0) and over device nodes.
        plan = self.plan()
        with open(plan) as f:
            plan_text = f.read()
        with open(self.path("t.u16"), "rb") as f:
            data = f.read()
        with open(self.path("mine.i32"), "w") as f:
            f.write("keep")
        os.mkfifo(self.path("fifo"))
        os.mkdir(self.path("folder"))
        cases = [([self.path("mine.i32")], "exists: give another path, or --force to replace it"),
                 ([plan, "--force"], "is the plan file: write the samples elsewhere"),
                 ([self.path("t.u16"), "--force"], "is one of the plan's inputs"),
                 ([self.path("fifo"), "--force"], "not a file to write"),
                 (["/dev/null", "--force"], "not a file to write"),
                 ([self.path("folder"), "--force"], "is a folder, not a file to write")]
        for (out, *extra), message in cases:
            self.refused("tessel-train", "samples", plan, "--count", 2, "--out", out, *extra,
                         message=f"samples --out: {out} {message}" if "exists" in message or "folder" in message
                         or "plan file" in message else message)
        with open(plan) as f:
            self.assertEqual(f.read(), plan_text)
        with open(self.path("t.u16"), "rb") as f:
            self.assertEqual(f.read(), data)
        with open(self.path("mine.i32")) as f:
            self.assertEqual(f.read(), "keep")
        # --force replaces a file of one's own; a failure on the way leaves nothing beside it.
        run("tessel-train", "samples", plan, "--count", 2, "--out", self.path("mine.i32"), "--force")
        self.assertEqual(os.path.getsize(self.path("mine.i32")), 2 * 17 * 4)
        self.refused("tessel-train", "samples", plan, "--count", 2, "--out", self.path("bad.i32"),
                     "--set", "model.vocab_size=100", message="is outside model.vocab_size 100")
        self.assertEqual([f for f in os.listdir(self.tmp) if f.startswith("bad.i32")], [])

    def test_a_blends_far_position_is_refused_not_walked(self):
        # --skip 2^53 on a blend used to walk Megatron's rule sample by sample, for ever.
        blend = [{"weight": 1, "path": self.path("t.u16")}, {"weight": 2, "path": self.path("t.u16")}]
        plan = self.plan(path=[], blend=blend)
        self.refused("tessel-train", "samples", plan, "--skip", 2 ** 53, "--out", self.path("s.i32"),
                     message="the plan's run reads training.steps 2 x training.global_batch 4 = 8 samples of its "
                             "blend, and samples looks at most 134217728 ahead")
        self.refused("tessel-train", "samples", plan, "--skip", 2 ** 27, "--out", self.path("s.i32"),
                     message="looks at most 134217728 ahead")
        run("tessel-train", "samples", plan, "--skip", 6, "--count", 2, "--out", self.path("s.i32"))
        self.assertFalse(os.path.exists(self.path("p")), "samples trained or wrote a run folder")

    def test_a_short_megatron_blend_with_a_document_mask_trains(self):
        # steps x global_batch = 8 < 256: the planner's document figures read 256 samples and
        # stopped the run before step 1 ("training sample 8: ... holds 8 training samples").
        plan_path = self.megatron()
        run("tessel-data", self.path("c.jsonl"), "--out", self.path("m2"), "--no-progress")
        with open(plan_path) as f:
            plan = json.load(f)
        plan["data"] = {"format": "megatron", "order": "megatron", "document_mask": True,
                        "blend": [{"weight": 1, "path": self.path("m")}, {"weight": 2, "path": self.path("m2")}]}
        p = run("tessel-train", write_plan(self.path("mb.yaml"), plan), check=False, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("# document mask", run("tessel-train", self.path("mb.yaml"), "--dry-run").stdout)

    def test_sizes_past_memory_and_weights_past_the_largest_number(self):
        # Megatron order's indices for 10^9 x 4096 samples were allocated (std::bad_alloc); blend
        # weights 1e308 + 1e308 summed to inf and every share read 0.
        plan = self.megatron()
        for extra in ([], ["--dry-run"]):
            self.refused("tessel-train", plan, "--set", "data.order=megatron", "--set", "training.steps=1000000000",
                         "--set", "training.global_batch=4096", "--set", "data.document_mask=false", *extra,
                         message="data.order megatron builds its sample indices for training.steps 1000000000 x "
                                 "training.global_batch 4096 = 4096000000000 samples: 91552.7 GiB at 24 bytes")
        blend = [{"weight": 1e308, "path": self.path("t.u16")}, {"weight": 1e308, "path": self.path("t.u16")}]
        self.refused("tessel-train", self.plan(path=[], blend=blend), "--dry-run",
                     message="the weights sum to inf (past the largest number)")

    def test_megatron_data_path_weights_get_a_hint(self):
        path = self.path("t.u16")
        self.refused("tessel-train", self.plan(), "--set", f"data.path=0.3 {path} 0.7 {path}", "--dry-run",
                     message=f"reads as Megatron's --data-path (weights between prefixes); Tessel names weighted "
                             f"datasets in data.blend: blend: [{{weight: 0.3, path: {path}}}, "
                             f"{{weight: 0.7, path: {path}}}]")

    def test_export_of_an_index_without_the_model(self):
        # An index with no tensors ended in "map::at"; a shape of 2^48 elements was allocated.
        plan = self.plan(name="run")
        run("tessel-train", plan)
        step = self.path("run", "checkpoints", "step_2")
        with open(os.path.join(step, "index.json")) as f:
            index = json.load(f)
        for tensors, message in (({}, "embed.weight (missing)"),
                                 (dict(index["tensors"], **{"layers.0.attn.k.bias": dict(
                                     index["tensors"]["layers.0.attn.k.bias"], shape=[2 ** 48])}),
                                  "layers.0.attn.k.bias is [281474976710656], the model's has 32 elements")):
            with open(os.path.join(step, "index.json"), "w") as f:
                json.dump(dict(index, tensors=tensors), f)
            self.refused("tessel-train", "export", step, "--format", "hf", "--out", self.path("hf"),
                         message=f"the index does not hold the model its config.yaml describes")
            self.refused("tessel-train", "export", step, "--format", "hf", "--out", self.path("hf"), message=message)
            self.assertFalse(os.path.exists(self.path("hf", "model.safetensors")))


class InitFromConfig(TmpDirTest):
    """model.init_from's config.json: the architecture where the plan gives none, and a plan value
    that contradicts it refused (rope_theta 500000 used to train silently on weights made for
    another base, and the whole architecture had to be retyped)."""

    def test_the_architecture_comes_from_config_json(self):
        data = write_tokens(self.path("t.u16"), 3000)
        full = base_plan(self.tmp, "llama", data, steps=2)
        full["run"]["output_dir"] = self.path("src")
        run("tessel-train", write_plan(self.path("src.yaml"), full))
        run("tessel-train", "export", self.path("src", "checkpoints"), "--format", "hf", "--out", self.path("hf"))
        # The full plan, and a plan with no architecture at all: the same run, loss for loss.
        full["model"]["init_from"] = self.path("hf")
        full["run"]["output_dir"] = self.path("full")
        run("tessel-train", write_plan(self.path("full.yaml"), full))
        bare = json.loads(json.dumps(full))
        bare["model"] = {"init_from": self.path("hf")}
        bare["run"]["output_dir"] = self.path("bare")
        p = run("tessel-train", write_plan(self.path("bare.yaml"), bare))
        self.assertIn(f"model: from {self.path('hf', 'config.json')}: model.arch=llama, model.hidden=32, "
                      f"model.kv_heads=2, model.ffn_hidden=80", p.stdout)
        self.assertIn("model.rope_theta=5000.0", p.stdout)
        losses = {n: [m["loss"] for m in read_metrics(self.path(n, "metrics.jsonl")) if "loss" in m]
                  for n in ("full", "bare")}
        self.assertEqual(len(losses["full"]), 2)
        self.assertEqual(losses["bare"], losses["full"])
        # A contradiction names both values; model.init_from_accept lets the plan's stand.
        wrong = json.loads(json.dumps(bare))
        wrong["model"]["rope_theta"] = 500000
        wrong["run"]["output_dir"] = self.path("wrong")
        path = write_plan(self.path("wrong.yaml"), wrong)
        for extra in ([], ["--dry-run"]):
            p = run("tessel-train", path, *extra, check=False, timeout=FAST)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(f"model.init_from {self.path('hf')}: the weights were made for the model "
                          f"{self.path('hf', 'config.json')} describes, and the plan contradicts it: "
                          f"model.rope_theta is 500000.0 ({path}:", p.stderr)
            self.assertIn("config.json's is 5000", p.stderr)
        self.assertFalse(os.path.exists(self.path("wrong", "metrics.jsonl")))
        p = run("tessel-train", path, "--set", "model.init_from_accept=[model.rope_theta]", "--set",
                "training.steps=1")
        self.assertEqual(p.returncode, 0, p.stderr)


if __name__ == "__main__":
    unittest.main()
