"""training.fp8 tensorwise against torchao's float8 training (torchao 0.18, its tensorwise recipe,
on the CPU where its rowwise recipe cannot run): transformers' Llama with every linear layer but
the head converted by torchao's convert_to_float8_training, trained by a plain PyTorch loop with
the same weights, batches and AdamW as Tessel's run of the same plan with training.fp8
tensorwise.

Bounds (measured on the development VM, 2026-11-30): the first EARLY steps within EARLY_TOL
(measured 0 to 6.7e-8), every step within STEP_TOL (measured worst 1.3e-3, at step 19). Until an
fp32 rounding difference (Tessel's fused RMSNorm, RoPE and attention against transformers'
composites: 1e-7 relative) carries some value across an e4m3 rounding boundary, the two runs are
the same arithmetic: torchao's casts and _scaled_mm on the same values. Once one does (step 6
here) that element moves by a whole e4m3 step (2^-3 of its magnitude) and Adam carries the
difference into every weight, as it would between two fp8 runs of any one engine on different
kernels. The same loop without fp8 is 1.3e-5 to 7.2e-4 from the fp8 run over the first 3 steps
(over 10 x EARLY_TOL: asserted), so a Tessel that skipped a cast, took another amax or cast its
gradients to e4m3 fails the early bound."""
import sys
import unittest

import numpy as np
import torch

from common import SEQ, TmpDirTest, base_plan, hf_model, read_metrics, rel, run, write_plan, write_tokens

STEPS, GLOBAL, MICRO, LR, CLIP = 20, 8, 2, 3e-3, 1.0
EARLY, EARLY_TOL, STEP_TOL = 3, 1e-6, 3e-3


def torch_losses(model, tokens, fp8):
    """Per-step mean losses of a plain loop: AdamW (no weight decay), constant LR, clipping."""
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 7 * model.config.num_hidden_layers
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    windows = torch.stack([torch.from_numpy(tokens[i * SEQ:i * SEQ + SEQ + 1].astype(np.int64))
                           for i in range(STEPS * GLOBAL)])
    model.train()
    losses = []
    for step in range(STEPS):
        total = 0.0
        for mb in windows[step * GLOBAL:(step + 1) * GLOBAL].split(MICRO):
            logits = model(input_ids=mb[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), mb[:, 1:].reshape(-1),
                                                     reduction="sum") / (GLOBAL * SEQ)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class Fp8AgainstTorchao(TmpDirTest):
    def test_tensorwise_llama(self):
        model = hf_model("llama", seed=4)
        model.save_pretrained(self.path("hf"), safe_serialization=True)
        data = write_tokens(self.path("data.u16"), STEPS * GLOBAL * SEQ + 1, seed=5, period=23)
        plan = base_plan(self.tmp, "llama", data, steps=STEPS, global_batch=GLOBAL, micro_batch=MICRO,
                         grad_clip=CLIP, fp8="tensorwise",
                         optimizer={"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0},
                         schedule={"warmup_steps": 0, "decay": "constant"})
        plan["model"]["init_from"] = self.path("hf", "model.safetensors")
        out = run("tessel-train", write_plan(self.path("plan.yaml"), plan))
        self.assertIn("fp8 tensorwise: the blocks' linear layers in float8", out.stdout + out.stderr)
        got = [m["loss"] for m in read_metrics(self.path("run", "metrics.jsonl")) if "loss" in m]
        tokens = np.fromfile(data, dtype="<u2")
        want = torch_losses(hf_model("llama", seed=4), tokens, fp8=True)
        fp32 = torch_losses(hf_model("llama", seed=4), tokens, fp8=False)
        self.assertEqual(len(got), STEPS)
        self.assertLess(want[-1], want[0] - 0.05, f"the loss must fall: {want}")
        early_fp32 = max(rel(a, b) for a, b in zip(want[:EARLY], fp32))
        self.assertGreater(early_fp32, 10 * EARLY_TOL, "fp8 must be visible against fp32")
        diffs = [rel(a, b) for a, b in zip(got, want, strict=True)]
        for s, d in enumerate(diffs, start=1):
            self.assertLess(d, EARLY_TOL if s <= EARLY else STEP_TOL,
                            f"step {s}: tessel {got[s - 1]} vs torchao {want[s - 1]}")
        print(f"\nfp8 tensorwise vs torchao over {STEPS} steps: first {EARLY} within {max(diffs[:EARLY]):.2e}, worst "
              f"{max(diffs):.2e} (step {diffs.index(max(diffs)) + 1}); torch fp8 vs fp32 over the first {EARLY}: "
              f"{early_fp32:.2e}", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
