"""Open MPI's mpirun starting tessel-train directly: dp=2 matches the single-process run."""
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
from common import (BIN, TmpDirTest, base_plan, read_metrics, rel, run, write_plan, write_tokens, free_port)  # noqa: E402


class MpiRun(TmpDirTest):
    def test_dp2_matches_single_process(self):
        self.assertTrue(shutil.which("mpirun"), "mpirun is missing: `make test` installs Debian's openmpi-bin")
        plan = base_plan(self.tmp, "llama", write_tokens(self.path("d.u16"), 4000, period=29), steps=10,
                         global_batch=8, micro_batch=2, threads=1)
        plan["data"]["shuffle"] = True
        path = write_plan(self.path("p.yaml"), plan)
        run("tessel-train", path, "--set", f"run.output_dir={self.path('single')}")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_plm_rsh_agent="false")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        p = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", f"MASTER_PORT={free_port()}",
                            os.path.join(BIN, "tessel-train"), path, "--set", f"run.output_dir={self.path('mpi')}"],
                           capture_output=True, text=True, timeout=300, env=env)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("2 processes (Open MPI, gloo): dp 2", p.stdout + p.stderr)
        a = [m["loss"] for m in read_metrics(self.path("single", "metrics.jsonl"))]
        b = [m["loss"] for m in read_metrics(self.path("mpi", "metrics.jsonl"))]
        self.assertEqual(len(b), 10)
        worst = max(rel(x, y) for x, y in zip(b, a, strict=True))
        self.assertLess(worst, 1e-5)
        print(f"\nmpirun dp=2: worst loss rel diff {worst:.2e} over 10 steps", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
