"""The dry-run figures the docs quote are what the binary prints now: every "`tessel-train ...
--dry-run ...`: figures" quote in README.md and docs/*.md is rerun and each figure checked, and
the Mixtral layout moe.md and configs/mixtral-8x7b.yaml describe is the one the dry-run builds.
Lines are found by their content, never by position (the dry-run prints its summary first and the
resolved plan and rank grid only with --details)."""
import glob
import os
import re
import shlex
import subprocess
import unittest

from plans import BIN, ROOT  # torch-free (common.py re-exports plans.py and imports torch)

# A quoted dry-run: the command in backticks, a colon, then its figures up to ';' or a full stop.
QUOTE = re.compile(r"`(tessel-train [^`]*--dry-run[^`]*)`:\s+(.*?)(?:;|\.(?=\s|$))", re.S)
# The figures such a quote may hold, and where the dry-run prints each.
STAGE_GIB = re.compile(r"([0-9.]+) GiB (?:per rank )?on (?:pipeline )?stage (\d+)")
STEP_MS = re.compile(r"([0-9.]+) ms/step")
MFU = re.compile(r"MFU ([0-9.]+)%")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def doc_files():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path):
    with open(path) as f:
        return f.read()


def quotes():
    """(file, command, figure text) for every quoted dry-run in the docs."""
    found = []
    for path in doc_files():
        for m in QUOTE.finditer(read(path)):
            found.append((os.path.relpath(path, ROOT), m.group(1), " ".join(m.group(2).split())))
    return found


def dry_run(args):
    """Runs tessel-train with `args` in the checkout's root (the docs' paths are relative to it)."""
    return subprocess.run([os.path.join(os.path.abspath(BIN), "tessel-train"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def printed(out):
    """The figures of a dry-run's output, each from the line that carries it."""
    stages = {int(s): float(g) for s, g in re.findall(r"^#\s+stage (\d+): .*= ([0-9.]+) GiB\s*$", out, re.M)}
    step = re.search(r"^# predicted on .*?: step ([0-9.]+) ms = compute", out, re.M)
    mfu = re.search(r"^# predicted on .*?, MFU ([0-9.]+)%", out, re.M)
    return stages, step and float(step.group(1)), mfu and float(mfu.group(1))


def agrees(quoted, value):
    """`quoted` (a doc's string) is `value` rounded to the decimals the doc shows."""
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    return value is not None and abs(float(quoted) - value) <= 0.5 * 10 ** -decimals + 1e-9


class QuotedDryRuns(unittest.TestCase):
    def test_every_quoted_figure_is_printed(self):
        found = quotes()
        commands = [cmd for _, cmd, _ in found]
        self.assertIn("tessel-train configs/llama3-8b.yaml --dry-run --world-size 64", commands,
                      "docs/data-and-sizing.md's Llama-3 8B figures are no longer found in the quoted form")
        for doc, cmd, text in found:
            with self.subTest(f"{doc}: {cmd}"):
                p = dry_run(shlex.split(cmd)[1:])
                self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr)
                stages, step, mfu = printed(p.stdout)
                checked = []
                for gib, stage in STAGE_GIB.findall(text):
                    self.assertTrue(agrees(gib, stages.get(int(stage))),
                                    f"{doc} quotes {gib} GiB on stage {stage}; the dry-run prints {stages}")
                    checked += [gib, stage]
                for ms in STEP_MS.findall(text):
                    self.assertTrue(agrees(ms, step), f"{doc} quotes {ms} ms/step; the dry-run prints {step}")
                    checked.append(ms)
                for pct in MFU.findall(text):
                    self.assertTrue(agrees(pct, mfu), f"{doc} quotes MFU {pct}%; the dry-run prints {mfu}%")
                    checked.append(pct)
                # Every number of the quote is one of the figures above: none goes unchecked.
                unchecked = NUMBER.findall(text)
                for n in checked:
                    unchecked.remove(n)
                self.assertEqual(unchecked, [], f"{doc}: figures this test does not know how to check: {text}")
                self.assertTrue(checked, f"{doc}: no figure in the quote of {cmd}")


class MixtralLayout(unittest.TestCase):
    """configs/mixtral-8x7b.yaml at 64: tp 2, pp 4 of 8 layers, dp 8 and ep 4, so the ep group of
    stage 0's tp rank 0 is ranks 0, 2, 4, 6 (one 8-GPU node), each rank holding two experts whose
    gradients are summed with rank 8's; 46.7 B parameters."""

    def test_mixtral_plan_is_what_moe_md_says(self):
        args = ["configs/mixtral-8x7b.yaml", "--dry-run", "--world-size", "64"]
        p = dry_run(args + ["--details"])  # the rank grid; a binary without --details prints it always
        if p.returncode != 0 and "--details" in p.stderr:
            p = dry_run(args)
        self.assertEqual(p.returncode, 0, p.stdout[-2000:] + p.stderr)
        out = p.stdout
        self.assertRegex(out, r"(?m)^rank grid: world 64 = tp 2 x cp 1 x dp 8 x pp 4\b")
        self.assertRegex(out, r"(?m)^# layers per stage .*: 8 8 8 8\s*$")
        self.assertRegex(out, r"(?m)^# planner: 46\.7 B parameters;")
        per_node = int(re.search(r"(\d+) per node", out).group(1))
        rank0 = re.search(r"(?m)^\s*rank\s+0: (.*)$", out).group(1)
        group = {name: [int(r) for r in members.split(",")]
                 for name, members in re.findall(r"\b(\w+) \[([0-9,]+)\]", rank0)}
        self.assertEqual(group["ep"], [0, 2, 4, 6])
        self.assertEqual(group["edp_cp"], [0, 8])  # the two data ranks holding the same experts
        self.assertEqual(sorted({r // per_node for r in group["ep"]}), [0])  # inside one node
        self.assertRegex(out, r"(?m)^# groups inside a node of 8 ranks: tp, ep; across nodes: ")
        moe_md = " ".join(read(os.path.join(ROOT, "docs", "moe.md")).split())
        for claim in ("tp 2, pp 4 (8 layers a stage), dp 8 and ep 4", "ranks 0, 2, 4, 6 only",
                      "span two 8-GPU nodes", "7,630.9 ms", "60.59 GiB", "9,250.5 ms"):
            self.assertIn(claim, moe_md)
        step = re.search(r"(?m)^# predicted on .*?: step ([0-9.]+) ms", out).group(1)
        self.assertEqual(step, "7630.9")
        self.assertEqual(printed(out)[0].get(0), 60.59, "moe.md's memory per rank on stage 0")
        config = read(os.path.join(ROOT, "configs", "mixtral-8x7b.yaml"))
        # The plan's own comment quotes ep 8 against ep 4 (it once said 30.5 and 54.1 GiB).
        ep8 = dry_run(args + ["--set", "parallel.ep=8"])
        self.assertEqual(ep8.returncode, 0, ep8.stderr)
        self.assertIn("38.09 GiB", moe_md)
        self.assertEqual(printed(ep8.stdout)[0].get(0), 38.09, "moe.md's ep 8 memory on stage 0")
        self.assertEqual(re.search(r"(?m)^# predicted on .*?: step ([0-9.]+) ms", ep8.stdout).group(1), "9250.5")
        self.assertIn("ep 8 (one expert a rank, 38.09 GiB instead of 60.59 GiB on stage 0)",
                      " ".join(line.lstrip("# ") for line in config.splitlines()))
        self.assertIn("46.7B parameters", config)
        self.assertIn("ranks 0, 2, 4, 6 only", config)
        self.assertIn("Mixtral-8x7B shape (46.7B parameters", read(os.path.join(ROOT, "docs", "data-and-sizing.md")))


class ReadmeRun(unittest.TestCase):
    """README.md's `make run` block is what configs/default.yaml prints: the model's parameters
    and the FLOPs per token exactly, the data's samples within 25% (the data is this repository's
    own sources, which grow; the block once said 3,275 samples where the run read 10,567), and a
    final loss below the first. Only start-up and one step are rerun here (the whole run takes
    three minutes)."""

    def test_the_make_run_block_is_what_the_default_plan_prints(self):
        readme = read(os.path.join(ROOT, "README.md"))
        block = readme[readme.index("`make run` trains"):]
        block = block[block.index("```") + 3:]
        block = block[:block.index("```")]
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            p = dry_run(["configs/default.yaml", "--set", "training.steps=1", "--set",
                         "training.schedule.warmup_steps=0", "--set", f"run.output_dir={tmp}",
                         "--set", "checkpoint.every=0", "--set", "training.eval_every=0"])
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        out = p.stdout + p.stderr
        params = re.search(r"model gpt2 \| (\d+) parameters", out).group(1)
        self.assertIn(f"model gpt2 | {params} parameters", block)
        flops = re.search(r"MFU: ([0-9.]+) GFLOP/token", out).group(1)
        self.assertIn(f"MFU: {flops} GFLOP/token", block)
        now = int(re.search(r"data text \| (\d+) training samples", out).group(1))
        quoted = int(re.search(r"data text \| (\d+) training samples", block).group(1))
        self.assertLess(abs(quoted - now) / now, 0.25, f"README quotes {quoted} samples; the run reads {now}")
        losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", block)]
        self.assertGreater(len(losses), 1)
        self.assertLess(losses[-1], losses[0])


if __name__ == "__main__":
    unittest.main()
