"""Operations: save on signal and resume bitwise (under tessel-launch and alone), requeue under
Slurm, checkpoint pruning by lineage, no silent restart over existing checkpoints, incomplete
checkpoints refused, ranks with different plans stopped, metrics write errors and impossible
thread counts reported. Each case failed on the main before these changes."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import BIN, TmpDirTest, base_plan, free_port, read_metrics, run, write_plan, write_tokens  # noqa: E402

STOPPED = 75  # engine/run/stop.h kExitStopped


def lr_at(step, lr, warmup, steps):
    """core/optim/optim.cpp's schedule: linear warmup, then cosine to 0 at the last step."""
    import math
    if step <= warmup:
        return lr * step / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


def worker_pid(launcher_pid, rank):
    """The pid of the launcher's worker whose RANK is `rank`."""
    for task in os.listdir(f"/proc/{launcher_pid}/task"):
        with open(f"/proc/{launcher_pid}/task/{task}/children") as f:
            for pid in f.read().split():
                with open(f"/proc/{pid}/environ", "rb") as e:
                    if f"RANK={rank}".encode() in e.read().split(b"\0"):
                        return int(pid)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher_pid}")


class Operations(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 20000, period=37)

    def plan(self, name, steps=40, **sections):
        plan = base_plan(self.tmp, "gpt2", self.data, steps=steps, global_batch=4, micro_batch=1, threads=1,
                         optimizer={"lr": 3e-3}, schedule={"warmup_steps": 2})
        plan["run"]["output_dir"] = self.path(name)
        plan["checkpoint"] = {"every": 10}
        for section, values in sections.items():
            plan.setdefault(section, {}).update(values)
        return write_plan(self.path(name + ".yaml"), plan)

    def losses(self, name):
        return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(self.path(name, "metrics.jsonl"))
                if "loss" in m]

    def launcher(self, path, world=2, env=None):
        return [os.path.join(BIN, "tessel-launch"), "--nproc-per-node", str(world), "--master-port",
                str(free_port()), "--", os.path.join(BIN, "tessel-train"), path]

    def interrupt(self, cmd, sig, at_step=8, env=None):
        """Starts cmd, sends `sig` once step `at_step` is logged, returns (exit code, output)."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, **(env or {})))
        out = []
        for line in iter(p.stdout.readline, ""):
            out.append(line)
            if re.search(rf"step +{at_step}/", line):
                p.send_signal(sig)
                break
        out.append(p.communicate(timeout=120)[0])
        return p.returncode, "".join(out)

    def assert_clean_end(self, out):
        """The ranks met at a world barrier after their last collective (rank 0, which reports for
        everyone, says so after it), then each shut down its communicators: rank 0 as many as the
        start-up log lists for it (parallel/mesh.h Mesh::shutdown)."""
        listed = re.search(r"\[rank 0\] .*communicators of this rank \(gloo, connected at start-up\): (.*)", out)
        ended = re.search(r"\[rank 0\] .*every rank reached the end; (\d+) communicators of this rank shut down",
                          out)
        self.assertIsNotNone(listed, out[-3000:])
        self.assertIsNotNone(ended, f"the ranks did not end at a world barrier:\n{out[-3000:]}")
        self.assertEqual(int(ended.group(1)), len(re.findall(r"\[[\d,]+\]", listed.group(1))), listed.group(0))

    def test_sigterm_to_the_launcher_saves_and_resumes_bitwise(self):
        full = self.plan("full", parallel={"dp": 2})
        p = subprocess.run(self.launcher(full), check=True, capture_output=True, text=True, timeout=300)
        self.assert_clean_end(p.stdout + p.stderr)  # a finished run
        cut = self.plan("cut", parallel={"dp": 2})
        code, out = self.interrupt(self.launcher(cut), signal.SIGTERM)
        self.assertEqual(code, STOPPED, out)
        self.assert_clean_end(out)  # a run stopped on a signal
        self.assertIn("the workers stopped on a signal (exit 75: after saving a checkpoint", out)
        saved = int(re.search(r"stopped after step (\d+) on a signal", out).group(1))
        self.assertTrue(8 <= saved < 40, out)
        with open(self.path("cut", "checkpoints", "latest")) as f:
            self.assertEqual(f.read().strip(), f"step_{saved}")
        subprocess.run(self.launcher(cut), check=True, capture_output=True, timeout=300)  # resume: auto
        self.assertEqual(self.losses("cut"), self.losses("full"), "resumed after the signal: not bitwise")
        print(f"\nSIGTERM at step 8: checkpoint step_{saved}, exit {code}; resumed run equals the "
              f"uninterrupted one bitwise over {len(self.losses('full'))} steps", file=sys.stderr)

    def test_a_signal_during_start_up_stops_at_once(self):
        # SIGTERM while the trainer starts (its first log line comes before the data and the
        # model): start-up stops at its next piece of work with exit 75 and saves nothing, since
        # nothing was trained (before: it finished start-up and trained a step first, which on a
        # long start-up meant minutes). Running the same command again trains the whole run.
        plan = self.plan("early", steps=8)
        p = subprocess.Popen([os.path.join(BIN, "tessel-train"), plan], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        out = [p.stdout.readline()]
        p.send_signal(signal.SIGTERM)
        out.append(p.communicate(timeout=120)[0])
        out = "".join(out)
        self.assertEqual(p.returncode, STOPPED, out)
        self.assertRegex(out, r"stopped on SIGTERM during start-up \(.+\), before step 1: nothing was trained", out)
        self.assertNotRegex(out, r"step +1/", out)
        self.assertFalse(os.path.exists(self.path("early", "checkpoints", "latest")), out)
        subprocess.run([os.path.join(BIN, "tessel-train"), plan], check=True, capture_output=True, timeout=300)
        self.assertEqual(self.losses("early")[-1][0], 8)

    def alone(self, rank, world, port, plan):
        """Rank `rank` of `world` started by hand (no launcher): the others are not there."""
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return subprocess.Popen([os.path.join(BIN, "tessel-train"), plan], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)

    def test_a_signal_while_waiting_for_the_other_ranks_stops_every_rank(self):
        # Ranks 0 and 1 of 3 started, rank 2 never: they wait for it (parallel.timeout_s 120).
        # SIGTERM to rank 1 alone stops it within a second, and rank 0 with it, both with exit 75
        # (before: both waited the whole timeout and then failed with exit 2).
        plan = self.plan("wait", parallel={"timeout_s": 120})
        port = free_port()
        r0 = self.alone(0, 3, port, plan)
        time.sleep(1)
        r1 = self.alone(1, 3, port, plan)
        time.sleep(4)  # both in the start-up agreement by now
        t0 = time.monotonic()
        r1.send_signal(signal.SIGTERM)
        out1 = r1.communicate(timeout=60)[0]
        out0 = r0.communicate(timeout=60)[0]
        took = time.monotonic() - t0
        print(f"\nSIGTERM to rank 1 of 3 while waiting for rank 2: ranks 0 and 1 out with "
              f"{r0.returncode}/{r1.returncode} in {took:.1f} s (timeout_s 120)", file=sys.stderr)
        self.assertEqual(r1.returncode, STOPPED, out1)
        self.assertEqual(r0.returncode, STOPPED, out0)
        self.assertIn("stopped on SIGTERM during start-up (waiting for every rank to start)", out1)
        self.assertIn("stopping because rank 1 stopped on SIGTERM during start-up", out0)
        self.assertLess(took, 15)

    def test_a_signal_to_one_rank_of_four_stops_every_rank_after_one_step(self):
        # dp2 x pp2; SIGUSR1 to rank 3 only (not the launcher, which would pass it to all). The ranks
        # agree through the votes in the gradient-norm all-reduce: every rank stops after the same
        # step, the checkpoint of that step is complete, and the resumed run equals an
        # uninterrupted one bitwise. (The old agreement through the store could leave ranks apart
        # by more steps than it allowed for under NCCL.)
        layout = {"dp": 2, "pp": 2}
        subprocess.run(self.launcher(self.plan("full4", parallel=layout), world=4), check=True,
                       capture_output=True, timeout=300)
        cut = self.plan("cut4", parallel=layout)
        p = subprocess.Popen(self.launcher(cut, world=4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        out = []
        for line in iter(p.stdout.readline, ""):
            out.append(line)
            if re.search(r"step +8/", line):
                os.kill(worker_pid(p.pid, rank=3), signal.SIGUSR1)
                break
        out.append(p.communicate(timeout=120)[0])
        out = "".join(out)
        self.assertEqual(p.returncode, STOPPED, out)
        steps = {int(r): int(s) for r, s in re.findall(r"\[rank (\d)\].*stopped after step (\d+) on a signal", out)}
        self.assertEqual(sorted(steps), [0, 1, 2, 3], out)
        self.assertEqual(len(set(steps.values())), 1, f"ranks stopped after different steps: {steps}")
        saved = steps[0]
        ckpt = self.path("cut4", "checkpoints")
        with open(os.path.join(ckpt, "latest")) as f:
            self.assertEqual(f.read().strip(), f"step_{saved}")
        step_dir = os.path.join(ckpt, f"step_{saved}")
        self.assertTrue(os.path.exists(os.path.join(step_dir, "COMPLETE")), os.listdir(step_dir))
        with open(os.path.join(step_dir, "index.json")) as f:
            named = set(re.findall(r"rank_\d+\.safetensors", f.read()))
        self.assertTrue(named and all(os.path.exists(os.path.join(step_dir, n)) for n in named), named)
        subprocess.run(self.launcher(cut, world=4), check=True, capture_output=True, timeout=300)  # resume
        self.assertEqual(self.losses("cut4"), self.losses("full4"), "resumed after the signal: not bitwise")
        print(f"\nSIGUSR1 to rank 3 of 4 (dp2 x pp2) at step 8: all four stopped after step {saved}, "
              f"checkpoint complete; the resumed run equals the uninterrupted one bitwise", file=sys.stderr)

    def test_ctrl_c_saves_and_a_second_one_ends_at_once(self):
        # Ctrl-C (SIGINT) used to kill a run with nothing saved; now it saves like SIGTERM. A
        # second one while the save is pending takes the default action (the user means it).
        code, out = self.interrupt([os.path.join(BIN, "tessel-train"), self.plan("int")], signal.SIGINT)
        self.assertEqual(code, STOPPED, out)
        self.assertRegex(out, r"stopped after step \d+ on a signal, its checkpoint saved; exit 75")
        self.assertTrue(os.path.exists(self.path("int", "checkpoints", "latest")))
        # Steps of a few hundred ms, so that the second signal comes while the first is pending
        # (two sent at once would merge into one).
        slow = self.plan("twice", steps=400, model={"layers": 6, "hidden": 256, "heads": 4})
        p = subprocess.Popen([os.path.join(BIN, "tessel-train"), slow, "--set", "training.seq_len=64"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in iter(p.stdout.readline, ""):
            if re.search(r"step +3/", line):
                p.send_signal(signal.SIGINT)
                time.sleep(0.05)
                p.send_signal(signal.SIGINT)
                break
        out = p.communicate(timeout=60)[0]
        self.assertEqual(p.returncode, -signal.SIGINT, out)
        self.assertNotIn("saved a checkpoint on a signal", out)

    def test_sigusr1_alone_and_requeue_under_slurm(self):
        # One process: SIGUSR1 saves after the current step.
        code, out = self.interrupt([os.path.join(BIN, "tessel-train"), self.plan("alone")], signal.SIGUSR1)
        self.assertEqual(code, STOPPED, out)
        self.assertTrue(os.path.exists(self.path("alone", "checkpoints", "latest")))
        # Under Slurm the launcher requeues the job (a stand-in scontrol records the call).
        fake = self.path("bin")
        os.makedirs(fake)
        with open(os.path.join(fake, "scontrol"), "w") as f:
            f.write(f"#!/bin/sh\necho \"$@\" > {self.path('scontrol.args')}\n")
        os.chmod(os.path.join(fake, "scontrol"), 0o755)
        env = {"SLURM_JOB_ID": "4242", "PATH": fake + os.pathsep + os.environ["PATH"]}
        code, out = self.interrupt(self.launcher(self.plan("slurm", parallel={"dp": 2}), env=env), signal.SIGUSR1,
                                   env=env)
        self.assertEqual(code, STOPPED, out)
        with open(self.path("scontrol.args")) as f:
            self.assertEqual(f.read().strip(), "requeue 4242")

    def test_pruning_keeps_this_runs_lineage(self):
        run("tessel-train", self.plan("q", steps=30))  # step_10, step_20, step_30
        for leftover in ("step_15.tmp", "step_5.pruned"):  # an interrupted save and prune
            os.makedirs(self.path("q", "checkpoints", leftover, "sub"))
        # Continue from step_10 to step 20 with keep=1: the new step_20 must survive and `latest`
        # name it; step_30 belongs to the abandoned timeline and is left alone.
        run("tessel-train", self.plan("q", steps=20, checkpoint={"every": 10, "keep": 1,
                                                               "resume": self.path("q", "checkpoints", "step_10"),
                                                               "accept_changes": ["training.steps"]}))
        ckpts = self.path("q", "checkpoints")
        with open(os.path.join(ckpts, "latest")) as f:
            self.assertEqual(f.read().strip(), "step_20")
        self.assertEqual(sorted(d for d in os.listdir(ckpts) if d.startswith("step_")), ["step_20", "step_30"])
        self.assertEqual(sorted(os.listdir(ckpts)), ["latest", "step_20", "step_30"])

    def test_resume_under_a_changed_plan(self):
        # A changed training.steps used to re-shape the cosine schedule without a word (lr jumped
        # at the resumed step) and the log said "seeded init" while resuming.
        run("tessel-train", self.plan("c", steps=20))  # step_10, step_20
        step10 = self.path("c", "checkpoints", "step_10")
        lines_before = len(self.losses("c"))
        # Changes that alter the run are refused before any work, each named with its values.
        p = run("tessel-train", self.plan("c", steps=40, run={"seed": 9}, checkpoint={"resume": step10}),
                "--set", "logging.every=2", check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"resuming from {step10}, this plan changes what the run trains (the checkpoint was saved "
                      f"under {step10}/config.yaml):", p.stderr)
        self.assertIn("\n  run.seed: 1 -> 9\n", p.stderr)
        self.assertRegex(p.stderr, r"\n  training.steps: 20 -> 40 \(lr at step 11: 0.001\d* under the checkpoint's "
                                   r"plan, 0.002\d* under this one\)")
        self.assertIn("--set 'checkpoint.accept_changes=[run.seed,training.steps]'", p.stderr)
        self.assertNotIn("logging.every", p.stderr)  # free: not among the refused
        self.assertEqual(len(self.losses("c")), lines_before, "the refused run trained")
        # Accepted: the run goes on from step 11 with the data position carried over and the new
        # schedule's lr; every difference is printed, free ones with why they are free.
        p = run("tessel-train", self.plan("c", steps=40, checkpoint={"resume": step10,
                                                                     "accept_changes": ["training.steps"]}),
                "--set", "logging.every=2")
        out = p.stdout + p.stderr
        self.assertIn("resume: the plan differs from the checkpoint's", out)
        self.assertIn("\n  logging.every: 1 -> 2 (logging)", out)
        self.assertRegex(out, r"\n  training.steps: 20 -> 40 \(alters the run; accepted by checkpoint.accept_changes\)"
                              r" \(lr at step 11: 0.001\d* under the checkpoint's plan, (0.002\d*) under this one\)")
        new_lr = float(re.search(r"(0\.002\d*) under this one", out).group(1))
        self.assertIn(f"weights from checkpoint {step10}", out)
        self.assertNotIn("seeded init", out)
        at12 = next(m for m in read_metrics(self.path("c", "metrics.jsonl")) if m.get("step") == 12)
        self.assertAlmostEqual(at12["lr"], lr_at(12, 3e-3, 2, 40), delta=1e-9)
        self.assertAlmostEqual(lr_at(11, 3e-3, 2, 40), new_lr, delta=new_lr * 1e-3)
        # Free changes alone (checkpointing, logging): the run goes on as it was, bitwise.
        run("tessel-train", self.plan("g", steps=20))
        uninterrupted = self.losses("g")
        p = run("tessel-train", self.plan("g", steps=20, checkpoint={"every": 5, "resume": self.path("g", "checkpoints", "step_10")},
                                          logging={"every": 1, "tensorboard": False}))
        self.assertIn("\n  checkpoint.every: 10 -> 5 (checkpointing)", p.stdout + p.stderr)
        self.assertEqual(len(uninterrupted), 20)
        self.assertEqual(self.losses("g"), uninterrupted)

    def test_missing_latest_refuses_to_start_over(self):
        path = self.plan("m", steps=10)
        run("tessel-train", path)
        os.remove(self.path("m", "checkpoints", "latest"))
        p = run("tessel-train", path, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("holds complete checkpoints (step_10) but no 'latest' file", p.stderr)
        self.assertTrue(os.path.exists(self.path("m", "checkpoints", "step_10", "COMPLETE")))

    def test_incomplete_shards_are_refused(self):
        # A ZeRO-3 checkpoint over 2 ranks: each parameter in two pieces. Drop one piece.
        path = self.plan("z", steps=10, parallel={"dp": 2, "zero": 3})
        subprocess.run(self.launcher(path), check=True, capture_output=True, timeout=300)
        index_path = self.path("z", "checkpoints", "step_10", "index.json")
        with open(index_path) as f:
            index = json.load(f)
        name = next(n for n, t in index["tensors"].items() if len(t["shards"]) == 2)  # split over the ranks
        index["tensors"][name]["shards"].pop()
        with open(index_path, "w") as f:
            json.dump(index, f)
        p = run("tessel-train", self.plan("z1", steps=20, checkpoint={"resume": self.path("z", "checkpoints"),
                                                                             "accept_changes": ["training.steps"]}),
                check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, rf"the shards of '{re.escape(name)}' cover \d+ of its \d+ elements")

    def test_corrupt_checkpoint_files_are_refused(self):
        path = self.plan("c", steps=10)
        run("tessel-train", path)
        files = self.path("c", "checkpoints", "step_10")
        shard = os.path.join(files, "rank_00000.safetensors")
        with open(shard, "r+b") as f:  # one flipped bit in the tensor data
            f.seek(os.path.getsize(shard) - 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
        resume = self.plan("c2", steps=20, checkpoint={"resume": files, "accept_changes": ["training.steps"]})
        p = run("tessel-train", resume, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, rf"{re.escape(shard)}: corrupt checkpoint file: \d+ bytes with checksum [0-9a-f]{{16}}, "
                                   rf"but \d+ bytes with checksum [0-9a-f]{{16}} when it was written")
        with open(shard, "r+b") as f:  # truncated
            f.truncate(os.path.getsize(shard) - 8)
        p = run("tessel-train", resume, check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, r"corrupt checkpoint file: \d+ bytes, but \d+ bytes with checksum")
        self.assertEqual([n for n in os.listdir(self.path("c2", "checkpoints")) if n.startswith("step_")]
                         if os.path.isdir(self.path("c2", "checkpoints")) else [], [], "nothing saved from a refused resume")
        # An index without the checksum list (an old checkpoint, or an edited index) used to load
        # without any verification: now refused, naming the file, and export refuses it too.
        run("tessel-train", self.plan("u", steps=10))
        unverified = self.path("u", "checkpoints", "step_10")
        with open(os.path.join(unverified, "index.json")) as f:
            index = json.load(f)
        del index["files"]
        with open(os.path.join(unverified, "index.json"), "w") as f:
            json.dump(index, f)
        for args in ([self.plan("u2", steps=20, checkpoint={"resume": unverified, "accept_changes": ["training.steps"]})],
                     ["export", unverified, "--out", self.path("u_hf")]):
            p = run("tessel-train", *args, check=False)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn("index.json records no size and checksum for rank_00000.safetensors, so it cannot be "
                          "verified", p.stderr)
        self.assertEqual([n for n in os.listdir(self.path("u2", "checkpoints")) if n.startswith("step_")]
                         if os.path.isdir(self.path("u2", "checkpoints")) else [], [], "nothing saved from a refused resume")

    def test_ranks_with_different_plans_stop(self):
        os.rename(self.plan("same", steps=5), self.path("a.yaml"))
        os.rename(self.plan("same", steps=5, training={"optimizer": {"lr": 1e-3}}), self.path("b.yaml"))
        port = free_port()
        procs = []
        for r, path in ((0, self.path("a.yaml")), (1, self.path("b.yaml"))):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([os.path.join(BIN, "tessel-train"), path], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        t0 = time.time()
        errs = [p.communicate(timeout=60)[1] for p in procs]
        self.assertLess(time.time() - t0, 30)
        self.assertEqual([p.returncode for p in procs], [2, 2], errs)
        self.assertIn("training.optimizer.lr: 0.001 (rank 1) vs 0.003 (rank 0)", errs[1])
        self.assertIn("rank 1 differs from rank 0", errs[0])

    def test_metrics_write_errors_and_thread_counts_are_reported(self):
        p = run("tessel-train", self.plan("full_disk", steps=3, logging={"metrics_file": "/dev/full"}), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("/dev/full: cannot write metrics: No space left on device", p.stderr)
        p = run("tessel-train", self.plan("threads", steps=3, training={"threads": 100000}), check=False)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, r"training.threads \(100000\) is more than this machine's \d+ hardware threads")


if __name__ == "__main__":
    unittest.main()
