"""A real one-node SLURM cluster for tests: munged, slurmctld and slurmd started from a minimal configuration in a
temporary folder (state, logs, sockets and ports all private to it), stopped afterwards.

It installs nothing: the tests that use it are skipped where the SLURM daemons are missing (Debian/Ubuntu:
apt-get install slurm-wlm munge) or where this is not root (slurmd starts job steps as their user).
Commands such as srun and sbatch find the cluster through SLURM_CONF, which `env()` sets.
"""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from conftest import SLURM_RAN
from processes import address_in_use, clean_env, free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("srun", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])  # daemons: sbin


def which(name):
    return shutil.which(name, path=SEARCH_PATH)


def node_name():
    """This host's short name, as slurmd would call itself; `localhost` where that name does not resolve
    (the training scripts connect to the first node of a step by its name)."""
    name = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "localhost"


def skip_reason():
    missing = [c for c in DAEMONS + COMMANDS if which(c) is None]
    if missing:
        return f"SLURM is not installed (missing {', '.join(missing)}; Debian/Ubuntu: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a SLURM test cluster needs root: slurmd starts job steps as their user"
    return None


class Cluster:
    def __init__(self, root):
        self.root = root
        self.node = node_name()
        self.conf = os.path.join(root, "slurm.conf")
        self.procs = []
        for d in ("state", "spool", "log"):
            os.makedirs(os.path.join(root, d), exist_ok=True)

    def env(self, **extra):
        """os.environ without any SLURM_* of an outer job (conftest.clean_env), pointing at this cluster."""
        return clean_env(SLURM_CONF=self.conf, **extra)

    def path(self, *names):
        return os.path.join(self.root, *names)

    def write_config(self):
        key = self.path("munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(128))
        lines = [
            "ClusterName=pytest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.path('munge.sock')},cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}",
            f"SlurmctldPidFile={self.path('slurmctld.pid')}",
            f"SlurmdPidFile={self.path('slurmd.pid')}",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self.path('log', 'slurmd.log')}",
            # no cgroups (containers often have none to give): processes are tracked through /proc
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # 2 CPUs even on a machine with fewer cores
            "MaxJobCount=1000",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _daemon(self, name, cmd):
        log = open(self.path("log", f"{name}.out"), "wb")
        self.procs.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                                  start_new_session=True)))

    def start(self, timeout=30):
        self.write_config()
        self._daemon("munged", [which("munged"), "--foreground", "--force", f"--key-file={self.path('munge.key')}",
                                f"--socket={self.path('munge.sock')}", f"--pid-file={self.path('munged.pid')}",
                                f"--log-file={self.path('log', 'munged.log')}",
                                f"--seed-file={self.path('munged.seed')}"])
        self._wait(lambda: os.path.exists(self.path("munge.sock")), timeout, "munged did not create its socket")
        self._daemon("slurmctld", [which("slurmctld"), "-D"])
        self._daemon("slurmd", [which("slurmd"), "-D", "-N", self.node])
        self._wait(lambda: self.sinfo() == "idle", timeout, "the node did not become idle")

    def sinfo(self):
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env(), timeout=10)
        return r.stdout.strip()

    def _wait(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} (exited: {dead or 'none'})\n{self.logs()}")
            time.sleep(0.2)

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.path("log"))):
            with open(self.path("log", name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out)

    def stop(self):
        """Cancel what is left of the jobs, then stop the daemons (the ones this object started, by their pid)."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self.procs):
            try:
                jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env(),
                                      timeout=10).stdout.split()
                if jobs:
                    subprocess.run(["scancel", *jobs], env=self.env(), timeout=10)
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline and subprocess.run(
                            ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env(),
                            timeout=10).stdout.split():
                        time.sleep(0.2)
            except (OSError, subprocess.SubprocessError):
                pass
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []
        for pid in self.leftovers():  # e.g. a job step that a stopped slurmd could no longer end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self):
        """Pids of the processes of this cluster still running: they all carry its SLURM_CONF in their environment
        (the daemons, their slurmstepd, and the jobs, which inherit it from srun and sbatch)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    pass
        return found


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A one-node cluster for this module's tests, started once. Where SLURM cannot run here the tests skip, saying
    why; with REQUIRE_SLURM=1 (CI, which installs it) they fail instead, so that a green run has really run them."""
    reason = skip_reason()
    if reason:
        if os.environ.get("REQUIRE_SLURM") == "1":
            pytest.fail(f"REQUIRE_SLURM=1, but {reason}")
        pytest.skip(reason)
    for attempt in range(3):  # its ports are picked free, but another process may take one before a daemon binds it
        cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
        try:
            cluster.start()
            break
        except RuntimeError as e:
            cluster.stop()
            if not address_in_use(str(e)) or attempt == 2:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster, request):
    """The module's cluster, for one test: named in the run's summary ("SLURM" section) as having run on it."""
    SLURM_RAN.append(request.node.name)
    return slurm_cluster
