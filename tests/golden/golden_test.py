"""The default plan against its golden losses (tests/golden/default.json), the smoke test of every
edit: configs/default.yaml's model, optimizer and schedule, shortened (12 steps, 3 of warm-up,
validation at steps 6 and 12, a checkpoint at step 6 and at the end), on a fixed token file written
here (the plan's own data is this repository's sources, which change with every commit). Every
step's loss and both validation losses must match the file within 1e-4 relative: far above the
rounding that differs between CPUs (AVX2 or AVX-512 matmuls), far below any change to what is
trained. A change that is meant to change the numbers rewrites the file:
  TESSEL_WRITE_GOLDEN=1 python3 tests/golden/golden_test.py
and says why in its commit."""
import json
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from plans import BIN, ROOT, TmpDirTest, read_metrics, rel, write_fixed_tokens  # noqa: E402

GOLDEN = os.path.join(HERE, "default.json")
TOL = 1e-4
SETS = {"training.steps": 12, "training.schedule.warmup_steps": 3, "training.eval_every": 6,
        "training.eval_batches": 1, "logging.every": 1, "checkpoint.every": 6, "checkpoint.resume": "never",
        "data.format": "tokens", "data.token_dtype": "uint16", "data.val_fraction": 0.05}


def train(tmp):
    data = write_fixed_tokens(os.path.join(tmp, "fixed.u16"))
    sets = dict(SETS, **{"run.output_dir": os.path.join(tmp, "run"), "data.path": f"[{data}]"})
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    p = subprocess.run([os.path.join(os.path.abspath(BIN), "tessel-train"), "configs/default.yaml", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"the default plan exited {p.returncode}\n{p.stderr[-4000:]}")
    rows = read_metrics(os.path.join(tmp, "run", "metrics.jsonl"))
    return {"loss": [r["loss"] for r in rows if "loss" in r], "val": [r["val_loss"] for r in rows if "val_loss" in r]}


class DefaultPlanGolden(TmpDirTest):
    def test_losses_match_the_golden_file(self):
        got = train(self.tmp)
        if os.environ.get("TESSEL_WRITE_GOLDEN"):
            with open(GOLDEN, "w") as f:
                json.dump({"plan": "configs/default.yaml", "sets": SETS, "tolerance": TOL, **got}, f, indent=1)
                f.write("\n")
        with open(GOLDEN) as f:
            want = json.load(f)
        self.assertEqual(want["sets"], SETS, "the golden file was written for other settings: rewrite it")
        self.assertEqual(len(got["loss"]), SETS["training.steps"])
        self.assertEqual(len(got["val"]), 2)
        worst = max(rel(a, b) for a, b in zip(got["loss"] + got["val"], want["loss"] + want["val"], strict=True))
        print(f"\ndefault plan, 12 steps: loss {got['loss'][0]:.4f} -> {got['loss'][-1]:.4f}, "
              f"worst rel diff to the golden file {worst:.2e}", file=sys.stderr)
        self.assertLess(worst, TOL, f"losses {got} vs golden {want}")
        ckpt = os.path.join(self.tmp, "run", "checkpoints")
        self.assertEqual(sorted(d for d in os.listdir(ckpt) if d.startswith("step_")), ["step_12", "step_6"])


if __name__ == "__main__":
    unittest.main()
