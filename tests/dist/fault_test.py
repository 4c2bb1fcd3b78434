"""A failed or timed-out collective names its group, operation, sequence number and rank; a crash
names its rank and signal and leaves its native stack."""
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import (BIN, TmpDirTest, base_plan, write_plan, write_tokens, free_port)  # noqa: E402


class CollectiveFaults(TmpDirTest):
    def start_pair(self, timeout_s):
        plan = base_plan(self.tmp, "gpt2", write_tokens(self.path("d.u16"), 200000), steps=100000, global_batch=2,
                         micro_batch=1, threads=1)
        plan["parallel"] = {"timeout_s": timeout_s}
        plan["logging"]["every"] = 1
        path = write_plan(self.path("p.yaml"), plan)
        port = free_port()
        procs = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([os.path.join(BIN, "tessel-train"), path], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        # Wait until training is under way (rank 0 logs steps).
        for line in iter(procs[0].stdout.readline, ""):
            if re.search(r"step +3/", line):
                break
        return procs

    def check_message(self, err):
        print("\n" + err.strip().splitlines()[-1][:300], file=sys.stderr)
        self.assertRegex(err, r"tessel-train\[rank 0\]: error: (all_reduce|barrier) #\d+ on group (dp_cp|mp|world)"
                              r"\.?\d* \(ranks \[0,1\]\) at rank 0 failed")

    def test_dead_peer(self):
        procs = self.start_pair(timeout_s=60)
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=60)
        procs[1].communicate()
        self.assertNotEqual(procs[0].returncode, 0)
        self.check_message(err)

    def test_stalled_peer_times_out(self):
        procs = self.start_pair(timeout_s=3)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        _, err = procs[0].communicate(timeout=60)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
        self.assertNotEqual(procs[0].returncode, 0)
        self.assertLess(time.time() - t0, 30)
        self.check_message(err)
        self.assertRegex(err.lower(), "timed out|timeout")


def no_core_dump():
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class CrashReport(unittest.TestCase):
    def test_a_fatal_signal_names_the_rank_and_leaves_a_stack(self):
        binary = os.path.join(BIN, "tessel-train")
        env = dict(os.environ, RANK="3", TESSEL_TEST_FATAL_SIGNAL=str(int(signal.SIGSEGV)))
        # In a folder of its own and without a core file: nothing lands in the checkout.
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.run([binary, "plan.yaml"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp,
                               preexec_fn=no_core_dump)
        self.assertEqual(p.returncode, -signal.SIGSEGV, p.stderr)  # still dies of the signal (and dumps)
        self.assertRegex(p.stderr, r"tessel-train\[rank 3\]: fatal signal 11 \(SIGSEGV, a bad memory access\); "
                                   r"native stack")
        offsets = re.findall(r"tessel-train\(\+(0x[0-9a-f]+)\)", p.stderr)
        self.assertGreaterEqual(len(offsets), 2, p.stderr)
        # The hint works: the binary's own frames are named, main among them.
        names = subprocess.run(["addr2line", "-Cfpe", binary, *offsets], capture_output=True, text=True).stdout
        self.assertIn("main at", names)
        self.assertIn("on_fatal", names)


class ForkedRanks(unittest.TestCase):
    """The tests' rank starter (TESSEL_TEST_FORK_RANKS, engine/cli/fork_ranks.h): every rank's
    failure named with its status, the first one the parent's exit status, and no rank outliving a
    killed parent."""

    def env(self, tmp, world):
        return dict(os.environ, TESSEL_TEST_FORK_RANKS="2", TESSEL_TEST_FORK_LOGS=tmp, WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()), TESSEL_RESTART_COUNT="0")

    def test_failed_ranks_are_named_and_a_killed_parent_takes_its_ranks(self):
        binary = os.path.join(BIN, "tessel-train")
        with tempfile.TemporaryDirectory() as tmp:
            plan = base_plan(tmp, "gpt2", write_tokens(os.path.join(tmp, "t.bin"), 4000))
            plan = write_plan(os.path.join(tmp, "plan.yaml"), dict(plan, parallel={"dp": 4}))
            p = subprocess.run([binary, plan], env=self.env(tmp, 2), capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertEqual(sorted(re.findall(r"rank (\d) exited 2", p.stderr)), ["0", "1"], p.stderr)
            for r in (0, 1):
                with open(os.path.join(tmp, f"rank{r}.log")) as f:
                    self.assertIn(f"tessel-train[rank {r}]: error: {plan}: world size (2) must equal", f.read())
            # Two ranks of a world of four wait for the two that never come; the parent killed, they go.
            p = subprocess.Popen([binary, plan], env=self.env(tmp, 4))
            time.sleep(1.5)
            ranks = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            self.assertEqual(len(ranks), 2)
            p.kill()
            p.wait()
            time.sleep(0.5)
            self.assertFalse([r for r in ranks if os.path.exists(f"/proc/{r}") and
                              open(f"/proc/{r}/stat").read().split()[2] != "Z"], "a rank outlived its parent")


if __name__ == "__main__":
    unittest.main()
