"""ZeRO beyond the parity table (tests/dist/layouts.py holds ZeRO-1/2/3's same-run checks over 2
and 4 data ranks and inside 3D layouts): the per-rank state counters against the ZeRO paper's
figures, --dry-run's prediction of them, and a ZeRO-3 checkpoint resharded into other layouts."""
import json
import os
import re
import sys
import unittest

from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import TmpDirTest, base_plan, launch_plan, read_metrics, rel, run, write_plan, write_tokens  # noqa: E402

STEPS, VOCAB, LAYERS, BATCH = 8, 301, 4, 8
HALF = STEPS // 2  # the checkpoint resumed: past the warm-up (3 steps), in the LR decay


def to_bytes(text):
    value, unit = text.split()
    return float(value) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(unit)


class ZeroParity(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 6000, vocab=VOCAB, period=41)

    def plan(self, arch, name, zero=0, dp=1, tp=1, pp=1, schedule="1f1b", v=1, sp=False, **extra):
        plan = base_plan(self.tmp, arch, self.data, steps=STEPS, global_batch=BATCH, micro_batch=1, threads=1,
                         optimizer={"lr": 3e-3}, schedule={"warmup_steps": 3}, grad_clip=0.5)
        plan["model"].update(vocab_size=VOCAB, layers=LAYERS)
        plan["run"]["output_dir"] = self.path(name)
        plan["data"]["shuffle"] = True
        plan["parallel"] = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "sequence_parallel": sp, "timeout_s": 120,
                            "pipeline": {"schedule": schedule, "virtual_stages": v}, "ddp": {"bucket_mb": 0.02}}
        plan["checkpoint"] = {"resume": "never"}
        for section, values in extra.items():
            plan.setdefault(section, {}).update(values)
        return plan

    def launch(self, plan, world, check=True):
        return launch_plan(plan, world, check)

    def losses(self, name):
        return [m for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]

    def train(self, arch, name, world, **layout):
        self.launch(self.plan(arch, name, **layout), world)
        run("tessel-train", "export", self.path(name, "checkpoints"), "--out", self.path(name, "hf"))
        return [m["loss"] for m in self.losses(name)], load_file(self.path(name, "hf", "model.safetensors"))

    def test_state_bytes(self):
        # fp32, dp=2 and 4: weights, gradients and AdamW state per rank against the ZeRO paper's
        # 4Ψ+4Ψ+8Ψ (0), 4Ψ+4Ψ+8Ψ/N (1), 4Ψ+12Ψ/N (2), 16Ψ/N plus gathered units (3); within 5%.
        for dp in (2, 4):
            for zero in (0, 1, 2, 3):
                name = f"mem_zero{zero}_dp{dp}"
                plan = self.plan("llama", name, zero=zero, dp=dp)
                plan["training"]["steps"] = 2
                plan["training"]["schedule"]["warmup_steps"] = 1
                p = self.launch(plan, dp)
                # ZeRO-3 gathers on a side channel of the data group (its own communicator), so
                # they run beside the gradient reduce-scatters; the other stages have none.
                self.assertEqual("dp_cp.0.gather [" in p.stdout + p.stderr, zero == 3, f"zero={zero}")
                with open(self.path(name, "memory.json")) as f:
                    mem = json.load(f)
                for r in mem["ranks"]:
                    psi, n = r["numel"], dp
                    want = {0: (4 * psi, 4 * psi, 8 * psi), 1: (4 * psi, 4 * psi, 8 * psi / n),
                            2: (4 * psi, 4 * psi / n, 8 * psi / n), 3: (4 * psi / n, 4 * psi / n, 8 * psi / n)}[zero]
                    got = (r["params_bytes"], r["grads_bytes"], r["optimizer_bytes"])
                    for what, g, w in zip(("weights", "gradients", "optimizer"), got, want, strict=True):
                        self.assertLess(abs(g - w) / w, 0.05, f"zero={zero} dp={dp} rank {r['rank']} {what}: {g} vs {w}")
                    if zero == 3:
                        # Gathered at once, at most: the root unit, a block and its prefetched neighbour.
                        self.assertGreater(r["gathered_peak_bytes"], 0)
                        self.assertLessEqual(r["gathered_peak_bytes"], 3 * r["largest_unit_bytes"])
                        self.assertLess(r["gathered_peak_bytes"], 4 * psi)
                    if zero >= 2:
                        # Gradient buckets in flight (0.02 MiB each, a unit each at zero=3): at most
                        # three alive at once, far below a full fp32 gradient.
                        self.assertGreater(r["grad_bucket_peak_bytes"], 0)
                        self.assertLess(r["grad_bucket_peak_bytes"], 0.75 * 4 * psi)
                r = mem["ranks"][0]
                print(f"\nfp32 llama zero={zero} dp={dp} per rank: Ψ={r['numel']}, weights {r['params_bytes']} B, "
                      f"gradients {r['grads_bytes']} B, optimizer {r['optimizer_bytes']} B, gathered peak "
                      f"{r['gathered_peak_bytes']} B, gradient buckets peak {r['grad_bucket_peak_bytes']} B",
                      file=sys.stderr)

    def test_dry_run_predicts_the_counters(self):
        # --dry-run sizes the plan without building it: its parameters per rank equal the built
        # model's (tensor-parallel shards, pipeline stages, a tied table's copy, key/value heads
        # replicated when tp > kv_heads) and its bytes the measured ones within 5%.
        for arch, world, layout in (("gpt2", 8, {"zero": 1, "dp": 2, "tp": 2, "pp": 2, "schedule": "interleaved", "v": 2}),
                                    ("llama", 4, {"zero": 3, "dp": 2, "tp": 2}),
                                    ("llama", 4, {"zero": 2, "tp": 4})):
            name = f"dry_{arch}_{world}_{layout['zero']}"
            plan = self.plan(arch, name, **layout)
            plan["training"].update(steps=1, schedule={"warmup_steps": 1})
            path = write_plan(self.path(name + ".yaml"), plan)
            dry = run("tessel-train", path, "--dry-run", "--world-size", world).stdout
            stages = re.findall(r"^#   (?:pipeline stage (\d+): )?(\d+) parameters: weights ([\d.]+ \w+), "
                                r"gradients ([\d.]+ \w+), optimizer ([\d.]+ \w+)", dry, re.M)
            self.assertEqual(len(stages), layout.get("pp", 1), dry)
            self.launch(plan, world)
            with open(self.path(name, "memory.json")) as f:
                mem = json.load(f)
            per_stage = world // layout.get("pp", 1)
            for r in mem["ranks"]:
                stage = stages[r["rank"] // per_stage]
                self.assertEqual(int(stage[1]), r["numel"], f"{name} rank {r['rank']}")
                for text, got in zip(stage[2:], (r["params_bytes"], r["grads_bytes"], r["optimizer_bytes"]), strict=True):
                    self.assertLess(abs(to_bytes(text) - got) / got, 0.05, f"{name} rank {r['rank']}: {text} vs {got}")
            print(f"\n{name}: --dry-run {[s[1] for s in stages]} parameters per stage, as built", file=sys.stderr)

    def continue_in(self, saved, layouts, ref, uninterrupted, what):
        """The checkpoint `saved` continued in each (name, world, layout): steps HALF+1.. within 1e-5
        of the single-process run `ref`; the first layout (the one that saved it) bitwise equal to
        the uninterrupted run `uninterrupted`."""
        for k, (name, world, layout) in enumerate(layouts):
            self.launch(self.plan("gpt2", name, checkpoint={"resume": saved}, **layout), world)
            cont = self.losses(name)
            self.assertEqual([m["step"] for m in cont], list(range(HALF + 1, STEPS + 1)))
            worst = max(rel(m["loss"], ref[m["step"] - 1]) for m in cont)
            self.assertLess(worst, 1e-5, name)
            if k == 0:
                self.assertEqual([m["loss"] for m in cont], uninterrupted[HALF:], "same-layout resume must be bitwise")
            print(f"\n{what} step-{HALF} checkpoint -> {name}: worst loss rel diff {worst:.2e} vs one process",
                  file=sys.stderr)

    def test_zero3_checkpoint_resumes_in_other_layouts(self):
        # A zero=3 dp=4 run's half-way checkpoint, continued in its own layout (bitwise the
        # uninterrupted zero=3 dp=4 run), at zero=0 in one process and at zero=1 dp2 x tp2 (within
        # 1e-5 of the uninterrupted single-process run).
        ref = [m["loss"] for m in (self.launch(self.plan("gpt2", "single"), 1) and self.losses("single"))]
        self.launch(self.plan("gpt2", "z3", zero=3, dp=4, checkpoint={"every": HALF}), 4)
        z3 = [m["loss"] for m in self.losses("z3")]
        self.continue_in(self.path("z3", "checkpoints", f"step_{HALF}"),
                         (("cont_z3_dp4", 4, {"zero": 3, "dp": 4}), ("cont_single", 1, {}),
                          ("cont_z1_dp2_tp2", 4, {"zero": 1, "dp": 2, "tp": 2})), ref, z3, "gpt2 zero=3 dp=4")

    def test_hybrid_checkpoint_resumes_under_other_shard_sizes(self):
        # A zero=2 dp=4 run sharded in groups of 2 (parallel.zero_shard 2): its half-way
        # checkpoint holds each piece once (the first shard group's files), and continues under
        # zero_shard 2 (bitwise the uninterrupted run), over the whole data group, at ZeRO-3 in
        # groups of 2, and in one process, each within 1e-5 of the single-process run.
        ref = [m["loss"] for m in (self.launch(self.plan("gpt2", "single"), 1) and self.losses("single"))]
        hybrid = {"parallel": {"zero_shard": 2}}
        self.launch(self.plan("gpt2", "h2", zero=2, dp=4, checkpoint={"every": HALF}, **hybrid), 4)
        h2 = [m["loss"] for m in self.losses("h2")]
        self.assertLess(max(rel(a, b) for a, b in zip(h2, ref, strict=True)), 1e-5, "hybrid against one process")
        saved = self.path("h2", "checkpoints", f"step_{HALF}")
        with open(os.path.join(saved, "index.json")) as f:
            files = {s["file"] for t in json.load(f)["tensors"].values() for s in t["shards"]}
        self.assertEqual(files, {"rank_00000.safetensors", "rank_00001.safetensors"},
                         "only the first shard group writes the pieces (every group holds them all)")
        self.continue_in(saved, (("cont_h2", 4, {"zero": 2, "dp": 4, **hybrid}), ("cont_whole", 4, {"zero": 2, "dp": 4}),
                                 ("cont_z3_h2", 4, {"zero": 3, "dp": 4, **hybrid}), ("cont_single", 1, {})),
                         ref, h2, "gpt2 zero=2 dp=4 zero_shard 2")


if __name__ == "__main__":
    unittest.main()
