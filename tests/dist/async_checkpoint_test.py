"""checkpoint.async: the same files as a synchronous save (checksums equal), a second save waiting
for the first, a stop and the end of training waiting for the save in flight, and a kill during a
background write leaving the previous checkpoint in place and the new one unread."""
import json
import os
import re
import signal
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import BIN, TmpDirTest, base_plan, free_port, read_metrics, run, write_plan, write_tokens  # noqa: E402

STOPPED = 75  # engine/run/stop.h kExitStopped
DELAY = "TESSEL_TEST_SAVE_DELAY_MS"  # engine/checkpoint/save.cpp: a write held in flight


class AsyncCheckpoint(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 20000, period=37)

    def plan(self, name, asynchronous, steps=12, every=4, **parallel):
        plan = base_plan(self.tmp, "llama", self.data, steps=steps, global_batch=4, micro_batch=1,
                         threads=1, optimizer={"lr": 3e-3}, schedule={"warmup_steps": 2})
        plan["run"]["output_dir"] = self.path(name)
        plan["checkpoint"] = {"every": every, "async": asynchronous}
        plan["parallel"] = {"timeout_s": 120, **parallel}
        return write_plan(self.path(name + ".yaml"), plan)

    def launch(self, path, world):
        if world == 1:
            return [os.path.join(BIN, "tessel-train"), path]
        return [os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(world), "--master-port",
                str(free_port()), "--", os.path.join(BIN, "tessel-train"), path]

    def losses(self, name):
        return [(m["step"], m["loss"]) for m in read_metrics(self.path(name, "metrics.jsonl")) if "loss" in m]

    def interrupt(self, cmd, pattern, sig, env):
        """Starts cmd, sends `sig` at the first output line matching `pattern`; returns (exit
        code, output)."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, **env))
        out = []
        for line in iter(p.stdout.readline, ""):
            out.append(line)
            if re.search(pattern, line):
                p.send_signal(sig)
                break
        out.append(p.communicate(timeout=120)[0])
        return p.returncode, "".join(out)

    def files(self, name, step):
        with open(self.path(name, "checkpoints", f"step_{step}", "index.json")) as f:
            return json.load(f)["files"]

    def test_same_files_as_a_synchronous_save_on_two_ranks(self):
        # ZeRO-1 on two data ranks: each rank writes its pieces; rank 0 publishes after both.
        run(*self.launch(self.plan("sync", False, dp=2, zero=1), 2))
        p = run(*self.launch(self.plan("async", True, dp=2, zero=1), 2))
        out = p.stdout + p.stderr
        self.assertEqual(self.losses("async"), self.losses("sync"))  # bitwise
        for step in (4, 8, 12):
            self.assertEqual(self.files("async", step), self.files("sync", step), step)
            self.assertRegex(out, rf"checkpoint step {step}: held training \d+ ms to copy it to host memory")
            self.assertIn(f"step_{step} (written in the background in ", out)
        with open(self.path("async", "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), "step_12")

    def test_a_save_in_flight_is_waited_for_and_a_kill_keeps_the_previous(self):
        run(*self.launch(self.plan("whole", False), 1))
        # --dry-run's host memory per save: the rank file's bytes (its header aside) within 2%.
        p = run("tessel-train", self.plan("cut", True), "--dry-run")
        mib = float(re.search(r"checkpoint.async: a save holds up to ([0-9.]+) MiB", p.stdout).group(1))
        size = os.path.getsize(self.path("whole", "checkpoints", "step_12", "rank_00000.safetensors"))
        self.assertLess(abs(mib * 2**20 - size) / size, 0.02, (mib, size))
        # Every write held 1.5 s: step 8's save waits for step 4's, saying so; killed while step
        # 8's is being written, the run keeps step 4 as its latest and never reads step_8.tmp.
        _, log = self.interrupt(self.launch(self.plan("cut", True), 1), r"checkpoint step 8: held training",
                                signal.SIGKILL, {DELAY: "1500"})
        self.assertIn("checkpoint.async: step 8 waits for step 4's save, still being written", log)
        # The host copy is one arena sized exactly: the dry run's figure within 2%.
        arena = float(re.search(r"to copy it to host memory \(([0-9.]+) MiB\)", log).group(1))
        self.assertLess(abs(arena - mib) / mib, 0.02, (arena, mib))
        ckpt = self.path("cut", "checkpoints")
        with open(os.path.join(ckpt, "latest")) as f:
            self.assertEqual(f.read().strip(), "step_4")
        self.assertTrue(os.path.isdir(os.path.join(ckpt, "step_8.tmp")))
        self.assertFalse(os.path.exists(os.path.join(ckpt, "step_8.tmp", "COMPLETE")))
        self.assertFalse(os.path.exists(os.path.join(ckpt, "step_8")))
        # Resumed (writes no longer held): from step 4, every later loss the whole run's, bitwise.
        p = run(*self.launch(self.path("cut.yaml"), 1))
        self.assertIn("resumed from", p.stdout + p.stderr)
        self.assertEqual(self.losses("cut")[-8:], self.losses("whole")[4:])
        self.assertEqual(self.files("cut", 12), self.files("whole", 12))

    def test_a_stop_waits_for_the_save_in_flight(self):
        # SIGTERM while writes are held: the stop's own save is published before exit 75.
        code, out = self.interrupt(self.launch(self.plan("stop", True, steps=40, every=2), 1), r"step +5/",
                                   signal.SIGTERM, {DELAY: "500"})
        self.assertEqual(code, STOPPED, out[-3000:])
        stopped = max(s for s, _ in self.losses("stop"))
        with open(self.path("stop", "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), f"step_{stopped}")
        self.assertTrue(os.path.exists(self.path("stop", "checkpoints", f"step_{stopped}", "COMPLETE")))
