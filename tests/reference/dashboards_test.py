"""metrics.jsonl's timestamps and token counts, TensorBoard events read by TensorBoard's own
reader, and tools/plot's PNGs."""
import json
import os
import subprocess
import sys

from common import BIN, ROOT, TmpDirTest, base_plan, free_port, read_metrics, run, write_plan, write_tokens


class Dashboards(TmpDirTest):
    def test_metrics_tensorboard_and_plots(self):
        data = write_tokens(self.path("d.u16"), 6000)
        plan = base_plan(self.tmp, "gpt2", data, steps=6, global_batch=4, micro_batch=2, threads=1,
                         eval_every=3, eval_batches=1)
        plan["run"]["output_dir"] = self.path("run")
        plan["parallel"] = {"dp": 2}
        plan["data"]["val_fraction"] = 0.1
        path = write_plan(self.path("plan.yaml"), plan)
        p = run("tessel-launch", "--nproc-per-node", 2, "--master-port", free_port(), "--",
                os.path.join(BIN, "tessel-train"), path)
        self.assertIn("tok/s/device", p.stdout + p.stderr)
        rows = read_metrics(self.path("run", "metrics.jsonl"))
        steps = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "val_loss" in r]
        self.assertEqual([r["step"] for r in steps], list(range(1, 7)))
        self.assertEqual([r["step"] for r in evals], [3, 6])
        seq = plan["training"]["seq_len"]
        for r in steps:
            self.assertEqual(r["samples"], 4 * r["step"])
            self.assertEqual(r["tokens"], 4 * seq * r["step"])
            self.assertAlmostEqual(r["tokens_per_s_global"], 2 * r["tokens_per_s_per_device"], delta=1e-6)
            self.assertEqual(r["tokens_per_s"], r["tokens_per_s_per_device"])
        times = [r["time"] for r in rows]
        self.assertEqual(times, sorted(times))
        self.assertLess(abs(times[-1] - __import__("time").time()), 600)
        self.assertEqual(evals[0]["tokens"], 3 * 4 * seq)

        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(self.path("run", "tensorboard"))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for tag in ("train/loss", "train/lr", "perf/tokens_per_s_global", "perf/mfu", "val/loss"):
            self.assertIn(tag, tags)
        tb_loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
        self.assertEqual([s for s, _ in tb_loss], list(range(1, 7)))
        for (_, v), r in zip(tb_loss, steps, strict=True):
            self.assertAlmostEqual(v, r["loss"], delta=1e-5 * abs(r["loss"]))
        self.assertEqual([e.step for e in acc.Scalars("val/loss")], [3, 6])

        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), self.path("run"),
                            "--out", self.path("png"), "--x", "tokens"], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        for name in ("loss.png", "throughput.png", "memory.png"):
            with open(self.path("png", name), "rb") as f:
                head = f.read(8)
            self.assertEqual(head, b"\x89PNG\r\n\x1a\n", name)
            self.assertGreater(os.path.getsize(self.path("png", name)), 5000, name)
        # logging.tensorboard false writes no events.
        plan["logging"]["tensorboard"] = False
        plan["run"]["output_dir"] = self.path("quiet")
        plan["parallel"] = {}
        run("tessel-train", write_plan(self.path("quiet.yaml"), plan))
        self.assertFalse(os.path.exists(self.path("quiet", "tensorboard")))
        # tools/plot.py run as a program by the system's python3, which lacks matplotlib: it
        # re-runs itself with the project's Python (it used to need that Python named, and was
        # not executable). Two runs on one plot.
        env = {k: v for k, v in os.environ.items() if k != "TESSEL_PYTHON"}
        env["PATH"] = "/usr/bin:/bin"
        p = subprocess.run([os.path.join(ROOT, "tools", "plot.py"), self.path("run"), self.path("quiet"),
                            "--out", self.path("png2")], capture_output=True, text=True, env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(sorted(os.listdir(self.path("png2"))), ["loss.png", "memory.png", "throughput.png"])
