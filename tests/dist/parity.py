"""Runs one row of the parity table (layouts.py): `parity.py ROW_ID`. Trains the row's layout and
its single-process reference (each once per plan and binary: runs are cached under
$TESSEL_PARITY_CACHE, by default <build>/parity-cache), then checks the loss at every step, the
validation loss, the exported weights, the pipeline's activations against its schedule's bound
and, for recompute rows, the step's peak memory. Exit 0 when every check holds."""
import copy
import fcntl
import hashlib
import json
import os
import shutil
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from plans import BIN, base_plan, launch_plan, read_metrics, rel, spawn_ranks, write_tokens  # noqa: E402
from layouts import BASES, BY_ID, FP8_FIRST_STEP, Row  # noqa: E402

CACHE = os.environ.get("TESSEL_PARITY_CACHE", os.path.join(BIN, "..", "parity-cache"))


def merge(into, more):
    for k, v in more.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)
    return into


def binary_key():
    h = hashlib.sha256()
    with open(os.path.join(BIN, "tessel-train"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:12]


class Runs:
    """Finished runs, keyed by (binary, plan, world); a run is trusted only once it completed."""

    def __init__(self):
        self.root = os.path.abspath(os.path.join(CACHE, binary_key()))
        os.makedirs(self.root, exist_ok=True)
        for old in os.listdir(CACHE):  # runs of other binaries are never read again
            if os.path.join(os.path.abspath(CACHE), old) != self.root:
                shutil.rmtree(os.path.join(CACHE, old), ignore_errors=True)

    def data(self, base):
        d = BASES[base]["data"]
        path = os.path.join(self.root, f"{base}.u16")
        if not os.path.exists(path):  # rows starting at once may both write it: each its own temp
            tmp = f"{path}.{os.getpid()}.tmp"
            write_tokens(tmp, d["n"], vocab=d["vocab"], period=d["period"], eod=d.get("eod"))
            os.replace(tmp, path)
        return path

    def plan(self, row, parallel, recompute=True):
        """`recompute` False: the reference's plan, which leaves SAME_RESULT_KEYS at their defaults."""
        base = BASES[row.base]
        training = {k: v for k, v in row.training.items() if recompute or k not in SAME_RESULT_KEYS}
        threads = training.pop("threads", 1)
        plan = base_plan(self.root, row.arch, self.data(row.base), threads=threads,
                         **merge(copy.deepcopy(base["training"]), training))
        merge(plan["model"], base.get("model", {}))
        plan["data"].update(shuffle=True, val_fraction=base["data"].get("val_fraction", 0.0))
        if "eod" in base["data"]:  # documents kept apart in attention (the reference's too)
            plan["data"].update(document_mask=True, eod_token=base["data"]["eod"])
        if base["data"].get("mask_loss"):  # and no loss after each end of document
            plan["data"].update(eod_mask_loss=True)
        plan["parallel"] = merge(merge({"timeout_s": 120}, base.get("parallel", {})), parallel)
        plan["checkpoint"] = {"resume": "never"}
        return plan

    def get(self, plan, world):
        """The output folder of `plan` run by `world` processes (trained now if not cached)."""
        key = hashlib.sha256(json.dumps([plan, world], sort_keys=True).encode()).hexdigest()[:16]
        out = os.path.join(self.root, key)
        with open(out + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(os.path.join(out, "done")):
                shutil.rmtree(out, ignore_errors=True)
                # The trainer writes the exported weights itself at the end (no export process).
                plan = dict(plan, run=dict(plan["run"], output_dir=out),
                            checkpoint=dict(plan["checkpoint"], export_hf=os.path.join(out, "hf")))
                if world == 1:  # counting host reads as spawn_ranks' ranks do
                    os.environ["TESSEL_COUNT_HOST_READS"] = "1"
                    try:
                        launch_plan(plan, 1)
                    finally:
                        del os.environ["TESSEL_COUNT_HOST_READS"]
                else:  # the ranks without tessel-launch, whose own tests prove it (spawn_ranks)
                    spawn_ranks(plan, world)
                open(os.path.join(out, "done"), "w").close()
        return out


def result(out):
    from safetensors.numpy import load_file  # numpy, not torch: starts in well under a second
    metrics = read_metrics(os.path.join(out, "metrics.jsonl"))
    peak = None
    if os.path.exists(os.path.join(out, "memory.json")):
        with open(os.path.join(out, "memory.json")) as f:
            peak = max(r["step_peak_bytes"] for r in json.load(f)["ranks"])
    return {"loss": [m["loss"] for m in metrics if "loss" in m],
            "val": [m["val_loss"] for m in metrics if "val_loss" in m],
            "weights": load_file(os.path.join(out, "hf", "model.safetensors")), "peak": peak, "out": out}


def reference(base, arch):
    """The table's single-process run of `base` for `arch` (cached like every row's), for tests
    beyond the table that continue or load it: {loss, val, weights, peak, out}."""
    runs = Runs()
    return result(runs.get(runs.plan(Row("reference", base, arch, 1), {}, recompute=False), 1))


# The planner on every row: state exact; the bytes of these groups exact (their collectives'
# sizes follow from the plan alone); the data groups' within PLANNER_BYTES_TOL (ZeRO's bucket
# padding, expert routing that depends on the data), and tp's under ZeRO too (each data rank sums
# the replicated gradients of its own shard: the planner predicts the average share).
PLANNER_EXACT_GROUPS = ("tp", "cp", "pp", "embedding")
PLANNER_BYTES_TOL = 0.15
# Where the planner is known to miss, by row and group: printed, not asserted, until it models
# them (each is a planner defect to fix, not a tolerance). None since 2026-11-28, when ZeRO-3's
# gathers in a pipeline were counted as the rank's schedule makes them (moe_bias_zero3_ep2_pp2_llama
# was +15.7% on its first stage; now -1.4%).
PLANNER_KNOWN_MISSES = {}

# The step's activation peak (the most a step allocates above the state held between steps) as
# --dry-run predicts it, against the counting allocator's measurement, on every row: within
# PLANNER_ACTIVATION_TOL, or, for the rows below, within the row's bound in percent (its miss
# measured 2026-11-28 plus 3 points), so that no miss grows unseen and no new schedule, method or
# row lands with the planner unchecked. Each entry is a planner defect to fix or a run that
# varies, not a tolerance.
PLANNER_ACTIVATION_TOL = 0.10
PLANNER_ACTIVATION_MISSES = {
    # bf16, ZeRO-3 without kept units in 1F1B: +9.95% on the last stage (2026-11-28), at the edge
    # of PLANNER_ACTIVATION_TOL; not traced yet.
    "zero3_dp2_pp2_1f1b_free_bf16_llama": 13,
    # Two micro-batches on two threads: the peak depends on how the pair's passes interleave
    # (measured -0.1% and +10.5% for the same plan).
    "microbatch_pairs_gpt2": 14,
    "microbatch_pairs_llama": 14,
    # bf16 on a CPU without avx512_bf16 (an AMD EPYC VM without AVX-512, 2026-11-29): -10.7% at
    # 1018f68 and after it alike (-4.5% on the avx512_bf16 VM of 2026-11-28): oneDNN's bf16
    # matmuls take other paths there; not traced yet.
    "zero2_dp4_shard2_pp2_zbv_bf16_gpt2": 13,
}
assert set(PLANNER_ACTIVATION_MISSES) <= set(BY_ID), "known misses name rows of the table"

# Training keys that must not change what is trained: a row may set them, its reference keeps the defaults.
SAME_RESULT_KEYS = ("recompute", "lean_logits", "lean_logits_chunk", "kernels", "threads")


class Parity(unittest.TestCase):
    row = None

    def test_same_run_as_one_process(self):
        row, runs = self.row, Runs()
        ref = result(runs.get(runs.plan(row, {}, recompute=False), 1))
        got = result(runs.get(runs.plan(row, row.parallel), row.world))
        what = f"{row.id} ({row.world} processes)"
        steps = row.training.get("steps", BASES[row.base]["training"]["steps"])
        self.assertEqual(len(got["loss"]), steps, what)
        self.assertEqual(len(ref["loss"]), steps, what)
        if steps >= 20:  # the drift rows (layouts.DRIFT_ROWS)
            self.assertLess(ref["loss"][-1], ref["loss"][0] - 0.3, "the reference's loss must fall")
        loss_tol, weight_tol = row.tol
        if row.training.get("fp8", "off") != "off":  # step 1: the same weights, the same scales
            self.assertLess(rel(got["loss"][0], ref["loss"][0]), FP8_FIRST_STEP,
                            f"{what}: step 1 {got['loss'][0]} vs {ref['loss'][0]}")
        worst = max(rel(a, b) for a, b in zip(got["loss"], ref["loss"], strict=True))
        self.assertLess(worst, loss_tol, f"{what}: losses {got['loss']} vs {ref['loss']}")
        self.assertEqual(len(got["val"]), len(ref["val"]), what)
        worst_val = max((rel(a, b) for a, b in zip(got["val"], ref["val"], strict=True)), default=0.0)
        self.assertLess(worst_val, loss_tol, f"{what}: validation {got['val']} vs {ref['val']}")
        self.assertEqual(set(got["weights"]), set(ref["weights"]), what)
        wdiff, wkey = max((float(abs(got["weights"][k] - ref["weights"][k]).max()), k) for k in ref["weights"])
        if weight_tol is not None:
            self.assertLess(wdiff, weight_tol, f"{what}: exported weights differ by {wdiff} (most in {wkey})")
        line = f"{what}: worst loss rel diff {worst:.2e}, val {worst_val:.2e}, exported weights {wdiff:.2e}"
        if row.parallel.get("pp", 1) > 1:
            line += self.check_pipeline(got["out"], row)
        line += self.check_planner(got["out"], row)
        line += self.check_host_reads(got["out"], row)
        if row.peak_below:
            other, factor = row.peak_below
            base = ref if other == "reference" else result(runs.get(runs.plan(BY_ID[other], BY_ID[other].parallel),
                                                                     BY_ID[other].world))
            self.assertLess(got["peak"], factor * base["peak"], f"{what}: step peak {got['peak']} vs {base['peak']}")
            line += f"; step peak {got['peak'] / 2**20:.2f} MiB vs {base['peak'] / 2**20:.2f} MiB ({other})"
        print("\n" + line, file=sys.stderr)

    def check_planner(self, out, row):
        """--dry-run's figures for this row's plan and layout (the trainer writes them beside its
        counters in memory.json) against what the run measured: each rank's weights, gradients
        and optimizer state as the CPU allocator counted them (exactly, once the run's alignment
        padding, within its bound, is added) and its bytes per group per step exactly, its step
        activation peak within PLANNER_ACTIVATION_TOL (or its known miss's bound)."""
        with open(os.path.join(out, "memory.json")) as f:
            memory = json.load(f)
        pp = row.parallel.get("pp", 1)
        worst = 0.0
        for m in memory["ranks"]:
            stage = m["rank"] // (row.world // pp)  # rank order tp-cp-dp-pp: pp varies slowest
            p = memory["predicted"][stage]
            where = f"{row.id} rank {m['rank']}"
            for part in ("weights", "grads", "optimizer"):
                # Exact but for the alignment padding (every slot, bucket and ZeRO piece on 64
                # elements), which the plan alone cannot know and the run bounds.
                pad = m[f"padding_{part}_bytes"]
                self.assertTrue(0 <= pad <= m["padding_bound_bytes"],
                                f"{where}: {part} padding {pad}, bound {m['padding_bound_bytes']}")
                self.assertEqual(p[f"{part}_bytes"] + pad, m[f"allocated_{part}_bytes"],
                                 f"{where}: {part} predicted {p[f'{part}_bytes']} + padding {pad}, "
                                 f"allocated {m[f'allocated_{part}_bytes']}")
            for group, measured in m["comm_bytes_per_step"].items():
                if group in ("mp", "world") or (measured < 64 and group not in p["comm_bytes_per_step"]):
                    continue  # scalars: the gradient norm's sum and the stop votes
                predicted = p["comm_bytes_per_step"].get(group, 0)
                what = f"{where}: {group} bytes per step predicted {predicted:.0f}, measured {measured}"
                if (row.id, group) in PLANNER_KNOWN_MISSES:
                    print(f"\n{what} (known planner miss: {PLANNER_KNOWN_MISSES[(row.id, group)]})", file=sys.stderr)
                elif group in PLANNER_EXACT_GROUPS and not (group == "tp" and row.parallel.get("zero", 0) > 0):
                    self.assertEqual(predicted, measured, what)
                else:
                    self.assertLess(abs(predicted - measured) / max(measured, 1), PLANNER_BYTES_TOL, what)
            act = (p["activation_bytes"] - m["step_peak_bytes"]) / max(m["step_peak_bytes"], 1)
            worst = act if abs(act) > abs(worst) else worst
        bound = PLANNER_ACTIVATION_MISSES.get(row.id, 100 * PLANNER_ACTIVATION_TOL)
        known = " (a known planner miss: PLANNER_ACTIVATION_MISSES)" if row.id in PLANNER_ACTIVATION_MISSES else ""
        self.assertLessEqual(abs(100 * worst), bound,
                             f"{row.id}: --dry-run's step activation peak {100 * worst:+.1f}% from the measured, "
                             f"bound {bound}%{known}")
        return f"; planner: state exact, bytes within bounds, activation peak {100 * worst:+.1f}%{known}"

    def check_host_reads(self, out, row):
        """No host read inside a step (each would be a host sync on a GPU), but for the one an
        expert-parallel exchange makes per MoE layer and micro-batch for its split sizes (counted
        by the trainer, core/observe/host_reads.h: memory.json host_reads_per_step)."""
        with open(os.path.join(out, "memory.json")) as f:
            reads = [m["host_reads_per_step"] for m in json.load(f)["ranks"]]
        base = BASES[row.base]
        ep = row.parallel.get("ep", 1)
        if "moe" not in base.get("model", {}) or ep == 1:
            self.assertEqual(reads, [0] * row.world, f"{row.id}: host reads per step on each rank")
            return "; no host reads"
        moe = base["model"]["moe"]
        layers = base["model"]["layers"] // moe.get("every", 1)
        training = {**base["training"], **row.training}
        dp = row.world // (row.parallel.get("tp", 1) * row.parallel.get("cp", 1) * row.parallel.get("pp", 1))
        micro = training["global_batch"] // (dp * training.get("micro_batch", 1))
        if row.parallel.get("pp", 1) == 1 and training.get("recompute", "none") == "none":
            self.assertEqual(reads, [layers * micro] * row.world, f"{row.id}: one host read per MoE layer "
                             f"({layers}) per micro-batch ({micro})")
        else:  # a stage holds some of the layers; recompute runs a forward again
            self.assertTrue(all(0 < r <= 2 * layers * micro and r % micro == 0 for r in reads),
                            f"{row.id}: host reads per step {reads}, {layers} MoE layers x {micro} micro-batches")
        return f"; host reads per step {max(reads)} (ep exchange split sizes)"

    def check_pipeline(self, out, row):
        """The executor held exactly the activations its schedule says (1F1B: at most pp)."""
        with open(os.path.join(out, "pipeline.json")) as f:
            pipeline = json.load(f)
        pp = row.parallel["pp"]
        schedule = row.parallel.get("pipeline", {}).get("schedule", "1f1b")  # the plan's default
        for r in pipeline["ranks"]:
            held, bound = r["peak_activations"], r["schedule_peak_activations"]
            self.assertEqual(held, bound, f"rank {r['rank']}: executor held {held}, schedule says {bound}")
            if schedule == "1f1b":
                self.assertLessEqual(held, pp)
                if r["pp"] == 0:
                    self.assertEqual(held, min(pp, pipeline["microbatches"]))
            elif schedule == "gpipe":
                self.assertEqual(held, pipeline["microbatches"])
        return "; bubble per rank " + " ".join(f"{r['bubble']:.2f}" for r in pipeline["ranks"])


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in BY_ID:
        sys.exit(f"usage: parity.py ROW_ID (one of {len(BY_ID)} rows of layouts.py)")
    Parity.row = BY_ID[sys.argv.pop(1)]
    unittest.main(verbosity=2)
