"""tessel-launch: environment contract, teardown on failure, restart budget, signal forwarding."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import base_plan, free_port, read_metrics, write_plan, write_tokens  # noqa: E402

BIN = os.environ.get("TESSEL_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin"))
LAUNCH = os.path.join(BIN, "tessel-launch")
CONTRACT = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TESSEL_RESTART_COUNT", "OMP_NUM_THREADS"]


def launch(*args, worker, timeout=120, env=None):
    return subprocess.run([LAUNCH, *map(str, args), "--", sys.executable, "-c", worker], capture_output=True,
                          text=True, timeout=timeout, env=env)


DUMP_ENV = f"import json, os; print('ENV ' + json.dumps({{k: os.environ.get(k) for k in {CONTRACT!r}}}))"


def envs(stdout):
    return [json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV " in line]


class Launcher(unittest.TestCase):
    def setUp(self):
        self._tmp = tempfile.TemporaryDirectory(prefix="tessel-launch-")
        self.tmp = self._tmp.name

    def tearDown(self):
        self._tmp.cleanup()

    def test_contract_one_node(self):
        bare = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        for n in (1, 4):
            port = free_port()
            p = launch("--nproc-per-node", n, "--master-port", port, "--log-dir", self.tmp, worker=DUMP_ENV, env=bare)
            self.assertEqual(p.returncode, 0, p.stderr)
            got = sorted(envs(p.stdout), key=lambda e: int(e["RANK"]))
            self.assertEqual([e["RANK"] for e in got], [str(i) for i in range(n)])
            for e in got:
                self.assertEqual(e["LOCAL_RANK"], e["RANK"])
                self.assertEqual((e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]), (str(n), str(n), "0"))
                self.assertEqual((e["MASTER_ADDR"], e["MASTER_PORT"]), ("127.0.0.1", str(port)))
                self.assertEqual(e["TESSEL_RESTART_COUNT"], "0")
                self.assertEqual(e["OMP_NUM_THREADS"], "1" if n > 1 else None)
            # Console lines carry [rank N]; each rank has its own log file.
            self.assertTrue(all(line.startswith("[rank ") for line in p.stdout.splitlines() if line))
            with open(os.path.join(self.tmp, f"rank_{n - 1}.log")) as f:
                self.assertIn("ENV ", f.read())
        # A value the user chose is kept.
        p = launch("--nproc-per-node", 2, "--master-port", free_port(), worker=DUMP_ENV,
                   env=dict(bare, OMP_NUM_THREADS="3"))
        self.assertEqual({e["OMP_NUM_THREADS"] for e in envs(p.stdout)}, {"3"})

    def test_contract_two_nodes(self):
        port = free_port()
        procs = [subprocess.Popen([LAUNCH, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(r),
                                   "--master-addr", "127.0.0.1", "--master-port", str(port), "--", sys.executable,
                                   "-c", DUMP_ENV], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            self.assertEqual(p.returncode, 0, err)
        got = {e["RANK"]: e for out, _ in outs for e in envs(out)}
        self.assertEqual(sorted(got), ["0", "1", "2", "3"])
        for r, e in got.items():
            self.assertEqual(e["GROUP_RANK"], str(int(r) // 2))
            self.assertEqual(e["LOCAL_RANK"], str(int(r) % 2))
            self.assertEqual((e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]), ("4", "2"))

    def test_kill_9_ends_everything(self):
        # Rank 2 dies by SIGKILL while the others wait (as if blocked in a collective).
        worker = ("import os, signal, time\n"
                  "open(os.path.join(%r, 'pid_' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                  "time.sleep(2)\n"
                  "if os.environ['RANK'] == '2': os.kill(os.getpid(), signal.SIGKILL)\n"
                  "time.sleep(300)\n") % self.tmp
        t0 = time.time()
        p = launch("--nproc-per-node", 4, "--master-port", free_port(), "--grace-s", 5, worker=worker, timeout=60)
        self.assertLess(time.time() - t0, 35)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("failure: rank 2 (host", p.stderr)
        self.assertIn("killed by signal 9", p.stderr)
        for r in range(4):
            pid = int(open(os.path.join(self.tmp, f"pid_{r}")).read())
            self.assertFalse(os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower(),
                             f"rank {r} still runs")

    def test_restart_budget(self):
        worker = "import os, sys; print('attempt', os.environ['TESSEL_RESTART_COUNT']); sys.exit(3 if os.environ['RANK'] == '1' else 0)"
        p = launch("--nproc-per-node", 2, "--master-port", free_port(), "--max-restarts", 2, worker=worker)
        self.assertNotEqual(p.returncode, 0)
        attempts = [line for line in p.stdout.splitlines() if line.startswith("[rank 1] attempt")]
        self.assertEqual(attempts, ["[rank 1] attempt 0", "[rank 1] attempt 1", "[rank 1] attempt 2"])
        self.assertEqual(p.stderr.count("restarting every worker"), 2)
        self.assertIn("rank 1 (host", p.stderr)
        self.assertIn("exited with code 3", p.stderr)
        self.assertIn("giving up after 2 restarts", p.stderr)

    def test_a_plan_error_is_not_restarted(self):
        # Exit 2 is an error in the plan or its inputs: the same command fails again. It used to
        # be restarted --max-restarts times.
        worker = "import os, sys; print('attempt', os.environ['TESSEL_RESTART_COUNT']); sys.exit(2)"
        p = launch("--nproc-per-node", 2, "--max-restarts", 2, worker=worker)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertNotIn("attempt 1", p.stdout)
        self.assertIn("not restarting (an error in the plan or its inputs: restarting cannot help)", p.stderr)

    def test_one_node_picks_a_free_port(self):
        # No --master-port on one node: a free pair is chosen and said, so two jobs on one node
        # do not meet at 29500 (both used to take it).
        import socket
        held = socket.socket()
        try:
            held.bind(("127.0.0.1", 29500))  # a job already there
            held.listen()
        except OSError:
            pass  # taken already
        try:
            p = launch("--nproc-per-node", 2, worker=DUMP_ENV)
        finally:
            held.close()
        self.assertEqual(p.returncode, 0, p.stderr)
        port = int(envs(p.stdout)[0]["MASTER_PORT"])
        self.assertNotEqual(port, 29500)
        self.assertIn(f"master 127.0.0.1:{port}", p.stderr)
        self.assertIn("free port chosen", p.stderr)

    def test_two_jobs_given_one_port_do_not_meet(self):
        # The second job's rank 1 used to join the first job's store and stop it (at step 135 of
        # 300). Now the second launcher refuses the port before any fork, and a worker that
        # reaches another job's store anyway (started by hand, or a race) stops naming it; the
        # first job trains every step.
        # The first job runs long enough to be alive through both attempts; it is then stopped
        # by SIGTERM and saves (exit 75), having lost nothing.
        data = write_tokens(os.path.join(self.tmp, "d.u16"), 20000, period=37)
        plan = base_plan(self.tmp, "gpt2", data, steps=100000, global_batch=4, micro_batch=1, threads=1)
        plan["run"]["output_dir"] = os.path.join(self.tmp, "a")
        plan["parallel"] = {"dp": 2}
        path = write_plan(os.path.join(self.tmp, "a.yaml"), plan)
        train = os.path.join(BIN, "tessel-train")
        port = free_port()
        first = subprocess.Popen([LAUNCH, "--nproc-per-node", "2", "--master-port", str(port), "--", train, path],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = []
        for line in iter(first.stdout.readline, ""):
            out.append(line)
            if "step" in line and " 2/100000" in line:
                break
        p = launch("--nproc-per-node", 2, "--master-port", port, worker=DUMP_ENV)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn(f"--master-port {port}: port {port} is in use on this node", p.stderr)
        self.assertEqual(envs(p.stdout), [], "a worker was started")
        plan["run"]["output_dir"] = os.path.join(self.tmp, "b")
        other = dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TESSEL_JOB_ID="another-job")
        q = subprocess.run([train, write_plan(os.path.join(self.tmp, "b.yaml"), plan)], capture_output=True,
                           text=True, timeout=120, env=other)
        self.assertEqual(q.returncode, 2, q.stderr)
        self.assertIn(f"rendezvous at 127.0.0.1:{port} belongs to another job", q.stderr)
        self.assertIsNone(first.poll(), "the first job ended while the second tried its port")
        first.send_signal(signal.SIGTERM)
        out.append(first.communicate(timeout=300)[0])
        self.assertEqual(first.returncode, 75, "".join(out)[-3000:])

    def test_workers_are_bounded_by_the_machine(self):
        # --nproc-per-node 100000 used to fork until the machine gave out.
        t0 = time.time()
        p = launch("--nproc-per-node", 100000, worker=DUMP_ENV)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertRegex(p.stderr, r"--nproc-per-node 100000 is more than this node runs \(\d+ cores, \d+ GPUs: "
                                   r"at most \d+ workers\); give --oversubscribe")
        self.assertEqual(envs(p.stdout), [])
        self.assertLess(time.time() - t0, 10)
        p = launch("--nproc-per-node", 4 * os.cpu_count() + 1, "--oversubscribe", worker="pass")
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_restart_budget_is_job_wide(self):
        # Rank 3 (on node 1) keeps failing: both launchers restart together, once, then give up.
        worker = ("import os, sys, time; print('attempt', os.environ['TESSEL_RESTART_COUNT'], flush=True)\n"
                  "time.sleep(1)  # every worker has printed before the failure tears them down\n"
                  "if os.environ['RANK'] == '3': sys.exit(5)\n"
                  "time.sleep(300)\n")
        port = free_port()
        procs = [subprocess.Popen([LAUNCH, "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(r),
                                   "--master-port", str(port), "--max-restarts", "1", "--grace-s", "3", "--",
                                   sys.executable, "-c", worker], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("failure: rank 3 (host", err)
            self.assertIn("exited with code 5", err)
            self.assertEqual(err.count("restarting every worker"), 1, err)
        attempts = sorted(line for out, _ in outs for line in out.splitlines() if "attempt" in line)
        self.assertEqual(attempts, sorted(f"[rank {r}] attempt {a}" for r in range(4) for a in (0, 1)))

    def test_sigterm_reaches_every_worker(self):
        worker = ("import os, signal, sys, time\n"
                  "def bye(s, f):\n"
                  "    open(os.path.join(%r, 'term_' + os.environ['RANK']), 'w').write('got')\n"
                  "    sys.exit(0)\n"
                  "signal.signal(signal.SIGTERM, bye)\n"
                  "print('ready', flush=True)\n"
                  "time.sleep(300)\n") % self.tmp
        p = subprocess.Popen([LAUNCH, "--nproc-per-node", "3", "--master-port", str(free_port()), "--", sys.executable,
                              "-c", worker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = 0
        while ready < 3:
            line = p.stdout.readline()
            self.assertTrue(line, "the launcher ended early")
            ready += "ready" in line
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        self.assertEqual(p.returncode, 128 + signal.SIGTERM)
        self.assertEqual(sorted(f for f in os.listdir(self.tmp) if f.startswith("term_")), ["term_0", "term_1", "term_2"])

    def test_torchrun_runs_tessel_train(self):
        # torchrun --no-python starts the binary itself; its MASTER_PORT is the elastic agent's
        # store (every rank a client, keys per restart attempt). The same losses as tessel-launch.
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        data = write_tokens(os.path.join(self.tmp, "d.u16"), 20000, period=37)
        losses = {}
        for how in ("tessel-launch", "torchrun"):
            plan = base_plan(self.tmp, "gpt2", data, steps=4, global_batch=4, micro_batch=1, threads=1)
            plan["run"]["output_dir"] = os.path.join(self.tmp, how)
            plan["parallel"] = {"dp": 2}
            path = write_plan(os.path.join(self.tmp, how + ".yaml"), plan)
            train = os.path.join(BIN, "tessel-train")
            cmd = ([LAUNCH, "--nproc-per-node", "2", "--master-port", str(free_port()), "--", train, path]
                   if how == "tessel-launch" else
                   [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", train, path])
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            losses[how] = [m["loss"] for m in read_metrics(os.path.join(self.tmp, how, "metrics.jsonl")) if "loss" in m]
        self.assertEqual(len(losses["torchrun"]), 4)
        self.assertEqual(losses["torchrun"], losses["tessel-launch"])


if __name__ == "__main__":
    unittest.main()
