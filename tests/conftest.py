"""Helpers for running the scripts as real subprocesses (real torchrun, real mp.spawn) on CPU/gloo."""
import contextlib
import itertools
import json
import os
import re
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
    """A port free now. Another process may take it before the one it is given to binds it: whatever binds a port
    from here is retried on "address in use" (ADDRESS_IN_USE in its output), or lets the launcher pick its own port
    (LAUNCHER_PICKS_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ADDRESS_IN_USE = ("EADDRINUSE", "Address already in use", "address already in use")
# torchrun's c10d rendezvous on port 0: its agent binds a port the OS picks and tells the workers (MASTER_PORT), so
# that no test-chosen port can be taken in between. The static rendezvous (the README's `--master_port`) is what
# run() uses, retried on ADDRESS_IN_USE
LAUNCHER_PICKS_PORT = ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0")


def address_in_use(output):
    return any(words in output for words in ADDRESS_IN_USE)


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
    return CpuEnv({**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
                   "PYTHONFAULTHANDLER": "1", **extra})


MEASURED = []  # (test, what, value, tolerance or None): printed at the end of the run, and to MEASURED_JSON
SLURM_RAN = []  # the tests that ran on the one-node SLURM cluster (slurm_cluster.py)


@pytest.fixture
def measured(request):
    """measured(what, value, tolerance=None): a number a test measured (a difference between runs, a time), reported
    at the end of the run ("measured" section) and, if MEASURED_JSON names a file, written there as JSON."""
    def record(what, value, tolerance=None):
        MEASURED.append((request.node.nodeid, what, float(value), tolerance))
        return value
    return record


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for test, what, value, tolerance in MEASURED:
            bound = f"  (tolerance {tolerance:.3g}, {value / tolerance:.2g} of it)" if tolerance else ""
            terminalreporter.write_line(f"{what}: {value:.3g}{bound}  [{test}]")
        if os.environ.get("MEASURED_JSON"):
            with open(os.environ["MEASURED_JSON"], "w") as f:
                json.dump([dict(zip(("test", "what", "value", "tolerance"), m)) for m in MEASURED], f, indent=1)
    if SLURM_RAN:
        terminalreporter.section("SLURM")
        terminalreporter.write_line(f"{len(SLURM_RAN)} tests ran on a one-node SLURM cluster: {', '.join(SLURM_RAN)}")


GUARD = {"on": True}


def refuse_unless_clean(program, env):
    if GUARD["on"] and not isinstance(env, CpuEnv):
        raise AssertionError(f"{program} started without conftest.clean_env(): on a GPU machine it would see the GPUs")


def install_cpu_pin_guard():
    """Every process a test or fixture starts (Python, torchrun, srun, a shell, `env python`: any program, by any
    of subprocess's or os's ways of starting one) gets its environment from clean_env (no GPU visible), except in
    tests marked gpu. A test that forgets fails here, on any machine, instead of only on a GPU machine."""
    real = subprocess.Popen

    class Guarded(real):
        def __init__(self, args, *a, **kw):
            refuse_unless_clean(args[0] if isinstance(args, (list, tuple)) else args, kw.get("env"))
            super().__init__(args, *a, **kw)
    subprocess.Popen = Guarded
    for name in ("system", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe"):
        if hasattr(os, name):  # none of these takes an environment made by clean_env
            real_call = getattr(os, name)

            def guarded(*a, _name=name, _real=real_call, **kw):
                refuse_unless_clean(f"os.{_name}", None)
                return _real(*a, **kw)
            setattr(os, name, guarded)


def pytest_configure(config):
    install_cpu_pin_guard()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (module- and session-scoped ones included): the guard is off only
    for tests marked gpu."""
    GUARD["on"] = item.get_closest_marker("gpu") is None


def run(script, *args, nproc=None, launcher="python", env=None, check=True, timeout=TIMEOUT, launcher_args=()):
    """Run one of the scripts. launcher: 'python' (plain; ddp_spawn_train.py spawns --nprocs itself) or 'torchrun'
    (with `launcher_args` before the script; its static rendezvous on a free port, retried if another process took
    the port first). Weight comparisons need equal threads per process: one each, unless `env` says otherwise. On
    timeout the whole process tree is killed, torchrun's workers included."""
    for attempt in range(5):
        p = run_once(script, *args, nproc=nproc, launcher=launcher, env=env, timeout=timeout,
                     launcher_args=launcher_args)
        if not (launcher == "torchrun" and p.returncode != 0 and address_in_use(p.stderr)):
            break
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def run_once(script, *args, nproc, launcher, env, timeout, launcher_args):
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc or 1}",
               f"--master_port={free_port()}", *map(str, launcher_args), script]
    else:
        cmd = [sys.executable, script] + ([f"--nprocs={nproc}"] if nproc else [])
    cmd += [str(a) for a in args]
    token = f"{os.getpid()}-{next(RUNS)}"  # in the environment of every process it starts, orphans included
    p = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(**(env or {}), TEST_RUN=token), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = communicate(p, timeout, token, spare_launcher=launcher == "torchrun")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def communicate(p, timeout, token, spare_launcher):
    """p's output; on timeout, an AssertionError with every stack of what hung. `token`: the TEST_RUN in the
    environment of every process p started."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # first SIGABRT, on which Python prints every thread's stack (PYTHONFAULTHANDLER): where it hung. Not
        # only p's tree: a worker whose launcher has exited is nobody's child, but still holds p's output open.
        # torchrun itself is spared it (it would die of it, and its workers with it, before they print)
        state = "still running" if p.poll() is None else f"exited {p.returncode}, a process it started still running"
        spared = {p.pid} if spare_launcher else set()
        for sig, pids in ((signal.SIGABRT, lambda: set(started_by(token)) - spared),
                          (signal.SIGKILL, lambda: {p.pid, *started_by(token)})):
            for pid in pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(2)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(its output could not be read)"
        raise AssertionError(f"timed out after {timeout}s ({state}): {' '.join(p.args)}\n{out[-3000:]}\n"
                             f"{err[-12000:]}") from None


def env_ranks(nproc, port):
    """The variables of `nproc` ranks launched by hand (env://: a launch script, a Kubernetes pod, another launcher),
    rank 0 serving the rendezvous on 127.0.0.1:`port`: one dict per rank, for clean_env."""
    return [dict(RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(nproc),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) for r in range(nproc)]


def worker_exit_codes(output):
    """{rank: exit code} of the failed workers in torchrun's failure report ("rank : 1 (local_rank: 1)" then
    "exitcode : 2 (pid: ...)"): torchrun itself exits 1 for any failure, whatever its workers' codes."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output)}


def assert_exit(p, code, nproc=None):
    """The documented exit status `code` (docs/failures.md) for what `p` ran: the script's own status where it is
    the process (python, mp.spawn's parent); under torchrun, every failed worker's in torchrun's report (torchrun
    itself exits 1), all `nproc` of them if given."""
    output = p.stdout + p.stderr
    if "torch.distributed.run" not in p.args and "torch.distributed.launch" not in p.args:
        assert p.returncode == code, f"exit status {p.returncode}, not {code}\n{output[-4000:]}"
        return
    if code == 0:
        assert p.returncode == 0 and not worker_exit_codes(output), output[-4000:]
        return
    codes = worker_exit_codes(output)
    assert p.returncode == 1 and codes and set(codes.values()) == {code}, f"{codes}, not {code}\n{output[-4000:]}"
    if nproc is not None:
        assert sorted(codes) == list(range(nproc)), f"failed ranks {sorted(codes)}\n{output[-4000:]}"


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


def alive(pid):
    """Whether process `pid` is running: there, and not a zombie (one that has exited and waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


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


def flat(state, prefix=""):
    """A state dict, nested ones (an optimizer's state) included, as {"a.b": leaf}."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def max_diff(a, b, keys=None):
    """Max absolute difference between two state dicts (nested ones too: an optimizer's state), over all their
    entries (the same keys required) or over `keys`. Every value is looked at: a NaN or inf in any tensor of either
    side fails, and so does any other entry that differs (an integer tensor such as BatchNorm's num_batches_tracked,
    a shape, a number)."""
    a, b = flat(a), flat(b)
    if keys is None:
        assert a.keys() == b.keys(), f"keys differ: {sorted(set(a) ^ set(b))[:10]}"
        keys = list(a)
    assert set(keys) <= a.keys() and set(keys) <= b.keys(), sorted(set(keys) - (a.keys() & b.keys()))[:10]
    largest = 0.0
    for k in keys:
        x, y = a[k], b[k]
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            assert x == y, (k, x, y)
            continue
        assert x.shape == y.shape, (k, x.shape, y.shape)
        if not (x.is_floating_point() or x.is_complex()):
            assert torch.equal(x, y), k
            continue
        assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"{k}: NaN or inf"
        if x.numel():
            largest = max(largest, (x.double() - y.double()).abs().max().item())
    return largest


def summary_lines(output, prefix="epoch "):
    """The per-epoch summary lines (the progress bar is drawn on the same terminal line before them)."""
    return [line[line.index(prefix):] for line in output.replace("\r", "\n").splitlines()
            if prefix in line and "train_loss" in line]


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")
