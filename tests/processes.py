"""Every process the tests start, started here, one way: in a session of its own, with an environment from
clean_env (no GPU visible, one thread, no launcher's variables), its stop signals at their defaults whatever the
shell that runs the tests ignores (nohup, a background job), stdout and stderr in files, and a deadline after which it
is killed with everything it started, Python's stacks printed first (SIGABRT, PYTHONFAULTHANDLER) to show where it hung.

    run(script, *args, launcher=...)   a script to its end: python (a lone process; ddp_spawn_train.py starts its own),
                                       torchrun, or "ranks" (N processes started by hand over env://)
    Proc(cmd, folder)                  any command, watched while it runs (signals, hooks, timing)
    command(cmd)                       a short helper command (mount, scancel, ruff), its output

A lone process and a rank started by hand are forked from a Python that has imported torch once (forker.py) where
their environment allows it (forkable): a run whose launcher is not what the test is about then starts in about 0.1 s
of CPU instead of about 4 s. torchrun, mp.spawn, srun, mpirun and every test about how a process starts or ends
(fork=False) start real interpreters."""
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
TIMEOUT = 300  # seconds: no run may hang the suite

# ---- environments
# what a launcher or a job sets for its processes: never inherited from wherever the tests themselves run
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# tmp: the folder every started process gets as TMPDIR (conftest: inside pytest's own); the session's names of
# short_tmp's folders and of the semaphores (conftest.name_what_tests_make)
SETTINGS = {"tmp": None, "short_tmp": "ddp-tests-", "semaphores": "/mp-tests"}


class CpuEnv(dict):
    """An environment made by clean_env: the only kind conftest's guard lets a test start a process with."""


def clean_env(base=None, **extra):
    """`base` (default: this environment) without any launcher's or job's variables, one thread per process,
    unbuffered output, no GPU visible, Python's stacks on SIGABRT, this Python first on PATH, TMPDIR the session's, the
    suite's named semaphores named apart (conftest's leftover check: the hooks' TEST_SEMAPHORES, tests/site on
    PYTHONPATH), then `extra` (a value of None: the variable unset). The suite is the CPU/gloo one on every machine: on
    a GPU machine a script would otherwise pick CUDA and NCCL, which refuses two ranks on one GPU. (Not --device cpu:
    the tests of --device cuda and --gpus must mean the same everywhere.) Of a SLURM cluster's environment `base` it
    keeps SLURM_CONF, which names the cluster."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items()
           if k not in LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    if "SLURM_CONF" in base:
        env["SLURM_CONF"] = base["SLURM_CONF"]
    path = os.pathsep.join([os.path.dirname(sys.executable), base.get("PATH", os.defpath)])
    tmp = {"TMPDIR": SETTINGS["tmp"]} if SETTINGS["tmp"] else {}
    site = os.pathsep.join(p for p in (str(TESTS / "site"), base.get("PYTHONPATH")) if p)
    env = {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONFAULTHANDLER": "1", "PATH": path, **tmp, "PYTHONPATH": site,
           "TEST_SEMAPHORES": SETTINGS["semaphores"],
           **{k: str(v) for k, v in extra.items() if v is not None}}
    return CpuEnv({k: v for k, v in env.items() if extra.get(k, "") is not None})  # None: unset


# ---- ports
ADDRESS_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")
# torchrun's c10d rendezvous on port 0: its agent binds a port the OS picks and tells the workers (MASTER_PORT), so
# that no test-chosen port can be taken in between. The static rendezvous (the README's `--master_port`) is what
# run() uses, retried on ADDRESS_IN_USE
LAUNCHER_PICKS_PORT = ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0")


def free_port():
    """A port free now. Another process may take it before the one it is given to binds it: whatever binds a port
    from here is retried on "address in use" (address_in_use), or lets the launcher pick its own
    (LAUNCHER_PICKS_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_in_use(output):
    return any(words in output for words in ADDRESS_IN_USE)


def env_ranks(nproc, port):
    """The variables of `nproc` ranks launched by hand (env://: a launch script, a Kubernetes pod, another launcher),
    rank 0 serving the rendezvous on 127.0.0.1:`port`: one dict per rank."""
    return [dict(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(nproc)]


def torchrun(*launcher_args):
    return [sys.executable, "-m", "torch.distributed.run", *map(str, launcher_args)]


# ---- the processes of this machine, from /proc
def alive(pid):
    """Whether process `pid` is running: there, and not a zombie (one that has exited and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def children(pid):
    """Pids of the live (not zombie) children of `pid`."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid and alive(int(entry)):
            kids.append(int(entry))
    return kids


def descendants(pid):
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def worker_env(pid):
    """The environment `pid` was started with (a real interpreter's; a forked one shows the fork server's)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def started_with(token):
    """Pids of the live processes whose environment holds TEST_RUN=token: whatever a real interpreter started,
    orphans included (a worker whose launcher has exited is nobody's child)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and worker_env(int(e)).get("TEST_RUN") == token]


def kill_tree(pid, sig=signal.SIGKILL):
    """Signal `pid` and every process under it, listed before any dies (an orphan can no longer be traced)."""
    for p in [pid] + descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def in_session(sid):
    """Pids of the live processes of session `sid` (a command started in a session of its own, and what it started
    that did not start one of its own)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry))
    return found


def signal_pending(pid, sig):
    """Whether `sig` waits for delivery to `pid` (as a signal sent to a stopped process does)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False  # gone: whatever was sent has been delivered
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in pending)


# ---- the fork server (forker.py)
class Forker:
    """forker.py, started on first use, one per test process (each pytest-xdist worker has its own). Its replies are
    read when asked for, by whoever asks: no thread (a thread would make every fork of this process unsafe)."""

    lock = threading.Lock()
    server = None

    def __init__(self):
        self.p = subprocess.Popen([sys.executable, str(TESTS / "forker.py")], cwd=ROOT, env=clean_env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        os.set_blocking(self.p.stdout.fileno(), False)
        self.pending, self.statuses, self.pids = b"", {}, []

    @classmethod
    def get(cls):
        with cls.lock:
            if cls.server is None or cls.server.p.poll() is not None:
                cls.server = Forker()
            return cls.server

    @classmethod
    def close(cls):
        with cls.lock:
            if cls.server is not None:
                cls.server.p.stdin.close()
                cls.server.p.wait(timeout=30)
                cls.server = None

    def read(self):
        """Take in what the server has said so far: the pids of new runs, the statuses of ended ones."""
        while True:
            try:
                data = os.read(self.p.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                return
            if not data:
                raise RuntimeError(f"the fork server exited {self.p.poll()}")
            self.pending += data
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                message = json.loads(line)
                if "status" in message:
                    self.statuses[message["pid"]] = message["status"]
                else:
                    self.pids.append(message["pid"])

    def start(self, argv, cwd, env, out, err):
        """The pid of `python ARGV...` forked with this environment, working directory and output files."""
        with self.lock:
            request = {"argv": list(argv), "cwd": str(cwd), "env": dict(env), "out": str(out), "err": str(err)}
            self.p.stdin.write((json.dumps(request) + "\n").encode())
            self.p.stdin.flush()
            deadline = time.monotonic() + 60
            while not self.pids:
                self.read()
                if time.monotonic() > deadline:
                    raise RuntimeError("the fork server did not answer in 60 s")
                time.sleep(0.002)
            return self.pids.pop(0)

    def status(self, pid):
        """Its exit status (minus the signal that killed it), or None while it runs."""
        with self.lock:
            self.read()
            return self.statuses.get(pid)


def forkable(cmd, env):
    """Whether `cmd` may be forked from forker.py with `env`: `python script.py ...` or `python -m module ...`, in an
    environment whose settings read at import (threads, the CPU's instruction set, a platform simulated by a
    sitecustomize.py other than the hooks') are forker.py's own."""
    if len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-") and cmd[1] != "-m":
        return False
    if cmd[1] == "-m" and cmd[2] in ("torch.distributed.run", "torch.distributed.launch"):
        return False
    same = all(env.get(k) == os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "MKL_NUM_THREADS", "KMP_AFFINITY"))
    sites = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.isfile(os.path.join(p, "sitecustomize.py"))]
    return env.get("OMP_NUM_THREADS") == "1" and same and all(Path(p) == TESTS / "site" for p in sites)


# ---- a process, watched
FOLDERS = itertools.count()


def new_folder(name="run"):
    """A fresh folder for the output of a command (under the session's temporary folder)."""
    base = Path(SETTINGS["tmp"] or tempfile.gettempdir()).parent / "processes"
    folder = base / f"{name}-{os.getpid()}-{next(FOLDERS)}"
    folder.mkdir(parents=True)
    return folder


class Proc:
    """A command started in a session of its own, its stdout and stderr in `folder` (merged into one file if `merge`),
    killed with everything it started at its deadline. `fork`: from forker.py (forkable's commands only)."""

    def __init__(self, cmd, folder=None, *, cwd=ROOT, env=None, fork=False, timeout=TIMEOUT, merge=False,
                 name="proc"):
        self.args = self.cmd = [str(c) for c in cmd]
        self.folder = Path(folder) if folder else new_folder(name)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.out, self.err = self.folder / f"{name}.out", self.folder / (f"{name}.out" if merge else f"{name}.err")
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"
        env = env if isinstance(env, CpuEnv) else clean_env(**(env or {}))
        env = CpuEnv({**env, "TEST_RUN": self.token})
        self.deadline, self.returncode, self.forked = time.monotonic() + timeout, None, fork
        self.timeout = timeout
        for path in {self.out, self.err}:
            path.write_bytes(b"")
        if fork:
            assert forkable(self.cmd, env), f"not forkable: {self.cmd}"
            self.forker = Forker.get()
            self.pid = self.forker.start(self.cmd, cwd, env, self.out, self.err)
        else:
            # the stop signals at their defaults, as in a terminal: the shell running the tests may ignore some
            reset = [sys.executable, "-S", str(TESTS / "defaults.py")]
            with open(self.out, "ab") as out, open(self.err, "ab") as err:
                self.p = subprocess.Popen(reset + self.cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
            self.pid = self.p.pid

    def poll(self):
        if self.returncode is None:
            self.returncode = self.forker.status(self.pid) if self.forked else self.p.poll()
        return self.returncode

    @property
    def stdout(self):
        return self.out.read_text(errors="replace")

    @property
    def stderr(self):
        return "" if self.err == self.out else self.err.read_text(errors="replace")

    def output(self):
        return self.stdout + self.stderr

    def tail(self):
        return f"{' '.join(self.cmd)}\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"

    def tree(self):
        """Every live process of this command: its own while it runs, and every process of its session (what it
        started, orphans included) or started with its environment (a real interpreter's; torchrun's workers start
        sessions of their own)."""
        found = set(in_session(self.pid)) | set(started_with(self.token))
        if self.poll() is None:
            found |= {self.pid, *descendants(self.pid)}
        return found

    def kill(self, diagnose=False):
        """Kill the command and every process it started. diagnose: first SIGABRT, on which Python processes print
        their stacks (PYTHONFAULTHANDLER)."""
        tree = self.tree()
        for sig in ((signal.SIGABRT,) if diagnose else ()) + (signal.SIGKILL,):
            for pid in tree | self.tree():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if sig == signal.SIGABRT and tree:
                time.sleep(2)
        while self.poll() is None:
            time.sleep(0.01)

    def wait(self, expect=0, timeout=None):
        """Its exit status, once it has ended (`expect`: the status it must have, None for any). Past its deadline,
        or `timeout` seconds, it is killed and the test fails."""
        deadline = self.deadline if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill(diagnose=True)
                pytest.fail(f"timed out after {self.timeout if timeout is None else timeout} s\n{self.tail()}")
            time.sleep(0.01)
        if expect is not None:
            assert self.returncode == expect, f"exit status {self.returncode}, not {expect}: {self.tail()}"
        return self.returncode

    def until(self, ready, what):
        """Wait for ready() while the command runs; fail if it ends first or its deadline passes."""
        while not ready():
            if self.poll() is not None:
                pytest.fail(f"the run ended (exit status {self.returncode}) before {what}\n{self.tail()}")
            if time.monotonic() > self.deadline:
                self.kill(diagnose=True)
                pytest.fail(f"timed out waiting for {what}\n{self.tail()}")
            time.sleep(0.01)

    def result(self):
        """The ended command as subprocess gives it: args, returncode, stdout, stderr."""
        return subprocess.CompletedProcess(self.cmd, self.returncode, self.stdout, self.stderr)


# ---- a script to its end
def script_cmd(script, args, launcher, nproc, launcher_args=()):
    script, args = str(script), [str(a) for a in args]
    if launcher == "torchrun":
        return torchrun(f"--nproc_per_node={nproc or 1}", f"--master_port={free_port()}", *launcher_args,
                        script, *args)
    return [sys.executable, script] + ([f"--nprocs={nproc}"] if nproc else []) + args


class Ranks:
    """`nproc` processes of a script, each told its rank, the world size and where rank 0 serves the rendezvous, as a
    hand-written launch script or another launcher would; each in a session of its own, its output in files."""

    def __init__(self, script, args, nproc, *, env=None, cwd=ROOT, fork=None, folder=None, timeout=TIMEOUT):
        script = str(script)
        self.folder = Path(folder) if folder else new_folder("ranks")
        port = free_port()
        self.procs = []
        for rank, variables in enumerate(env_ranks(nproc, port)):
            rank_env = clean_env(**{**(env or {}), **variables})
            cmd = [sys.executable, script, *map(str, args)]
            use_fork = forkable(cmd, rank_env) if fork is None else fork
            self.procs.append(Proc(cmd, self.folder, cwd=cwd, env=rank_env, fork=use_fork, timeout=timeout,
                                   name=f"rank{rank}"))

    def stdout(self, rank):
        return self.procs[rank].stdout

    def stderr(self, rank):
        return self.procs[rank].stderr

    def output(self):
        return "\n".join(f"--- rank {r}\n{p.stdout[-2000:]}{p.stderr[-4000:]}" for r, p in enumerate(self.procs))

    def wait(self, rank, timeout=None):
        """The rank's own exit status. Past its deadline every rank prints its stacks and is killed, and the test
        fails."""
        proc = self.procs[rank]
        deadline = proc.deadline if timeout is None else time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill(diagnose=True)
                pytest.fail(f"rank {rank} did not exit in time\n{self.output()}")
            time.sleep(0.01)
        return proc.returncode

    def taken(self):
        """Whether rank 0 failed because another process took its port first."""
        return self.procs[0].poll() not in (None, 0) and address_in_use(self.procs[0].stderr)

    def kill(self, diagnose=False):
        for p in self.procs:
            p.kill(diagnose)

    def result(self):
        """All ranks ended: returncode the first non-zero status (0 if none), returncodes each one's, stdout and
        stderr each rank's in turn."""
        codes = [p.returncode for p in self.procs]
        result = subprocess.CompletedProcess(self.procs[0].cmd, next((c for c in codes if c), 0),
                                             "".join(p.stdout for p in self.procs),
                                             "".join(p.stderr for p in self.procs))
        result.returncodes = codes
        return result


def start_ranks(script, args, nproc, **kw):
    """Ranks started by hand, again on another port where rank 0 finds its own taken (Ranks' arguments)."""
    for attempt in range(5):
        ranks = Ranks(script, args, nproc, **kw)
        while ranks.procs[0].poll() is None and not any(p.poll() for p in ranks.procs[1:]):
            time.sleep(0.05)
            if time.monotonic() > ranks.procs[0].deadline or ranks.procs[0].stdout:
                break  # rank 0 got past the rendezvous, or will never
        if not ranks.taken() or attempt == 4:
            return ranks
        ranks.kill()


def run(script, *args, launcher="python", nproc=None, env=None, cwd=ROOT, check=True, timeout=TIMEOUT,
        launcher_args=(), fork=None):
    script = str(script)
    """Run a script to its end. launcher: "python" (a lone process; ddp_spawn_train.py spawns --nprocs itself),
    "torchrun" (with `launcher_args` before the script; its static rendezvous on a free port, retried if another
    process took the port first) or "ranks" (`nproc` processes started by hand over env://, each forked where it can
    be). Weight comparisons need equal threads per process: one each, unless `env` says otherwise. Returns the
    ended command (args, returncode, stdout, stderr); check: fail the test unless it exited 0."""
    environment = clean_env(**(env or {}))
    for attempt in range(5):
        if launcher == "ranks":
            ranks = start_ranks(script, args, nproc, env=env, cwd=cwd, fork=fork, timeout=timeout)
            for rank in range(nproc):
                ranks.wait(rank)
            p = ranks.result()
            retry = ranks.taken()
        else:
            cmd = script_cmd(script, args, launcher, nproc, launcher_args)
            use_fork = forkable(cmd, environment) if fork is None else fork
            proc = Proc(cmd, cwd=cwd, env=environment, fork=use_fork, timeout=timeout, name=Path(str(script)).stem)
            proc.wait(expect=None)
            p = proc.result()
            retry = launcher == "torchrun" and p.returncode != 0 and address_in_use(p.stderr)
        if not retry:
            break
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def command(cmd, *, env=None, cwd=ROOT, timeout=120, check=False):
    """A short command that is not a training run (mount, scancel, ruff, a snippet of Python), to its end: its
    CompletedProcess, with text output."""
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env if isinstance(env, CpuEnv) else clean_env(env or {}),
                       capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check:
        assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p
