"""A private Slurm cluster on this machine for the tests: one slurmctld and two slurmd (n1, n2) on
loopback, configured in a scratch folder, torn down on exit. Debian's Slurm packages are installed
by `make test` (third_party/setup.sh test). Every client call gets SLURM_CONF: a Slurm client
without it would look for a controller through DNS."""
import os
import shutil
import signal
import socket
import subprocess
import time


def _free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _consecutive_free_ports(n):
    """n consecutive loopback ports that are free now (slurmd's Port=<p1>-<p2> range)."""
    for _ in range(50):
        base = _free_ports(1)[0]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free loopback ports")


# Debian puts the daemons in /usr/sbin, which is not on a user's PATH.
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def which(binary):
    return shutil.which(binary, path=SEARCH)


def missing():
    """The Slurm programs this machine lacks (empty: a private cluster can run here)."""
    return [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel") if not which(b)]


def available():
    return not missing()


class LocalSlurm:
    def __init__(self, folder, nodes=2):
        self.dir = os.path.abspath(folder)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):  # a test run inside an allocation must not leak it into jobs
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del self.env[k]

    def __enter__(self):
        for sub in ("state", "spool", "log", "run"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        ctld = _free_ports(1)[0]
        first = _consecutive_free_ports(len(self.nodes))
        d = self.dir
        conf = f"""ClusterName=tessel
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=2
KillWait=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
NodeName=n[1-{len(self.nodes)}] NodeHostname={socket.gethostname().split('.')[0]} NodeAddr=127.0.0.1 Port={first}-{first + len(self.nodes) - 1} CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        for n in self.nodes:
            os.makedirs(os.path.join(d, "spool", n), exist_ok=True)
        subprocess.run([which("slurmctld"), "-f", self.conf, "-c"], check=True, env=self.env)
        for n in self.nodes:
            subprocess.run([which("slurmd"), "-f", self.conf, "-N", n], check=True, env=self.env)
        deadline = time.time() + 30
        while time.time() < deadline:
            out = self.client("sinfo", "-h", "-o", "%T %D", check=False).stdout.split()
            if out[:2] == ["idle", str(len(self.nodes))]:
                return self
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the local Slurm cluster did not come up: sinfo says {out}; logs in {d}/log")

    def __exit__(self, *exc):
        subprocess.run([which("scancel"), "--user", "root"], env=self.env, capture_output=True)
        pids = []
        run = os.path.join(self.dir, "run")
        for name in os.listdir(run) if os.path.isdir(run) else []:
            try:
                with open(os.path.join(run, name)) as f:
                    pid = int(f.read().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.time() + 15
        for pid in pids:
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return False

    def client(self, *args, check=True, timeout=120):
        p = subprocess.run([which(args[0]) or args[0], *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{args} exited {p.returncode}: {p.stdout}{p.stderr}")
        return p

    def submit(self, script, options=(), args=()):
        """sbatch OPTIONS SCRIPT ARGS; returns the job id."""
        out = self.client("sbatch", "--parsable", *options, script, *args).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id):
        """scontrol show job as a dict (empty once the controller has forgotten the job)."""
        p = self.client("scontrol", "-o", "show", "job", str(job_id), check=False)
        fields = {}
        for tok in p.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                fields[k] = v
        return fields

    def logs(self, lines=40):
        """The last lines of the controller's and every node daemon's log, for failure messages."""
        out = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))):
            with open(os.path.join(self.dir, "log", name), errors="replace") as f:
                out.append(f"--- {name} (last {lines} lines)\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)

    def wait(self, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            j = self.job(job_id)
            if j.get("JobState") in states:
                return j
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not reach {states} in {timeout} s: {self.job(job_id)}")
