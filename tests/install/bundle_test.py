"""The installed bundle, as a user without root gets it: `cmake --install` packed and extracted
into a fresh folder; no file in it names this machine's build tree, checkout, caches or CUDA
toolkit, and its binaries' RUNPATH is relative; run as an unprivileged user (nobody, when the
test runs as root) with the build tree, the system CUDA toolkit and the system copies of
yaml-cpp/spdlog/fmt hidden, it trains configs/default.yaml for 8 steps with the same losses as
the build tree's binary, and its GPU check (bench/gpu-check.sh) runs end to end, reporting the GPU
parts as skipped."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest

BUILD = os.environ["TESSEL_BUILD"]
ROOT = os.environ["TESSEL_ROOT"]
PYTHON = os.environ["TESSEL_PYTHON"]
STEPS = 8  # the same run twice (build tree, bundle): its length proves nothing more
SETS = [f"training.steps={STEPS}", "training.schedule.warmup_steps=3", "training.eval_every=0", "logging.every=1", "checkpoint.every=0",
        "checkpoint.resume=never"]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def run_unprivileged(tmp, script, hide_build=True):
    """Runs a shell script as a user without root: nobody in a private mount namespace when this
    test runs as root (the build tree, the system CUDA toolkit and the system yaml-cpp, spdlog
    and fmt hidden; of the home only the torch environment and its base python visible), else
    as this user. Returns (exit code, output)."""
    path = os.path.join(tmp, "inner.sh")
    with open(path, "w") as f:
        f.write(script)
    if os.getuid() != 0:
        p = subprocess.run(["sh", path], capture_output=True, text=True, timeout=900)
        return p.returncode, p.stdout + p.stderr
    env_dir = os.path.realpath(os.path.join(os.path.dirname(PYTHON), ".."))
    base = subprocess.run([PYTHON, "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                          text=True, check=True).stdout.strip()
    home = os.path.expanduser("~")
    mounts = []
    fake_home = os.path.join(tmp, "home")
    for real in (env_dir, base):
        if real.startswith(home + "/"):  # re-create the path under an open home
            inside = os.path.join(fake_home, os.path.relpath(real, home))
            os.makedirs(inside, exist_ok=True)
            mounts.append(f"mount --bind '{real}' '{inside}'")
    hide = ([os.path.realpath(BUILD)] if hide_build else []) + [d for d in ("/usr/local/cuda",) if os.path.isdir(d)]
    sys_libs = []
    for pattern in ("libyaml-cpp.so.*", "libspdlog.so.*", "libfmt.so.*") if hide_build else ():
        out = subprocess.run(f"ls /usr/lib/*-linux-gnu/{pattern} 2>/dev/null", shell=True, capture_output=True,
                             text=True).stdout.split()
        sys_libs += [os.path.realpath(p) for p in out]
    wrapper = "\n".join(["set -e", f"chmod -R a+rX '{fake_home}'" if mounts else "true", *mounts,
                         *(f"mount --rbind '{fake_home}' '{home}'" for _ in [0] if mounts),
                         *(f"mount -t tmpfs none '{d}'" for d in hide),
                         *(f"mount --bind /dev/null '{lib}'" for lib in sorted(set(sys_libs))),
                         f"exec setpriv --reuid=65534 --regid=65534 --clear-groups sh '{path}'"])
    wpath = os.path.join(tmp, "outer.sh")
    with open(wpath, "w") as f:
        f.write(wrapper)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", wpath], capture_output=True,
                       text=True, timeout=900)
    return p.returncode, p.stdout + p.stderr


class Bundle(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="tessel-bundle-")
        os.chmod(cls.tmp, 0o777)
        staged = os.path.join(cls.tmp, "stage", "tessel")
        subprocess.run(["cmake", "--install", BUILD, "--prefix", staged], check=True, capture_output=True)
        cls.archive = os.path.join(cls.tmp, "tessel.tar.gz")
        with tarfile.open(cls.archive, "w:gz") as t:
            t.add(staged, arcname="tessel")
        shutil.rmtree(os.path.join(cls.tmp, "stage"))
        cls.fresh = os.path.join(cls.tmp, "fresh")
        os.makedirs(cls.fresh)
        with tarfile.open(cls.archive) as t:
            t.extractall(cls.fresh)
        cls.prefix = os.path.join(cls.fresh, "tessel")
        subprocess.run(["chmod", "-R", "a+rwX", cls.tmp], check=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_small_relocatable_and_free_of_build_paths(self):
        size = os.path.getsize(self.archive)
        self.assertLess(size, 64 << 20)
        home = os.path.expanduser("~")
        cache = os.path.realpath(os.path.join(ROOT, ".env"))
        forbidden = [os.path.realpath(BUILD), os.path.realpath(ROOT), cache, "/usr/local/cuda",
                     os.path.join(home, ".cache")]
        for dirpath, _, files in os.walk(self.prefix):
            for name in files:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):
                    self.assertFalse(os.readlink(path).startswith("/"), f"absolute link {path}")
                    continue
                if os.path.splitext(name)[1] in (".md", ".cpp", ".h", ".yaml"):
                    continue  # text: docs and the corpus configs/default.yaml trains on
                with open(path, "rb") as f:
                    data = f.read()
                for bad in forbidden:
                    self.assertFalse(bad.encode() in data, f"{path} names {bad}")
        for tool in os.listdir(os.path.join(self.prefix, "libexec", "tessel")):
            if tool.endswith(".sh"):
                continue
            dyn = subprocess.run(["readelf", "-d", os.path.join(self.prefix, "libexec", "tessel", tool)],
                                 capture_output=True, text=True, check=True).stdout
            paths = re.findall(r"R(?:UN)?PATH\)\s+Library r(?:un)?path: \[(.*)\]", dyn)
            self.assertEqual(paths, ["$ORIGIN/../../lib/tessel"], f"{tool}: {paths}")
        share = os.path.join(self.prefix, "share", "tessel")
        for example in os.listdir(os.path.join(ROOT, "examples", "slurm")):  # what README and docs point to
            self.assertTrue(os.path.isfile(os.path.join(share, "examples", "slurm", example)), example)
        for doc in ("gpu.md", "parallelism.md", "configuration.md"):
            self.assertTrue(os.path.isfile(os.path.join(share, "docs", doc)), doc)
        libs = sorted(os.listdir(os.path.join(self.prefix, "lib", "tessel")))
        for want in ("libyaml-cpp", "libspdlog", "libfmt"):
            self.assertTrue(any(lib.startswith(want) for lib in libs), f"{want} missing from {libs}")
        print(f"\nbundle: {size / 2**20:.1f} MiB; lib/tessel: {', '.join(libs)}", file=sys.stderr)

    def test_trains_and_checks_without_root(self):
        # The build tree's binary first: the reference losses.
        ref_dir = os.path.join(self.tmp, "ref")
        cmd = [os.path.join(BUILD, "bin", "tessel-train"), "configs/default.yaml", "--set", f"run.output_dir={ref_dir}"]
        for s in SETS:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=900)
        share = os.path.join(self.prefix, "share", "tessel")
        run_dir = os.path.join(self.tmp, "run")
        sets = " ".join(f"--set {s}" for s in SETS + [f"run.output_dir={run_dir}"])
        code, out = run_unprivileged(self.tmp, f"""set -e
export TESSEL_PYTHON='{PYTHON}' HOME='{self.tmp}'
unset LD_LIBRARY_PATH TESSEL_TORCH_LIBS
echo "uid $(id -u)"
cd '{share}'
'{self.prefix}/bin/tessel-train' configs/default.yaml {sets}
'{share}/bench/gpu-check.sh' '{self.tmp}/check'
""")
        self.assertEqual(code, 0, out[-6000:])
        if os.getuid() == 0:
            self.assertIn("uid 65534", out)
        # The same run within the parity bar: AVX-512 matmul kernels round by buffer alignment, which
        # differs between two processes (measured 1.3e-6 relative on such a CPU).
        got, want = losses(run_dir), losses(ref_dir)
        self.assertEqual(len(got), len(want), "the bundle's run logged other steps than the build tree's")
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        self.assertLess(worst, 1e-5, f"the bundle's losses differ from the build tree's: {got} vs {want}")
        with open(os.path.join(self.tmp, "check", "gpu-check.md")) as f:
            report = f.read()
        self.assertIn("skipped (no GPU)", report)
        self.assertIn("| Tessel vs PyTorch eager vs torch.compile (bench/gpu_bench.py) | passed |", report)
        self.assertIn("| float8: Tessel vs torchao + torch.compile (bench/fp8_bench.py) | passed |", report)
        self.assertIn("| tessel tensorwise |", report)
        print(f"\nbundle as uid {'65534' if os.getuid() == 0 else os.getuid()}: {STEPS} steps within {worst:.1e} "
              f"of the build tree's; gpu-check.sh ran its CPU dry path", file=sys.stderr)

    def fake_install(self, name, floor=None, cuda=None):
        """A copy of the bundle's launcher (run.sh, one tool, share/tessel's records), with its glibc
        floor or its torch's CUDA version replaced: what run.sh checks before anything starts."""
        root = os.path.join(self.tmp, name)
        share = os.path.join(root, "share", "tessel")
        os.makedirs(share)
        os.makedirs(os.path.join(root, "libexec", "tessel"))
        os.makedirs(os.path.join(root, "bin"))
        real = os.path.join(self.prefix, "share", "tessel")
        for f in ("TORCH_VERSION", "TORCH_CUDA", "GLIBC_FLOOR"):
            shutil.copy(os.path.join(real, f), share)
        if floor:
            with open(os.path.join(share, "GLIBC_FLOOR"), "w") as f:
                f.write(floor + "\n")
        shutil.copy(os.path.join(self.prefix, "libexec", "tessel", "run.sh"), os.path.join(root, "libexec", "tessel"))
        os.symlink(os.path.join(self.prefix, "libexec", "tessel", "tessel-train"),
                   os.path.join(root, "libexec", "tessel", "tessel-train"))
        os.symlink("../libexec/tessel/run.sh", os.path.join(root, "bin", "tessel-train"))
        env = dict(os.environ, TESSEL_PYTHON=PYTHON)
        env.pop("TESSEL_TORCH_LIBS", None)
        if cuda is not None:  # a torch of another build: its metadata and version.py only
            site = os.path.join(root, "site")
            os.makedirs(os.path.join(site, "torch"))
            os.makedirs(os.path.join(site, "torch-2.11.0.dist-info"))
            open(os.path.join(site, "torch", "__init__.py"), "w").close()
            with open(os.path.join(site, "torch", "version.py"), "w") as f:
                f.write(f"__version__ = '2.11.0'\ncuda: Optional[str] = {cuda!r}\n" if cuda else "cuda = None\n")
            with open(os.path.join(site, "torch-2.11.0.dist-info", "METADATA"), "w") as f:
                f.write("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
            env["PYTHONPATH"] = site
        return subprocess.run([os.path.join(root, "bin", "tessel-train"), "--help"], capture_output=True, text=True,
                              env=env, timeout=120)

    def test_start_up_checks_glibc_and_the_torch_build(self):
        with open(os.path.join(self.prefix, "share", "tessel", "GLIBC_FLOOR")) as f:
            floor = f.read().strip()
        with open(os.path.join(self.prefix, "share", "tessel", "TORCH_CUDA")) as f:
            self.assertEqual(f.read().strip(), "13.0")
        have = os.confstr("CS_GNU_LIBC_VERSION").split()[1]
        ok = self.fake_install("same")
        self.assertEqual(ok.returncode, 0, ok.stderr)
        newer = self.fake_install("newer_glibc", floor="9.99")
        self.assertEqual(newer.returncode, 127)
        self.assertIn(f"this bundle needs glibc 9.99 or newer", newer.stderr)
        self.assertIn(f"this system has glibc {have}", newer.stderr)
        for cuda, what in (("12.8", "the CUDA 12.8 build"), ("", "a CPU-only build")):
            other = self.fake_install("torch_" + (cuda or "cpu"), cuda=cuda)
            self.assertEqual(other.returncode, 127, other.stderr)
            self.assertIn(f"built against torch 2.11.0, the CUDA 13.0 build", other.stderr)
            self.assertIn(f"has torch 2.11.0, {what}", other.stderr)
        print(f"\nbundle: glibc floor {floor} (this system {have}); a newer floor and torch builds of CUDA 12.8 "
              f"and CPU only refused at start-up", file=sys.stderr)


class SetupWithoutRoot(unittest.TestCase):
    def test_uses_what_cmake_finds_instead_of_apt(self):
        # A user without root on a machine whose libraries came from elsewhere than Debian's
        # packages (here: dpkg-query knows none of them), LibTorch given by Torch_DIR: setup.sh
        # must not try apt or sudo; CMake finds the libraries, so it succeeds. It used to run
        # `sudo apt-get` first and exit 1.
        tmp = tempfile.mkdtemp(prefix="tessel-setup-")
        try:
            os.chmod(tmp, 0o777)
            fake = os.path.join(tmp, "fakebin")
            os.makedirs(fake)
            with open(os.path.join(fake, "dpkg-query"), "w") as f:
                f.write("#!/bin/sh\nexit 1\n")
            os.chmod(os.path.join(fake, "dpkg-query"), 0o755)
            torch_dir = subprocess.run([PYTHON, "-c", "import torch.utils; print(torch.utils.cmake_prefix_path)"],
                                       capture_output=True, text=True, check=True).stdout.strip() + "/Torch"
            checkout = os.path.join(tmp, "checkout")
            shutil.copytree(os.path.join(ROOT, "third_party"), os.path.join(checkout, "third_party"))
            subprocess.run(["chmod", "-R", "a+rwX", tmp], check=True)
            code, out = run_unprivileged(tmp, f"""
export PATH='{fake}':$PATH HOME='{tmp}' TESSEL_CACHE='{tmp}/cache' Torch_DIR='{torch_dir}'
echo "uid $(id -u)"
'{checkout}/third_party/setup.sh' build
""", hide_build=False)
            self.assertEqual(code, 0, out)
            self.assertNotIn("installing Debian packages", out)
            self.assertIn(f"using Torch_DIR={torch_dir}", out)
            if os.getuid() == 0:
                self.assertIn("uid 65534", out)
            print(f"\nsetup.sh without root, nothing known to dpkg: {out.strip().splitlines()[-1]}", file=sys.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
