"""Tessel's mixture of experts against transformers' MixtralForCausalLM and Qwen3MoeForCausalLM on
the same weights, both ways: logits within 1e-5 for Hugging Face-written weights read by Tessel,
and for Tessel's export (after training steps) read by transformers."""
import json
import sys
import unittest

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common import TmpDirTest, base_plan, random_rows, run, write_plan, write_rows, write_tokens

TOL = 1e-5
COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=5000.0, num_experts_per_tok=2,
              tie_word_embeddings=False, attn_implementation="eager")


def hf_moe(kind, seed=0):
    """A small random Mixtral (every layer MoE) or Qwen3-MoE (per-head q/k norms, MoE every second
    layer, the dense one wider, gate weights renormalised over the top 2)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=80, moe_intermediate_size=24, num_experts=8,
                                                   decoder_sparse_step=2, norm_topk_prob=True, head_dim=8, **COMMON))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.float().eval()


def plan_model(kind):
    m = {"arch": "llama", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab_size": 300,
         "max_seq_len": 64, "norm_eps": 1e-6, "rope_theta": 5000.0}
    if kind == "mixtral":
        return {**m, "ffn_hidden": 48, "moe": {"experts": 4, "top_k": 2, "ffn_hidden": 48}}
    return {**m, "ffn_hidden": 80, "qk_norm": True,
            "moe": {"experts": 8, "top_k": 2, "ffn_hidden": 24, "every": 2, "router": {"norm_topk": True}}}


def hf_logits(model, rows):
    with torch.no_grad():
        return model(input_ids=rows[:, :-1]).logits.float()


class MoeHfParity(TmpDirTest):
    def plan(self, kind, **training):
        data = write_tokens(self.path("data.u16"), 3000)
        plan = base_plan(self.tmp, "llama", data, **training)
        plan["model"] = plan_model(kind)
        return write_plan(self.path("plan.yaml"), plan)

    def tessel_logits(self, plan, weights, rows):
        write_rows(self.path("rows.bin"), rows)
        out = run("tessel-train", "score", plan, "--weights", weights, "--tokens", self.path("rows.bin"),
                  "--logits", self.path("logits.safetensors")).stdout
        return load_file(self.path("logits.safetensors"))["logits"], json.loads(out.strip().splitlines()[-1])

    def check(self, kind, what, got, want):
        diff = float((got - want).abs().max())
        scale = float(want.abs().max())
        self.assertEqual(got.shape, want.shape)
        self.assertLess(diff, TOL * max(1.0, scale), f"{kind} {what}: logits differ by {diff} (max |logit| {scale})")
        print(f"\n{kind} {what}: max |logit difference| {diff:.2e} (max |logit| {scale:.2f})", file=sys.stderr)

    def hf_to_tessel(self, kind):
        model = hf_moe(kind)
        model.save_pretrained(self.path("hf"), safe_serialization=True)
        rows = random_rows(4)
        got, scored = self.tessel_logits(self.plan(kind), self.path("hf", "model.safetensors"), rows)
        self.check(kind, "HF->Tessel", got, hf_logits(model, rows))
        self.assertGreater(scored["loss"], 1.0)

    def tessel_to_hf(self, kind):
        plan = self.plan(kind, steps=3)
        run("tessel-train", plan)
        run("tessel-train", "export", self.path("run", "checkpoints"), "--out", self.path("export"))
        model = AutoModelForCausalLM.from_pretrained(self.path("export"), attn_implementation="eager").float().eval()
        rows = random_rows(4, seed=3)
        got, _ = self.tessel_logits(plan, self.path("export"), rows)
        self.check(kind, "Tessel->HF", got, hf_logits(model, rows))
        # The export holds exactly the names a save_pretrained of that model holds.
        model.save_pretrained(self.path("resaved"), safe_serialization=True)
        self.assertEqual(set(load_file(self.path("export", "model.safetensors"))),
                         set(load_file(self.path("resaved", "model.safetensors"))))

    def test_mixtral_weights(self):
        self.hf_to_tessel("mixtral")

    def test_qwen3_moe_weights(self):
        self.hf_to_tessel("qwen3_moe")

    def test_mixtral_export(self):
        self.tessel_to_hf("mixtral")

    def test_qwen3_moe_export(self):
        self.tessel_to_hf("qwen3_moe")


if __name__ == "__main__":
    unittest.main()
