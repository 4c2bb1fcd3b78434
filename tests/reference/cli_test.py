"""tessel-train end to end: errors before any work, determinism, dry run, checkpoints, export,
metrics contract, bf16."""
import json
import os
import subprocess
import time
import unittest

from common import (BIN, TmpDirTest, base_plan, random_rows, read_json, read_metrics, read_text, run, write_plan,
                    write_rows, write_tokens)

def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "ms_per_step", "tokens_per_s", "tflops_per_device", "mfu",
               "mem_bytes", "comm_exposed_ms"}


class Cli(TmpDirTest):
    def plan(self, arch="gpt2", **training):
        data = write_tokens(self.path("data.u16"), 3000, period=31)
        return base_plan(self.tmp, arch, data, **training)

    def test_bad_plans_fail_fast_with_file_and_line(self):
        cases = [
            ("model:\n  arch: gpt2\n  hiden: 64\ndata: {path: x}\n", "plan.yaml:3: unknown key 'model.hiden'; did you mean 'model.hidden'?"),
            ("training:\n  steps: -1\ndata: {path: x}\n", "plan.yaml:2: training.steps: must be in [1, 1073741824], got -1"),
            ("model: {hidden: 100, heads: 12}\ndata: {path: x}\n", "plan.yaml:1: model.hidden (100) must be divisible by model.heads (12)"),
        ]
        for text, message in cases:
            with open(self.path("plan.yaml"), "w") as f:
                f.write(text)
            for extra in ([], ["--dry-run"]):
                t0 = time.time()
                p = run("tessel-train", self.path("plan.yaml"), *extra, check=False)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertLess(time.time() - t0, 10)
        p = run("tessel-train", self.path("missing.yaml"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("missing.yaml: cannot read the plan file", p.stderr)
        self.assertFalse(os.path.exists(self.path("run")), "nothing may be written for a bad plan")

    def test_command_line_values_say_what_is_allowed(self):
        # Each used to reach the code: 0 got CLI11's "Value 0 not in range 0.000000 to 1.79e308"
        # (exit 105), nan passed and failed inside multinomial, INT64_MAX overflowed the length
        # check and ended in an internal error. Now exit 2, in words, before any work.
        plan_path = write_plan(self.path("p.yaml"), self.plan(steps=1))
        run("tessel-train", plan_path)
        run("tessel-train", "export", self.path("run", "checkpoints"), "--out", self.path("hf"))
        gen = ["tessel-train", "generate", plan_path, "--weights", self.path("hf", "model.safetensors"),
               "--prompt-ids", "1,2,3"]
        cases = [(gen + ["--max-new-tokens", "0"], "--max-new-tokens: '0' is too small (allowed: a whole number >= 1)"),
                 (gen + ["--temperature", "nan"], "--temperature: 'nan' is not allowed (allowed: a finite number >= 0)"),
                 (gen + ["--temperature", "inf"], "--temperature: 'inf' is not allowed"),
                 (gen + ["--top-k", "-1"], "--top-k: '-1' is too small (allowed: a whole number >= 0)"),
                 (gen + ["--max-new-tokens", "9223372036854775807"],
                  "generate: the prompt's 3 tokens + --max-new-tokens 9223372036854775807 exceed model.max_seq_len 64"),
                 (gen + ["--max-new-tokens", "99999999999999999999"], "is too large (allowed: a whole number >= 1)"),
                 (["tessel-train", plan_path, "--dry-run", "--world-size", "0"],
                  "--world-size: '0' is too small (allowed: a whole number >= 1)"),
                 (["tessel-launch", "--nproc-per-node", "0", "--", "true"],
                  "--nproc-per-node: '0' is too small (allowed: a whole number >= 1)")]
        for args, message in cases:
            p = run(*args, check=False)
            self.assertEqual(p.returncode, 2, f"{args}: {p.stderr}")
            self.assertIn(message, p.stderr + p.stdout, args)
            self.assertNotIn("internal error", p.stderr, args)
        # A tiny temperature is greedy: logits / 1e-300 used to overflow fp32 to inf, and the
        # softmax's NaN ended in an internal error.
        greedy = run(*gen, "--max-new-tokens", "4", "--json").stdout.splitlines()[-1]
        for t in ("1e-300", "4.9e-324"):
            p = run(*gen, "--max-new-tokens", "4", "--json", "--temperature", t, check=False)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertEqual(json.loads(p.stdout.splitlines()[-1])["ids"], json.loads(greedy)["ids"])

    def test_a_cpu_profile_logs_no_gpu_error(self):
        # Kineto asked for a GPU when the profiler started and logged the driver's refusal
        # ("gpuGetDeviceCount failed with code 35") as an error on every CPU profile.
        # training.device auto on this machine without a GPU: Tessel's question about CUDA came
        # first (LibTorch answers it once per process), and the answer is no device.
        p = run("tessel-train", write_plan(self.path("p.yaml"), self.plan(steps=5, device="auto")), "--profile", "1")
        self.assertTrue(os.path.exists(self.path("run", "profile", "rank0.top.md")))
        self.assertNotIn("gpuGetDeviceCount", p.stdout + p.stderr)
        self.assertNotIn("ERROR", p.stdout + p.stderr)
        self.assertIn("device cpu: training.device auto, no CUDA device: LibTorch finds no usable CUDA device",
                      p.stdout + p.stderr)

    def test_missing_data_fails_before_training(self):
        plan = self.plan()
        plan["data"]["path"] = [self.path("nothing-*.u16")]
        p = run("tessel-train", write_plan(self.path("p.yaml"), plan), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("nothing-*.u16' matches no file", p.stderr)

    def test_samples_are_what_training_reads(self):
        # `tessel-train samples` writes the global batch a run consumes: scored with the run's
        # initial weights, the first batch gives the first step's loss, and the validation rows
        # the first evaluation's loss (shuffled order, two data ranks).
        from common import hf_model
        model = hf_model("gpt2")
        model.save_pretrained(self.path("hf"), safe_serialization=True)
        plan = self.plan(steps=1, global_batch=4, micro_batch=1, eval_every=1, eval_batches=1)
        plan["model"]["init_from"] = self.path("hf")
        plan["data"].update(shuffle=True, val_fraction=0.2)
        plan["parallel"] = {"dp": 2}
        path = write_plan(self.path("plan.yaml"), plan)
        run("tessel-launch", "--nproc-per-node", "2", "--", os.path.join(BIN, "tessel-train"), path)
        metrics = read_metrics(self.path("run", "metrics.jsonl"))
        step = next(m for m in metrics if "loss" in m)
        val = next(m for m in metrics if "val_loss" in m)
        run("tessel-train", "samples", path, "--count", 4, "--out", self.path("train.i32"))
        run("tessel-train", "samples", path, "--split", "valid", "--count", 4, "--out", self.path("valid.i32"))
        score = lambda f: json.loads(run("tessel-train", "score", path, "--weights", self.path("hf"), "--tokens", f)
                                     .stdout.strip().splitlines()[-1])
        self.assertLess(abs(score(self.path("train.i32"))["loss"] - step["loss"]) / step["loss"], 1e-6)
        self.assertLess(abs(score(self.path("valid.i32"))["loss"] - val["val_loss"]) / val["val_loss"], 1e-6)
        # --skip K --count N is samples K..K+N-1 of the same order; each sample seq_len + 1 tokens.
        run("tessel-train", "samples", path, "--skip", 2, "--count", 2, "--out", self.path("tail.i32"))
        whole, tail = read_bytes(self.path("train.i32")), read_bytes(self.path("tail.i32"))
        self.assertEqual(len(whole), 4 * (plan["training"]["seq_len"] + 1) * 4)
        self.assertEqual(whole[len(whole) // 2:], tail)
        bad = run("tessel-train", "samples", path, "--split", "valid", "--set", "data.val_fraction=0",
                  "--set", "training.eval_every=0", "--out", self.path("none.i32"), check=False)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn("the plan holds no validation samples", bad.stderr)
        self.assertFalse(os.path.exists(self.path("none.i32")))

    def test_dry_run_starts_nothing(self):
        p = run("tessel-train", write_plan(self.path("p.yaml"), self.plan()), "--dry-run",
                "--set", "training.micro_batch=1", "--details")
        self.assertIn("micro_batch: 1", p.stdout)
        self.assertIn("4 micro-batches of 1 sequences per data rank per step", p.stdout)
        self.assertFalse(os.path.exists(self.path("run")))

    def test_same_plan_twice_is_bitwise_equal(self):
        plan = write_plan(self.path("p.yaml"), self.plan(steps=5))
        losses = []
        for out in ("a", "b"):
            run("tessel-train", plan, "--set", f"run.output_dir={self.path(out)}", "--set", "data.shuffle=true")
            losses.append([(m["loss"], m["grad_norm"]) for m in read_metrics(self.path(out, "metrics.jsonl"))])
        self.assertEqual(len(losses[0]), 5)
        self.assertEqual(losses[0], losses[1])

    def test_metrics_checkpoints_and_export(self):
        plan = self.plan(steps=4, eval_every=2)
        plan["data"]["val_fraction"] = 0.1
        plan["checkpoint"] = {"every": 1, "keep": 2, "export_hf": self.path("hf_end")}
        run("tessel-train", write_plan(self.path("p.yaml"), plan))
        lines = read_metrics(self.path("run", "metrics.jsonl"))
        steps = [m for m in lines if "loss" in m]
        evals = [m for m in lines if "val_loss" in m]
        self.assertEqual([m["step"] for m in steps], [1, 2, 3, 4])
        for m in steps:
            self.assertTrue(METRIC_KEYS <= set(m), set(m))
            self.assertGreater(m["tokens_per_s"], 0)
            self.assertAlmostEqual(m["mfu"], m["tflops_per_device"] / 1.0)  # logging.peak_tflops = 1
            self.assertEqual(m["comm_exposed_ms"], 0.0)  # one process: no communication to expose
            # The FLOPs behind the figure, counted here: gpt2, 2 blocks of 12h²+13h weights, h=32,
            # final norm 2h, the tied table 300·h (the head's weights); 6N + 12·L·h·T with T=16.
            n = 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32 + 300 * 32
            flops_per_token = 6 * n + 12 * 2 * 32 * 16
            self.assertAlmostEqual(m["tflops_per_device"], flops_per_token * m["tokens_per_s"] / 1e12,
                                   delta=1e-9 * m["tflops_per_device"])
        self.assertEqual([m["step"] for m in evals], [2, 4])
        # Resolved plan next to the metrics; checkpoints: keep=2 leaves the two newest, latest -> step_4.
        self.assertIn("tie_embeddings: true", read_text(self.path("run", "config.yaml")))
        ckpts = self.path("run", "checkpoints")
        self.assertEqual(sorted(os.listdir(ckpts)), ["latest", "step_3", "step_4"])
        self.assertEqual(read_text(os.path.join(ckpts, "latest")).strip(), "step_4")
        step4 = os.path.join(ckpts, "step_4")
        self.assertEqual(sorted(os.listdir(step4)), ["COMPLETE", "config.yaml", "index.json", "rank_00000.safetensors"])
        index = read_json(os.path.join(step4, "index.json"))
        self.assertEqual(index["step"], 4)
        self.assertEqual(index["consumed_samples"], 16)
        self.assertEqual(index["tensors"]["embed.weight"]["shape"], [300, 32])
        self.assertEqual(index["tensors"]["embed.weight"]["shards"][0]["file"], "rank_00000.safetensors")
        # checkpoint.export_hf: the trainer's own export of its last step, byte for byte what
        # `export` writes from that checkpoint.
        run("tessel-train", "export", step4, "--out", self.path("hf4"))
        for f in ("model.safetensors", "config.json"):
            with open(self.path("hf_end", f), "rb") as a, open(self.path("hf4", f), "rb") as b:
                self.assertEqual(a.read(), b.read(), f)
        # A bad checkpoint.export_hf is refused at start-up, before any step, with export's rules.
        os.makedirs(self.path("taken"))
        with open(self.path("taken", "notes.txt"), "w") as f:
            f.write("mine")
        for name, folder, needle in (("in_ckpt", self.path("in_ckpt_run", "checkpoints", "hf"), "inside the checkpoint folder"),
                                     ("taken", self.path("taken"), "the folder holds files an export does not write")):
            bad = dict(plan, run=dict(plan["run"], output_dir=self.path(name + "_run")),
                       checkpoint=dict(plan["checkpoint"], export_hf=folder))
            p = run("tessel-train", write_plan(self.path(f"{name}.yaml"), bad), check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(f"checkpoint.export_hf {folder}: {needle}", p.stderr)
            self.assertFalse(os.path.exists(self.path(name + "_run", "metrics.jsonl")), "refused before the first step")
        # An interrupted save (no COMPLETE marker) is never trusted.
        os.remove(os.path.join(step4, "COMPLETE"))
        p = run("tessel-train", "export", step4, "--out", self.path("x"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a complete checkpoint", p.stderr)
        run("tessel-train", "export", os.path.join(ckpts, "step_3"), "--out", self.path("hf3"))
        self.assertEqual(read_json(self.path("hf3", "config.json"))["architectures"], ["GPT2LMHeadModel"])
        # Into a previous export's folder: its files are replaced, none left stale (a tokenizer.json
        # from before used to stay beside the new weights); a folder holding other files, or one
        # inside a checkpoint (export could write into the checkpoint itself), is refused.
        with open(self.path("hf3", "tokenizer.json"), "w") as f:
            f.write("{}")
        p = run("tessel-train", "export", os.path.join(ckpts, "step_3"), "--out", self.path("hf3"))
        self.assertIn(f"replacing the previous export in {self.path('hf3')} (removed config.json, model.safetensors, "
                      "tokenizer.json)", p.stdout + p.stderr)
        self.assertEqual(sorted(os.listdir(self.path("hf3"))), ["config.json", "model.safetensors"])
        with open(self.path("hf3", "notes.txt"), "w") as f:
            f.write("mine")
        p = run("tessel-train", "export", os.path.join(ckpts, "step_3"), "--out", self.path("hf3"), check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"export --out {self.path('hf3')}: the folder holds files an export does not write (notes.txt)",
                      p.stderr)
        for inside in (os.path.join(ckpts, "step_3"), os.path.join(ckpts, "hf")):
            p = run("tessel-train", "export", os.path.join(ckpts, "step_3"), "--out", inside, check=False)
            self.assertEqual(p.returncode, 2, inside)
            self.assertIn("inside the checkpoint folder", p.stderr)
        self.assertEqual(sorted(os.listdir(ckpts)), ["latest", "step_3", "step_4"])

    def check_resume(self, dtype):
        import shutil
        import torch
        from safetensors.torch import load_file
        plan = self.plan("llama", steps=6, dtype=dtype, micro_batch=1)
        plan["data"]["shuffle"] = True
        plan["checkpoint"] = {"every": 3}
        path = write_plan(self.path("p.yaml"), plan)
        run("tessel-train", path, "--set", f"run.output_dir={self.path('whole')}")
        # An interrupted run: its checkpoint at step 3, plus metrics it logged after that checkpoint.
        os.makedirs(self.path("cut", "checkpoints"))
        shutil.copytree(self.path("whole", "checkpoints", "step_3"), self.path("cut", "checkpoints", "step_3"))
        with open(self.path("cut", "checkpoints", "latest"), "w") as f:
            f.write("step_3\n")
        lines = read_text(self.path("whole", "metrics.jsonl")).splitlines()
        with open(self.path("cut", "metrics.jsonl"), "w") as f:
            f.write("\n".join(lines[:4]) + "\n")  # steps 1-4: step 4 came after the checkpoint
        p = run("tessel-train", path, "--set", f"run.output_dir={self.path('cut')}")
        self.assertIn("resumed from", p.stderr + p.stdout)
        whole = read_metrics(self.path("whole", "metrics.jsonl"))
        cut = read_metrics(self.path("cut", "metrics.jsonl"))
        self.assertEqual([m["step"] for m in cut], [1, 2, 3, 4, 5, 6])
        for a, b in zip(whole, cut, strict=True):
            self.assertEqual((a["loss"], a["grad_norm"], a["lr"]), (b["loss"], b["grad_norm"], b["lr"]), a["step"])
        wa = load_file(self.path("whole", "checkpoints", "step_6", "rank_00000.safetensors"))
        wb = load_file(self.path("cut", "checkpoints", "step_6", "rank_00000.safetensors"))
        self.assertEqual(set(wa), set(wb))
        for k in wa:
            self.assertTrue(torch.equal(wa[k], wb[k]), k)
        # Resuming a finished run does nothing; `never` starts afresh.
        p = run("tessel-train", path, "--set", f"run.output_dir={self.path('cut')}")
        self.assertIn("nothing to do", p.stderr + p.stdout)
        run("tessel-train", path, "--set", f"run.output_dir={self.path('cut')}", "--set", "checkpoint.resume=never")
        fresh = read_metrics(self.path("cut", "metrics.jsonl"))
        self.assertEqual([(m["step"], m["loss"]) for m in fresh], [(m["step"], m["loss"]) for m in whole])

    def test_resume_is_bitwise_fp32(self):
        self.check_resume("fp32")

    def test_resume_is_bitwise_bf16(self):
        self.check_resume("bf16")

    def test_resume_from_a_missing_path_is_an_error(self):
        p = run("tessel-train", write_plan(self.path("p.yaml"), self.plan()), "--set",
                f"checkpoint.resume={self.path('nope')}", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"p.yaml: checkpoint.resume: {self.path('nope')}: no such checkpoint folder", p.stderr)

    def test_bf16_trains_with_fp32_master(self):
        plan = self.plan("llama", steps=8, dtype="bf16", optimizer={"lr": 3e-3})
        run("tessel-train", write_plan(self.path("p.yaml"), plan))
        losses = [m["loss"] for m in read_metrics(self.path("run", "metrics.jsonl"))]
        self.assertLess(losses[-1], losses[0] - 0.2, losses)
        from safetensors.torch import load_file
        import torch
        t = load_file(self.path("run", "checkpoints", "step_8", "rank_00000.safetensors"))
        self.assertEqual(t["embed.weight"].dtype, torch.bfloat16)
        self.assertEqual(t["optim.master.embed.weight"].dtype, torch.float32)
        self.assertTrue(torch.equal(t["optim.master.embed.weight"].to(torch.bfloat16), t["embed.weight"]))

    def test_score_rejects_out_of_range_tokens(self):
        rows = random_rows(2)
        rows[1, 5] = 300
        write_rows(self.path("rows.bin"), rows)
        plan = write_plan(self.path("p.yaml"), self.plan(steps=1))
        run("tessel-train", plan)
        p = run("tessel-train", "score", plan, "--weights",
                self.path("run", "checkpoints", "step_1", "rank_00000.safetensors"), "--tokens", self.path("rows.bin"),
                check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("token id 300 at row 1, column 5 is outside model.vocab_size 300", p.stderr)

    def test_mfu_on_cpu_is_never_above_100_percent(self):
        # Without logging.peak_tflops the CPU's peak is measured at start; fp16 on CPU used to
        # print MFU 230-350% and fp32 172.9% on a busy machine. read_metrics refuses any MFU above
        # 100%; a step faster than the measured rate raises it, with a warning that says so.
        for dtype in ("fp32", "bf16", "fp16"):
            plan = self.plan(steps=4, dtype=dtype)
            plan["logging"]["peak_tflops"] = 0
            plan["run"]["output_dir"] = self.path(dtype)
            p = run("tessel-train", write_plan(self.path(dtype + ".yaml"), plan))
            out = p.stdout + p.stderr
            self.assertIn(f"(measured: the best {dtype} matmul rate on CPU (sizes 256 and up", out)
            steps = [m for m in read_metrics(self.path(dtype, "metrics.jsonl")) if "loss" in m]
            self.assertEqual(len(steps), 4)
            if any(m["mfu"] == 1.0 for m in steps):
                self.assertIn("that was not this device's peak", out)
        # A start-up measure that came out low (a ten-thousandth of the rate: the hook scales it) is
        # measured again once the steps pass it, out of the steps' time: MFU is then against that,
        # not 100.00% against the step's own rate as it once read mid-run.
        plan = self.plan(steps=4, dtype="fp32")
        plan["logging"]["peak_tflops"] = 0
        plan["run"]["output_dir"] = self.path("low")
        p = subprocess.run([os.path.join(BIN, "tessel-train"), write_plan(self.path("low.yaml"), plan)],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TESSEL_TEST_START_PEAK_SCALE="0.0001"))
        out = p.stdout + p.stderr
        self.assertEqual(p.returncode, 0, out)
        self.assertRegex(out, r"above the [0-9.e+-]+ TFLOP/s measured at start; measured again at step \d+: ")
        steps = [m for m in read_metrics(self.path("low", "metrics.jsonl")) if "loss" in m]
        self.assertTrue(all(m["mfu"] < 1.0 for m in steps[1:]), [m["mfu"] for m in steps])

    def test_inference_takes_what_a_user_has(self):
        # --weights given a checkpoint folder used to fail with "cannot map: No such device";
        # score --tokens wanted int32 while tokens data is uint16 by default; generate wanted a
        # plan although config.json sits beside exported weights.
        rows = random_rows(3)
        write_rows(self.path("rows.bin"), rows)
        rows.numpy().astype("<u2").tofile(self.path("rows.u16"))
        plan = write_plan(self.path("p.yaml"), self.plan(steps=2))
        run("tessel-train", plan)
        run("tessel-train", "export", self.path("run", "checkpoints"), "--out", self.path("hf"))
        scores = []
        for weights, tokens, dtype in ((self.path("hf", "model.safetensors"), "rows.bin", "int32"),
                                       (self.path("hf"), "rows.u16", "uint16"),
                                       (self.path("run", "checkpoints"), "rows.bin", "int32"),
                                       (self.path("run", "checkpoints", "step_2"), "rows.u16", "uint16")):
            p = run("tessel-train", "score", plan, "--weights", weights, "--tokens", self.path(tokens),
                    "--token-dtype", dtype)
            scores.append(json.loads(p.stdout)["loss"])
        # One model, one loss, whichever way named: the same weights through different loading
        # paths (a tied table as its own tensor or a view) may round differently in the last bits
        # (AVX-512 matmul kernels depend on a buffer's alignment), so within the parity bar.
        self.assertLess(max(scores) - min(scores), 1e-5 * abs(scores[0]), scores)
        p = run("tessel-train", "score", plan, "--weights", self.path("hf"), "--tokens", self.path("rows.u16"),
                check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("is not a whole number of rows of training.seq_len+1", p.stderr)
        self.assertIn("--token-dtype says which type", p.stderr)
        os.makedirs(self.path("txt"))
        p = run("tessel-train", "score", plan, "--weights", self.path("txt"), "--tokens", self.path("rows.bin"),
                check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"--weights {self.path('txt')}: a folder with no model.safetensors", p.stderr)
        # generate with no plan: the model from config.json beside the weights; the same ids as with it.
        with_plan = run("tessel-train", "generate", plan, "--weights", self.path("hf"), "--prompt-ids", "1,2,3",
                        "--max-new-tokens", "5", "--json")
        without = run("tessel-train", "generate", "--weights", self.path("hf", "model.safetensors"),
                      "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json")
        self.assertEqual(json.loads(with_plan.stdout)["ids"], json.loads(without.stdout)["ids"])
        self.assertEqual(len(json.loads(without.stdout)["ids"]), 5)


if __name__ == "__main__":
    unittest.main()


class GpuCheckVerdict(unittest.TestCase):
    """bench/gpu-check.sh, gpu_suite.py and gpu_bench.py skip only on a machine without a GPU: where
    the machine shows NVIDIA GPUs that torch cannot use, they fail naming the driver found and the
    one torch's CUDA needs (bench/benchlib.py)."""

    def setUp(self):
        import sys
        from unittest import mock
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
        import benchlib
        import torch
        self.benchlib, self.mock, self.torch = benchlib, mock, torch

    def verdict(self, gpus, driver, cuda_ok, visible=None):
        env = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
        with self.mock.patch.object(self.benchlib, "gpu_hardware", return_value=(gpus, driver)), \
                self.mock.patch.object(self.torch.cuda, "is_available", return_value=cuda_ok), \
                self.mock.patch.dict(os.environ, env):
            return self.benchlib.unusable_gpu_reason()

    def test_a_gpu_torch_cannot_use_fails_naming_both_drivers(self):
        why = self.verdict(["NVIDIA H100 80GB HBM3"], "535.183.01", False)
        self.assertIn("1 NVIDIA GPU (NVIDIA H100 80GB HBM3; driver 535.183.01)", why)
        self.assertIn(f"its CUDA is {self.torch.version.cuda}", why)
        self.assertIn("release 580 or newer", why)
        self.assertIn("CUDA_VISIBLE_DEVICES=''", self.verdict(["/dev/nvidia0"], "", False, visible=""))

    def test_skipped_only_without_a_gpu(self):
        self.assertEqual(self.verdict([], "", False), "")  # no GPU: the parts may skip
        self.assertEqual(self.verdict(["NVIDIA H100 80GB HBM3"], "580.159.04", True), "")  # usable
        gpus, _ = self.benchlib.gpu_hardware()  # this machine, read for real
        if not gpus:
            self.assertEqual(self.benchlib.unusable_gpu_reason(), "")
