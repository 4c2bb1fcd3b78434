"""Tessel's gpt2 and llama (with GQA) against transformers' GPT2LMHeadModel / LlamaForCausalLM on
the same weights, both ways: HF-written weights read by Tessel, and Tessel's export read by HF."""
import json
import os
import sys
import unittest

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common import (TmpDirTest, base_plan, hf_loss, hf_model, random_rows, read_metrics, rel, run, write_plan,
                    write_rows, write_tokens)

TOL = 1e-5


def score(plan_path, weights, tokens):
    out = run("tessel-train", "score", plan_path, "--weights", weights, "--tokens", tokens).stdout
    return json.loads(out.strip().splitlines()[-1])


class HfParity(TmpDirTest):
    def plan(self, arch, data, tied=False, mlp=None, **training):
        plan = base_plan(self.tmp, arch, data, **training)
        if tied:
            plan["model"]["tie_embeddings"] = "true"
        if mlp:
            plan["model"]["mlp"] = mlp
        return write_plan(self.path("plan.yaml"), plan)

    def check_hf_to_tessel(self, arch, tied=False, mlp=None):
        model = hf_model(arch, tied=tied, **({"activation": mlp} if mlp else {}))
        model.save_pretrained(self.path("hf"), safe_serialization=True)
        rows = random_rows(6)
        write_rows(self.path("rows.bin"), rows)
        data = write_tokens(self.path("data.u16"), 2000)
        plan = self.plan(arch, data, tied, mlp)
        got = score(plan, self.path("hf", "model.safetensors"), self.path("rows.bin"))
        want = hf_loss(model, rows)
        self.assertEqual(got["tokens"], 6 * 16)
        self.assertLess(rel(got["loss"], want), TOL, f"{arch}: tessel {got['loss']} vs transformers {want}")
        print(f"\n{arch} HF->Tessel: loss {want:.6f}, relative difference {rel(got['loss'], want):.2e}", file=sys.stderr)
        return got["loss"]

    def check_tessel_to_hf(self, arch, tied=False, mlp=None):
        # Tessel trains from its own seeded init, exports Hugging Face files, transformers reads them.
        data = write_tokens(self.path("data.u16"), 2000)
        plan = self.plan(arch, data, tied, mlp, steps=2)
        run("tessel-train", plan)
        ckpt = self.path("run", "checkpoints")
        run("tessel-train", "export", ckpt, "--format", "hf", "--out", self.path("export"))
        model = AutoModelForCausalLM.from_pretrained(self.path("export"), attn_implementation="eager").float().eval()
        rows = random_rows(5, seed=3)
        write_rows(self.path("rows.bin"), rows)
        got = score(plan, self.path("run", "checkpoints", "step_2", "rank_00000.safetensors"), self.path("rows.bin"))
        want = hf_loss(model, rows)
        self.assertLess(rel(got["loss"], want), TOL, f"{arch}: tessel {got['loss']} vs transformers {want}")
        print(f"\n{arch} Tessel->HF: loss {want:.6f}, relative difference {rel(got['loss'], want):.2e}", file=sys.stderr)
        # The export holds exactly the HF names a save_pretrained of this model holds.
        exported = load_file(self.path("export", "model.safetensors"))
        model.save_pretrained(self.path("resaved"), safe_serialization=True)
        self.assertEqual(set(exported), set(load_file(self.path("resaved", "model.safetensors"))))

    def test_gpt2_hf_weights(self):
        loss = self.check_hf_to_tessel("gpt2")
        self.assertGreater(loss, 1.0)  # random weights: a real, non-trivial loss

    def test_llama_gqa_hf_weights(self):
        self.check_hf_to_tessel("llama")

    def test_gpt2_export(self):
        self.check_tessel_to_hf("gpt2")

    def test_llama_gqa_export(self):
        self.check_tessel_to_hf("llama")

    def test_llama_tied_embeddings_both_ways(self):
        # Llama-3.2 1B/3B tie the head to the embedding: read from and exported to transformers.
        self.check_hf_to_tessel("llama", tied=True)
        self.check_tessel_to_hf("llama", tied=True)
        self.assertTrue(AutoModelForCausalLM.from_pretrained(self.path("export")).config.tie_word_embeddings)

    def test_gpt2_squared_relu_both_ways(self):
        # model.mlp relu2, down(ReLU(up x)^2): GPT2LMHeadModel holds it as activation_function relu2
        # (transformers' ReLUSquaredActivation). Its weights read by Tessel, Tessel's export read by
        # transformers, and a plan made from the export's config.json names the form.
        self.check_hf_to_tessel("gpt2", mlp="relu2")
        self.check_tessel_to_hf("gpt2", mlp="relu2")
        model = AutoModelForCausalLM.from_pretrained(self.path("export"), attn_implementation="eager").float().eval()
        self.assertEqual(model.config.activation_function, "relu2")
        want = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)[0, 3:].tolist()
        p = run("tessel-train", "generate", "--weights", self.path("export"), "--prompt-ids", "1,2,3",
                "--max-new-tokens", "6", "--json")  # no plan: the model from config.json
        self.assertEqual(json.loads(p.stdout)["ids"], want)

    def test_a_form_without_a_hugging_face_class_is_refused(self):
        # Llama's MLP is always gated, GPT-2's never: llama with gelu_tanh cannot be exported, asked for
        # at the start (checkpoint.export_hf) or at `export`; a config.json activation Tessel does not
        # build is refused rather than trained as another.
        data = write_tokens(self.path("data.u16"), 2000)
        plan = base_plan(self.tmp, "llama", data, steps=1)
        plan["model"]["mlp"] = "gelu_tanh"
        plan["checkpoint"] = {"export_hf": self.path("hf")}
        bad = run("tessel-train", write_plan(self.path("plan.yaml"), plan), check=False)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn(f"checkpoint.export_hf {self.path('hf')}: model.mlp gelu_tanh has no Hugging Face llama "
                      "form (its MLP is swiglu only)", bad.stderr)
        self.assertFalse(os.path.exists(self.path("run", "metrics.jsonl")))
        del plan["checkpoint"]
        run("tessel-train", write_plan(self.path("plan.yaml"), plan))
        bad = run("tessel-train", "export", self.path("run", "checkpoints"), "--out", self.path("hf"), check=False)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn("export to Hugging Face: model.mlp gelu_tanh has no Hugging Face llama form", bad.stderr)
        self.assertFalse(os.path.exists(self.path("hf", "model.safetensors")))
        model = hf_model("gpt2", activation="relu")
        model.save_pretrained(self.path("relu"), safe_serialization=True)
        bad = run("tessel-train", "generate", "--weights", self.path("relu"), "--prompt-ids", "1", check=False)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn(f"{self.path('relu', 'config.json')}: activation_function \"relu\" is not an MLP "
                      "Tessel's gpt2 builds (gelu_new, relu2)", bad.stderr)

    def test_sharded_folders(self):
        # As released models ship: save_pretrained above max_shard_size writes shards and
        # model.safetensors.index.json; Tessel maps the shards and reads the same weights as from
        # one file (the same loss, bitwise), for both architectures.
        rows = random_rows(4, seed=5)
        write_rows(self.path("rows.bin"), rows)
        data = write_tokens(self.path("data.u16"), 2000)
        for arch in ("gpt2", "llama"):
            model = hf_model(arch)
            model.save_pretrained(self.path(arch, "one"), safe_serialization=True)
            model.save_pretrained(self.path(arch, "shards"), safe_serialization=True, max_shard_size="20KB")
            shards = [f for f in os.listdir(self.path(arch, "shards")) if f.endswith(".safetensors")]
            self.assertGreater(len(shards), 2, shards)
            self.assertTrue(os.path.exists(self.path(arch, "shards", "model.safetensors.index.json")))
            plan = self.plan(arch, data)
            one = score(plan, self.path(arch, "one"), self.path("rows.bin"))
            sharded = score(plan, self.path(arch, "shards"), self.path("rows.bin"))
            self.assertEqual(sharded["loss"], one["loss"], arch)
            self.assertLess(rel(sharded["loss"], hf_loss(model, rows)), TOL, arch)

    def test_sharded_export(self):
        # export above --max-shard-size writes save_pretrained's shards and index: transformers
        # and Tessel read them back; a later export into the folder replaces them whole.
        data = write_tokens(self.path("data.u16"), 2000)
        plan = self.plan("llama", data, steps=2)
        run("tessel-train", plan)
        ckpt = self.path("run", "checkpoints")
        run("tessel-train", "export", ckpt, "--out", self.path("export"), "--max-shard-size", "20KB")
        files = sorted(os.listdir(self.path("export")))
        shards = [f for f in files if f.startswith("model-")]
        self.assertGreater(len(shards), 2, files)
        self.assertIn("model.safetensors.index.json", files)
        self.assertNotIn("model.safetensors", files)
        model = AutoModelForCausalLM.from_pretrained(self.path("export"), attn_implementation="eager").float().eval()
        rows = random_rows(3, seed=4)
        write_rows(self.path("rows.bin"), rows)
        got = score(plan, self.path("export"), self.path("rows.bin"))
        want = score(plan, self.path("run", "checkpoints", "step_2", "rank_00000.safetensors"), self.path("rows.bin"))
        self.assertEqual(got["loss"], want["loss"])
        self.assertLess(rel(got["loss"], hf_loss(model, rows)), TOL)
        run("tessel-train", "export", ckpt, "--out", self.path("export"))  # default 5GB: one file
        self.assertEqual(sorted(os.listdir(self.path("export"))), ["config.json", "model.safetensors"])
        bad = run("tessel-train", "export", ckpt, "--out", self.path("export"), "--max-shard-size", "5XB",
                  check=False)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn("export --max-shard-size: '5XB' is not a shard size", bad.stderr)

    def test_hub_style_gpt2_names(self):
        # The hub's gpt2 files have no "transformer." prefix and carry attn.bias buffers.
        model = hf_model("gpt2")
        sd = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items()
              if k != "lm_head.weight"}
        for i in range(2):
            sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        from safetensors.torch import save_file
        save_file(sd, self.path("hub.safetensors"))
        rows = random_rows(2)
        write_rows(self.path("rows.bin"), rows)
        data = write_tokens(self.path("data.u16"), 2000)
        plan = write_plan(self.path("plan.yaml"), base_plan(self.tmp, "gpt2", data))
        got = score(plan, self.path("hub.safetensors"), self.path("rows.bin"))
        self.assertLess(rel(got["loss"], hf_loss(model, rows)), TOL)

    def test_wrong_weights_are_named(self):
        model = hf_model("llama")
        model.save_pretrained(self.path("hf"), safe_serialization=True)
        rows = random_rows(1)
        write_rows(self.path("rows.bin"), rows)
        data = write_tokens(self.path("data.u16"), 2000)
        plan_dict = base_plan(self.tmp, "llama", data)
        plan_dict["model"]["hidden"] = 64
        plan = write_plan(self.path("plan.yaml"), plan_dict)
        p = run("tessel-train", "score", plan, "--weights", self.path("hf", "model.safetensors"), "--tokens",
                self.path("rows.bin"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("model.safetensors: tensor 'embed.weight' has shape [300, 32] but the plan's model needs [300, 64]",
                      p.stderr)


if __name__ == "__main__":
    unittest.main()
