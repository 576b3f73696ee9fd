"""Running a launcher (torchrun, mp.spawn's parent, srun) while a test watches it, and hooks that make the moments a
test acts in exact: a rank that waits at a given step, or stops answering there, a checkpoint save that waits
half-written, a sharded save that waits after writing its part, slow steps. The hooks are a sitecustomize.py on
PYTHONPATH, so that they reach every Python process of a run (torchrun's workers, mp.spawn's children, srun's tasks).
They patch only torch's and Python's own functions (an optimizer step hook, torch.save, DCP's
FileSystemWriter.write_data, signal.signal, sys.exit, os._exit), never the scripts' code: they mean the same whatever
common.py does inside.

Every hook leaves a mark, a file in the folder TEST_HOOKS names, and those that wait go on once the test creates the
file `go-pause`, `go-save` or `go-dcp` there (Hooks.go):

    steps-rank<r>          optimizer steps taken so far by rank r (this process's: a resumed run counts from 0)
    paused-rank<r>         rank r waits after its optimizer step TEST_PAUSE_AT (the file holds its pid)
    handled-<SIG>-<pid>    process pid has taken signal SIG: its Python handler is running
    exit-rank<r>           rank r, having trained, called sys.exit or os._exit: the status it asked for
    teardown-rank<r>       rank r, having trained, went through the interpreter's teardown (not left by os._exit)
    saving-rank<r>         the TEST_STALL_SAVE-th checkpoint that rank r writes with torch.save is half on disk (JSON:
                           path, bytes written, bytes in all, pid): the other half follows `go-save`
    stalled-rank<r>        rank r's part of a sharded (DCP) save, from the TEST_STALL_DCP-th on, is written, but
                           write_data has not returned: the save is incomplete (ckpt-<step>.tmp) until
                           `go-dcp`, after which no save waits
    hung-rank<r>           rank r stops answering after its optimizer step TEST_HANG_AT ("rank:step"): an hour's
                           sleep, which a signal's Python handler does not end (the file holds its pid)
Each optimizer step takes TEST_STEP_S seconds more (a slow model). The TEST_FAIL_SAVE-th checkpoint that a process
writes with torch.save
fails, as on a full disk; the TEST_FAIL_METRICS-th row appended to metrics.jsonl, as over a disk quota ("n"), or as
on a disk that fills up mid-row ("n:short": half of it written).
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import descendants
from conftest import clean_env as fresh_env

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds, for any one command

SITE = r'''
import os


def _install():
    import io, json, signal, sys, time

    _dir = os.environ["TEST_HOOKS"]

    def _mark(name, text=""):  # whole or not at all: written aside, then renamed
        tmp = os.path.join(_dir, f".{name}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(_dir, name))

    def _go(what):
        return os.path.exists(os.path.join(_dir, f"go-{what}"))

    def _wait_for_go(what):
        while not _go(what):
            time.sleep(0.01)

    _signal = signal.signal

    def _marking_signal(signum, handler):  # every Python-level handler marks that it ran, then does its work
        if callable(handler):
            def marked(s, frame, inner=handler):
                _mark(f"handled-{signal.Signals(s).name}-{os.getpid()}")
                return inner(s, frame)
            return _signal(signum, marked)
        return _signal(signum, handler)
    signal.signal = _marking_signal

    _trained_as = []  # the rank of this process, once it has taken an optimizer step: a rank, not a launcher

    def _marking_exit(exit):  # a rank's status, where no test can wait for it (torchrun's workers)
        def marked(code=None):
            if _trained_as:
                _mark(f"exit-rank{_trained_as[0]}", str(code))
            exit(code)
        return marked
    sys.exit, os._exit = _marking_exit(sys.exit), _marking_exit(os._exit)

    import atexit  # its handlers run in the interpreter's teardown, which os._exit skips
    atexit.register(lambda: _trained_as and _mark(f"teardown-rank{_trained_as[0]}"))

    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _rank():
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    _pause_at, _step_s = int(os.environ.get("TEST_PAUSE_AT", "0")), float(os.environ.get("TEST_STEP_S", "0"))
    _hang_at = tuple(map(int, os.environ["TEST_HANG_AT"].split(":"))) if os.environ.get("TEST_HANG_AT") else None
    _steps = [0]

    def _after_step(optimizer, args, kwargs):
        _steps[0] += 1
        rank = _rank()
        _trained_as[:] = [rank]
        _mark(f"steps-rank{rank}", str(_steps[0]))
        if _steps[0] == _pause_at:
            _mark(f"paused-rank{rank}", str(os.getpid()))
            _wait_for_go("pause")
        if (rank, _steps[0]) == _hang_at:
            _mark(f"hung-rank{rank}", str(os.getpid()))
            time.sleep(3600)
        time.sleep(_step_s)
    register_optimizer_step_post_hook(_after_step)

    import builtins
    _open, (_fail_metrics, _, _short) = builtins.open, os.environ.get("TEST_FAIL_METRICS", "0").partition(":")
    _rows = [0]

    class _HalfWrite:  # the disk full mid-row: half of it written, and write() says so, as an unbuffered file does
        def __init__(self, f):
            self.f, self.tell, self.truncate = f, f.tell, f.truncate

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            return self.f.write(data[:len(data) // 2])

    def _failing_open(file, mode="r", *args, **kwargs):  # the TEST_FAIL_METRICS-th row appended fails
        if str(file).endswith("metrics.jsonl") and mode == "ab":
            _rows[0] += 1
            if _rows[0] == int(_fail_metrics) and not _short:
                raise OSError(122, "Disk quota exceeded")  # EDQUOT
            if _rows[0] == int(_fail_metrics):
                return _HalfWrite(_open(file, mode, *args, **kwargs))
        return _open(file, mode, *args, **kwargs)
    if int(_fail_metrics):
        builtins.open = _failing_open

    _stall_save, _save, _saves = int(os.environ.get("TEST_STALL_SAVE", "0")), torch.save, [0]
    _fail_save = int(os.environ.get("TEST_FAIL_SAVE", "0"))

    def _torch_save(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and "model" in obj and "optimizer" in obj):  # not a checkpoint
            return _save(obj, f, *args, **kwargs)
        _saves[0] += 1
        if _saves[0] == _fail_save:  # as a full disk: torch's own error there ("unexpected pos") names no cause
            raise OSError(28, "No space left on device")
        if _saves[0] != _stall_save:
            return _save(obj, f, *args, **kwargs)
        whole = io.BytesIO()
        _save(obj, whole, *args, **kwargs)
        data = whole.getvalue()
        own = isinstance(f, (str, os.PathLike))
        out = open(f, "wb") if own else f
        out.write(data[:len(data) // 2])
        out.flush()
        os.fsync(out.fileno())
        _mark(f"saving-rank{_rank()}", json.dumps({"path": os.path.abspath(out.name), "written": len(data) // 2,
                                                   "size": len(data), "pid": os.getpid()}))
        _wait_for_go("save")
        out.write(data[len(data) // 2:])
        if own:
            out.close()
    torch.save = _torch_save

    if os.environ.get("TEST_STALL_DCP"):
        from torch.distributed.checkpoint import filesystem as _filesystem
        _stall_dcp, _write, _writes = int(os.environ["TEST_STALL_DCP"]), _filesystem.FileSystemWriter.write_data, [0]

        def _write_data(self, plan, planner):
            result = _write(self, plan, planner)
            _writes[0] += 1
            if _writes[0] >= _stall_dcp and not _go("dcp"):
                _mark(f"stalled-rank{_rank()}", str(self.path))
                _wait_for_go("dcp")
            return result
        _filesystem.FileSystemWriter.write_data = _write_data


if os.environ.get("TEST_HOOKS"):
    try:
        _install()
    except BaseException:  # Python would print one line and go on without the hooks: the test would mean nothing
        import traceback
        traceback.print_exc()
        os._exit(70)
'''


def clean_env(base=None, **extra):
    """The environment of a fresh launch (conftest.clean_env), with Python's stacks printed on SIGABRT and this
    Python first on PATH. Of a SLURM cluster's environment `base` it keeps SLURM_CONF, which names the cluster."""
    env = fresh_env(base, PYTHONFAULTHANDLER="1",
                    PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), **extra)
    if base is not None and "SLURM_CONF" in base:
        env["SLURM_CONF"] = base["SLURM_CONF"]
    return env


def torchrun(*launcher_args):
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args]


def worker_env(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def signal_pending(pid, sig):
    """Whether `sig` waits for delivery to `pid` (as a signal sent to a stopped process does), from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False  # gone: whatever was sent has been delivered
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in pending)


class Proc:
    """A command in a session of its own, output to a file; killed with everything it started at its deadline."""

    def __init__(self, cmd, log, env=None, cwd=REPO):
        self.cmd, self.log = [str(c) for c in cmd], Path(log)
        # SIGINT as a terminal leaves it: a shell that runs the tests in the background ignores it, and so, inherited,
        # would every process
        self.p = subprocess.Popen(self.cmd, cwd=cwd, env=env or clean_env(), stdout=open(self.log, "wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.deadline = time.monotonic() + TIMEOUT

    def output(self):
        return self.log.read_text(errors="replace")

    def kill(self, diagnose=False):
        """Kill the command and every process under it (torchrun starts its workers in sessions of their own).
        diagnose: first SIGABRT, on which Python processes print their stacks (PYTHONFAULTHANDLER)."""
        if self.p.poll() is not None:  # ended and reaped: its pid may be another process's by now
            return
        tree = [self.p.pid] + descendants(self.p.pid)  # before any dies: orphans are untraceable
        for sig in ((signal.SIGABRT,) if diagnose else ()) + (signal.SIGKILL,):
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGABRT:
                time.sleep(2)
        self.p.wait()

    def wait(self, expect=0):
        try:
            rc = self.p.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill(diagnose=True)
            pytest.fail(f"timed out after {TIMEOUT}s: {' '.join(self.cmd)}\n{self.output()[-3000:]}")
        if expect is not None:
            assert rc == expect, f"exit status {rc}: {' '.join(self.cmd)}\n{self.output()[-3000:]}"
        return self.output()

    def until(self, ready, what):
        """Wait for ready() while the command runs; fail if it ends first or its deadline passes."""
        while not ready():
            if self.p.poll() is not None:
                pytest.fail(f"the run ended (exit status {self.p.returncode}) before {what}\n{self.output()[-3000:]}")
            if time.monotonic() > self.deadline:
                self.kill(diagnose=True)
                pytest.fail(f"timed out waiting for {what}\n{self.output()[-3000:]}")
            time.sleep(0.01)

    def result(self):
        """The ended command as conftest.assert_exit takes it: args, returncode, stdout (all output), stderr."""
        return subprocess.CompletedProcess(self.cmd, self.p.returncode, self.output(), "")


class Hooks:
    """The hooks (see the module's docstring) for the processes a test starts with `env`, and their marks."""

    def __init__(self, tmp_path, **settings):
        """settings: pause_at=step, stall_save=n, fail_save=n, fail_metrics=n or "n:short", stall_dcp=n,
        hang_at="rank:step",
        step_s=seconds."""
        site, self.dir = Path(tmp_path) / "site", Path(tmp_path) / "marks"
        site.mkdir(exist_ok=True)
        self.dir.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITE)
        path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
        self.env = {"PYTHONPATH": path, "TEST_HOOKS": str(self.dir),
                    **{f"TEST_{k.upper()}": str(v) for k, v in settings.items()}}

    def ranks(self, kind):
        """{rank: the text of its mark} for marks `<kind>-rank<r>`."""
        return {int(p.name.rsplit("rank", 1)[1]): p.read_text() for p in self.dir.glob(f"{kind}-rank*")}

    def steps(self):
        """{rank: the optimizer steps it took}."""
        return {r: int(text) for r, text in self.ranks("steps").items()}

    def paused(self):
        """{rank: pid} of the ranks waiting at TEST_PAUSE_AT."""
        return {r: int(text) for r, text in self.ranks("paused").items()}

    def exits(self):
        """{rank: the status it asked sys.exit or os._exit for} (its own, unless a signal killed it first)."""
        return {r: int(text) for r, text in self.ranks("exit").items()}

    def handled(self, pid, sig):
        return (self.dir / f"handled-{signal.Signals(sig).name}-{pid}").exists()

    def go(self, *what):
        """What waits goes on: `what` of "pause", "save", "dcp" (default: all)."""
        for name in what or ("pause", "save", "dcp"):
            (self.dir / f"go-{name}").touch()
