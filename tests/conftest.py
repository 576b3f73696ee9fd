"""Helpers for running the scripts as real subprocesses (real torchrun, real mp.spawn) on CPU/gloo."""
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TIMEOUT = 300  # no test may hang CI: every subprocess is killed after this many seconds


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a launcher or a job sets for its processes: never inherited from wherever the tests themselves run
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


class CpuEnv(dict):
    """An environment made by clean_env: the only kind the guard below lets a test start a script with."""


def clean_env(base=None, **extra):
    """`base` (default: this environment) without any launcher's or job's variables, one thread per process,
    unbuffered output, no GPU visible, then `extra`. The suite is the CPU/gloo one on every machine: on a GPU machine
    a script would otherwise pick CUDA and NCCL, which refuses two ranks on one GPU. (Not --device cpu: the tests of
    --device cuda and --gpus must mean the same everywhere.)"""
    env = {k: v for k, v in (base or os.environ).items()
           if k not in LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    return CpuEnv({**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **extra})


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes longer than about 10 s")
    config.addinivalue_line("markers", "floor: also run by CI on the oldest supported torch (requirements.txt)")
    config.addinivalue_line("markers", "gpu: needs CUDA; may start scripts that see the GPUs")


STARTS_SCRIPTS = ("python", "srun", "sbatch", "salloc")  # what starts a script of this collection, or a job running one


@pytest.fixture(autouse=True)
def cpu_pin_guard(request, monkeypatch):
    """Every Python process or SLURM job a test starts gets its environment from clean_env (no GPU visible), except
    in tests marked gpu. A test that forgets fails here, on any machine, instead of only on a GPU machine."""
    if request.node.get_closest_marker("gpu"):
        return
    real = subprocess.Popen

    class Guarded(real):
        def __init__(self, args, *a, **kw):
            program = os.path.basename(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0])
            if program.startswith(STARTS_SCRIPTS) and not isinstance(kw.get("env"), CpuEnv):
                raise AssertionError(f"{program} started without conftest.clean_env(): on a GPU machine it would "
                                     "see the GPUs")
            super().__init__(args, *a, **kw)
    monkeypatch.setattr(subprocess, "Popen", Guarded)


def run(script, *args, nproc=None, launcher="python", env=None, check=True, timeout=TIMEOUT, launcher_args=()):
    """Run one of the scripts. launcher: 'python' (plain; ddp_spawn_train.py spawns --nprocs itself) or 'torchrun'
    (with `launcher_args` before the script). Weight comparisons need equal threads per process: one each, unless
    `env` says otherwise. On timeout the whole process tree is killed, torchrun's workers included."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc or 1}",
               f"--master_port={free_port()}", *map(str, launcher_args), script]
    else:
        cmd = [sys.executable, script] + ([f"--nprocs={nproc}"] if nproc else [])
    cmd += [str(a) for a in args]
    token = f"{os.getpid()}-{next(RUNS)}"  # in the environment of every process it starts, orphans included
    p = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(**(env or {}), TEST_RUN=token), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # first SIGUSR2, on which the scripts print every thread's Python stack (faulthandler): where it hung. Not
        # only p's tree: a worker whose launcher has exited is nobody's child, but still holds p's output open.
        # torchrun itself is spared it (it would die of it, and its workers with it, before they print)
        state = "still running" if p.poll() is None else f"exited {p.returncode}, a process it started still running"
        spared = {p.pid} if launcher == "torchrun" else set()
        for sig, pids in ((signal.SIGUSR2, lambda: set(started_by(token)) - spared),
                          (signal.SIGKILL, lambda: {p.pid, *started_by(token)})):
            for pid in pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(2)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(its output could not be read)"
        raise AssertionError(f"timed out after {timeout}s ({state}): {' '.join(cmd)}\n{out[-3000:]}\n"
                             f"{err[-12000:]}") from None
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{out[-3000:]}\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


RUNS = itertools.count()


def started_by(token):
    """Pids of the live processes whose environment holds TEST_RUN=token: everything one run() started."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"TEST_RUN={token}".encode() in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def children(pid):
    """Pids of the live (not zombie) children of `pid`, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def descendants(pid):
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_tree(pid, sig=signal.SIGKILL):
    """Signal `pid` and every process under it. Killing its process group is not enough: torchrun starts each worker
    in a session of its own."""
    for p in [pid] + descendants(pid):  # listed before any dies: an orphan can no longer be traced to its launcher
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint(out_dir_or_file):
    path = out_dir_or_file if out_dir_or_file.endswith(".pt") else os.path.join(out_dir_or_file, "last.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


def max_diff(a, b, keys=None):
    """Max absolute difference between two state dicts: over all of them (same keys required), or over `keys`."""
    if keys is None:
        assert a.keys() == b.keys()
        keys = a.keys()
    assert set(keys) <= a.keys() and set(keys) <= b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys if a[k].is_floating_point())


def summary_lines(output, prefix="epoch "):
    """The per-epoch summary lines (the progress bar is drawn on the same terminal line before them)."""
    return [line[line.index(prefix):] for line in output.replace("\r", "\n").splitlines()
            if prefix in line and "train_loss" in line]


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")
