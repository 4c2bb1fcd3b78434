"""Fail fast and name the culprit: every wait has a deadline and honours signals, a rank that fails
its start-up checks stops every rank at once, a stopped (hung) rank is named rather than the healthy
one, errors carry no C++ backtrace, and two trainers cannot share a run folder. Each case failed
(waited out a timeout, blamed the wrong rank, or went ahead) on the main before these changes."""
import os
import re
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import BIN, TmpDirTest, base_plan, free_port, run, write_plan, write_tokens  # noqa: E402

LAUNCH = os.path.join(BIN, "tessel-launch")
TRAIN = os.path.join(BIN, "tessel-train")


def no_backtrace(tc, text):
    tc.assertNotRegex(text, r"Exception raised from|frame #\d+|\(no backtrace available\)")


class FailFast(TmpDirTest):
    def setUp(self):
        super().setUp()
        self.data = write_tokens(self.path("d.u16"), 200000, period=37)

    def plan(self, name, steps=100000, **parallel):
        plan = base_plan(self.tmp, "gpt2", self.data, steps=steps, global_batch=2, micro_batch=1, threads=1)
        plan["run"]["output_dir"] = self.path(name)
        plan["parallel"] = parallel
        return write_plan(self.path(name + ".yaml"), plan)

    def training(self, *args):
        """Starts one trainer and returns it once it has logged step 2 (its locks are held)."""
        p = subprocess.Popen([TRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in iter(p.stdout.readline, ""):
            if re.search(r"step +2/", line):
                break
        return p

    def ranks(self, paths_and_args, port=None):
        """Starts tessel-train once per rank (no launcher), rank r with paths_and_args[r]."""
        port = port or free_port()
        procs = []
        for r, args in enumerate(paths_and_args):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(len(paths_and_args)), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(len(paths_and_args)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([TRAIN, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        return procs

    # --- the launcher's waits ---------------------------------------------------------------------

    def test_launcher_waits_have_deadlines_and_honour_signals(self):
        port = free_port()
        # Node 1 without node 0: gives up after --rdzv-timeout-s, naming node 0's address.
        t0 = time.time()
        p = subprocess.run([LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
                            "--rdzv-timeout-s", "3", "--", "true"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertLess(time.time() - t0, 20)
        self.assertIn(f"node 1: cannot reach node 0's launcher at 127.0.0.1:{port + 1} within 3 s", p.stderr)
        no_backtrace(self, p.stderr)
        # Node 0 without node 1: names the node that did not come.
        p = subprocess.run([LAUNCH, "--nnodes", "2", "--node-rank", "0", "--master-port", str(port),
                            "--rdzv-timeout-s", "2", "--", "true"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("node 1 did not come", p.stderr)
        # SIGTERM while waiting: out at once (it used to wait 900 s).
        for rank in ("0", "1"):
            q = subprocess.Popen([LAUNCH, "--nnodes", "2", "--node-rank", rank, "--master-port", str(free_port()),
                                  "--", "true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(1.5)
            t0 = time.time()
            q.send_signal(signal.SIGTERM)
            _, err = q.communicate(timeout=30)
            self.assertEqual(q.returncode, 128 + signal.SIGTERM, err)
            self.assertLess(time.time() - t0, 5)
            print(f"\nnode {rank} waiting for the other node: out {time.time() - t0:.2f} s after SIGTERM",
                  file=sys.stderr)
            self.assertIn("nothing started", err)
        # A master name that does not resolve: said at once.
        p = subprocess.run([LAUNCH, "--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid",
                            "--", "true"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("master address 'no-such-host.invalid' (--master-addr) does not resolve", p.stderr)

    # --- start-up -----------------------------------------------------------------------------------

    def test_a_rank_failing_its_start_up_checks_stops_every_rank(self):
        path = self.plan("a", steps=3, dp=2, timeout_s=300)
        t0 = time.time()
        procs = self.ranks([[path], [path, "--set", "training.threads=100000"]])
        errs = [p.communicate(timeout=120)[1] for p in procs]
        took = time.time() - t0
        self.assertLess(took, 30)  # not parallel.timeout_s (300 s)
        print(f"\nrank 1 failed its start-up checks: both ranks out in {took:.1f} s (timeout_s 300)",
              file=sys.stderr)
        self.assertEqual([p.returncode for p in procs], [2, 2], errs)
        self.assertIn("training.threads (100000) is more than", errs[1])
        self.assertIn("1 of 2 ranks failed their start-up checks, so none starts; rank 1:", errs[0])
        # A plan that does not even load on one rank: the same.
        procs = self.ranks([[path], [self.path("missing.yaml")]])
        errs = [p.communicate(timeout=120)[1] for p in procs]
        self.assertEqual([p.returncode for p in procs], [2, 2], errs)
        self.assertRegex(errs[0], r"failed their start-up checks, so none starts; rank 1: .*missing.yaml")
        for e in errs:
            no_backtrace(self, e)

    def test_a_rank_that_never_comes_is_named(self):
        path = self.plan("b", steps=3, dp=2, timeout_s=3)
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        p = subprocess.run([TRAIN, path], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("rank 0: waited parallel.timeout_s (3 s)", p.stderr)
        self.assertIn("for every rank to start; rank 1 did not", p.stderr)

    # --- during the run ----------------------------------------------------------------------------

    def start_pair(self, name, timeout_s):
        procs = self.ranks([[self.plan(name, dp=2, timeout_s=timeout_s)]] * 2)
        for line in iter(procs[0].stdout.readline, ""):
            if re.search(r"step +3/", line):
                break
        return procs

    def test_a_stopped_rank_is_named(self):
        procs = self.start_pair("stop", timeout_s=3)
        procs[1].send_signal(signal.SIGSTOP)
        _, err = procs[0].communicate(timeout=60)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
        self.assertEqual(procs[0].returncode, 1, err)
        # Rank 0's collective timed out, and the message names rank 1 as the cause.
        self.assertRegex(err, r"at rank 0 failed")
        self.assertRegex(err, r"rank 1 stopped responding \(no heartbeat for 3 s: stopped, hung, dead, or its host "
                              r"is unreachable\)")
        no_backtrace(self, err)
        print("\n" + err.strip()[-400:], file=sys.stderr)

    def test_a_stopped_rank_0_is_named_and_the_others_exit(self):
        # Rank 0 also serves the store: the others name it and exit (no wait on its store).
        procs = self.start_pair("stop0", timeout_s=3)
        procs[0].send_signal(signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[1].communicate(timeout=90)
        took = time.time() - t0
        procs[0].send_signal(signal.SIGKILL)
        procs[0].communicate()
        self.assertEqual(procs[1].returncode, 1, err)
        self.assertIn("(served by rank 0) does not answer: rank 0 has stopped or died", err)
        self.assertLess(took, 45)
        print(f"\nrank 0 stopped: rank 1 named it and exited in {took:.1f} s (timeout_s 3)", file=sys.stderr)
        no_backtrace(self, err)

    def test_a_failing_rank_stops_the_others_at_once(self):
        # Rank 0 fails after its first step (its metrics file cannot be written); rank 1, waiting
        # in a collective, stops within seconds naming rank 0 and its error, instead of waiting
        # parallel.timeout_s and reporting a failed all-reduce.
        path = self.plan("fail", dp=2, timeout_s=300)
        os.makedirs(self.path("fail"))
        os.symlink("/dev/full", self.path("fail", "metrics.jsonl"))  # rank 0 writes the metrics
        procs = self.ranks([[path], [path]])
        t0 = time.time()
        errs = [p.communicate(timeout=120)[1] for p in procs]
        took = time.time() - t0
        self.assertLess(took, 60)
        print(f"\nrank 0 failed mid-run: rank 1 stopped naming it, both out in {took:.1f} s", file=sys.stderr)
        self.assertEqual([p.returncode for p in procs], [2, 1], errs)
        self.assertIn("metrics.jsonl: cannot write metrics: No space left on device", errs[0])
        self.assertRegex(errs[1], r"tessel-train\[rank 1\]: (error|internal error): stopping because rank 0 failed: ")
        self.assertIn("cannot write metrics", errs[1])
        for e in errs:
            no_backtrace(self, e)

    # --- the run folder ----------------------------------------------------------------------------

    def test_two_trainers_cannot_share_a_run_folder(self):
        path = self.plan("shared")
        first = self.training(path)
        p = run("tessel-train", path, check=False, timeout=60)
        first.kill()
        first.communicate()
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, rf"run.output_dir {re.escape(self.path('shared'))} is in use by another run "
                                   rf"\(pid {first.pid} on host \S+, started [0-9-]+ [0-9:]+\)")
        # The lock goes with the process, however it ended: the folder is usable again.
        p = run("tessel-train", path, "--set", "training.steps=2", check=False, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_two_runs_cannot_share_a_checkpoint_folder(self):
        # Different run folders, one checkpoint.dir: they used to overwrite each other's step
        # folders (and a same-shape resume would load the other run's weights).
        shared = self.path("ckpt")
        a, b = self.plan("a"), self.plan("b")
        first = self.training(a, "--set", f"checkpoint.dir={shared}")
        p = run("tessel-train", b, "--set", f"checkpoint.dir={shared}", check=False, timeout=60)
        first.kill()
        first.communicate()
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"checkpoint.dir {shared} is in use by another run", p.stderr)
        self.assertEqual(sorted(os.listdir(shared)), [], "the lock adds nothing to the checkpoint folder")
        self.assertFalse(os.path.exists(self.path("b", "metrics.jsonl")), "the refused run trained")

    def test_a_default_checkpoint_folder_named_by_another_run_is_locked(self):
        # Run A keeps its checkpoints in its default <output_dir>/checkpoints; run B names that
        # folder as checkpoint.dir. The two locks used to be on different objects (A's run folder,
        # B's checkpoint folder): both ran, and A's checkpoints ended up holding B's.
        a, b = self.plan("a"), self.plan("b")
        first = self.training(a)
        shared = self.path("a", "checkpoints")
        p = run("tessel-train", b, "--set", f"checkpoint.dir={shared}", check=False, timeout=60)
        first.kill()
        first.communicate()
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"checkpoint.dir {shared} is in use by another run", p.stderr)
        self.assertFalse(os.path.exists(self.path("b", "metrics.jsonl")), "the refused run trained")
        # And the other way round: B first, naming the folder A then takes by default.
        first = self.training(b, "--set", f"checkpoint.dir={shared}")
        p = run("tessel-train", a, check=False, timeout=60)
        first.kill()
        first.communicate()
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"checkpoint.dir {shared} is in use by another run", p.stderr)

    def test_a_run_folder_and_a_checkpoint_folder_crossed_are_locked(self):
        # Run A's run folder named by B as checkpoint.dir, and A's checkpoint folder named by B as
        # run.output_dir: the locks used to be of different kinds (a .lock file in a run folder,
        # the folder itself for checkpoints), so both runs went on writing into one folder.
        a, b = self.plan("a"), self.plan("b")
        first = self.training(a)
        crossed = [(["--set", f"checkpoint.dir={self.path('a')}"], f"checkpoint.dir {self.path('a')} is in use"),
                   (["--set", f"run.output_dir={self.path('a', 'checkpoints')}"],
                    f"run.output_dir {self.path('a', 'checkpoints')} is in use by another run")]
        for sets, message in crossed:
            p = run("tessel-train", b, *sets, check=False, timeout=60)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(message, p.stderr)
        first.kill()
        first.communicate()
        self.assertFalse(os.path.exists(self.path("a", "checkpoints", ".lock")), "a lock file in a checkpoint folder")
        self.assertFalse(os.path.exists(self.path("b", "metrics.jsonl")), "the refused run trained")
        # One folder in both roles, for one run, is its own: it trains.
        p = run("tessel-train", b, "--set", f"checkpoint.dir={self.path('b')}", "--set", "training.steps=2",
                check=False, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_an_unwritable_checkpoint_folder_fails_before_training(self):
        # checkpoint.dir=/proc/ck used to train every step and fail at the first save.
        p = run("tessel-train", self.plan("u", steps=5), "--set", "checkpoint.dir=/proc/ck", check=False,
                timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("checkpoint.dir /proc/ck: cannot write there (", p.stderr)
        self.assertFalse(os.path.exists(self.path("u", "metrics.jsonl")), "the refused run trained")

    def test_a_checkpoint_folder_without_room_for_one_checkpoint_fails_before_training(self):
        # A run whose checkpoint cannot fit used to train to its first save and fail there. This
        # plan's checkpoint needs about 9.4 TiB (644 G parameters x 16 bytes), more than any
        # filesystem of a test machine holds: refused at start-up, naming both figures.
        path = self.plan("big", steps=5)
        p = run("tessel-train", path, "--set", "model.hidden=16384", "--set", "model.heads=128",
                "--set", "model.layers=200", check=False, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, rf"checkpoint.dir {re.escape(self.path('big', 'checkpoints'))}: its filesystem "
                                   r"has [0-9.e+]+ GiB free, and one checkpoint of this plan needs about 9\.6e\+03 GiB "
                                   r"\(644\d{9} parameters x 16 bytes: weights in fp32, an fp32 master copy and two "
                                   r"fp32 AdamW moments\)")
        self.assertFalse(os.path.exists(self.path("big", "metrics.jsonl")), "the refused run trained")


if __name__ == "__main__":
    unittest.main()
