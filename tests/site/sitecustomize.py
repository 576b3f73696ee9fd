"""The test hooks (tests/hooks.py says what each does), installed at the start of every Python process whose
environment names TEST_HOOKS and has this folder on PYTHONPATH: torchrun's workers, mp.spawn's children, srun's tasks
and the runs forked by tests/forker.py alike. They patch only torch's and Python's own functions, never the scripts'."""
import os
import sys


def _install():
    import io
    import json
    import signal
    import sys
    import time

    _dir = os.environ["TEST_HOOKS"]

    _marks = iter(range(2**62))

    def _mark(name, text=""):  # whole or not at all: written aside, then renamed. A name of its own for each
        # call: a signal handler's mark may interrupt another (the same signal twice, from a launcher and a job)
        tmp = os.path.join(_dir, f".{name}.{os.getpid()}.{next(_marks)}")
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

    _group_threads = {}  # {pid: the threads that init_process_group started there} (a forked worker has none)

    def _marking_exit(exit):  # a rank's status, where no test can wait for it (torchrun's workers)
        def marked(code=None):
            threads = _group_threads.get(os.getpid())
            if _trained_as and threads is not None:
                alive = [t for t in threads if os.path.exists(f"/proc/self/task/{t}")]
                _mark(f"group-threads-rank{_trained_as[0]}", f"{len(alive)} {len(threads)}")
            if _trained_as:
                _mark(f"exit-rank{_trained_as[0]}", str(code))
                mp = sys.modules.get("multiprocessing")  # its temporary folder (pymp-*), if it made one
                _mark(f"mp-tempdir-rank{_trained_as[0]}", mp and mp.current_process()._config.get("tempdir") or "")
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

    if dist.is_available() and os.path.isdir("/proc/self/task"):  # (Linux)
        _init_process_group = dist.init_process_group

        def _noting_threads(*args, **kwargs):  # the threads it starts: a destroyed process group's end with it
            before = set(os.listdir("/proc/self/task"))
            group = _init_process_group(*args, **kwargs)
            _group_threads[os.getpid()] = sorted(set(os.listdir("/proc/self/task")) - before)
            return group
        dist.init_process_group = _noting_threads

    # TEST_PAUSE_AT: a step (every rank pauses there), or "rank:step" (that rank alone)
    _pause_rank, _, _pause_at = os.environ.get("TEST_PAUSE_AT", "0").rpartition(":")
    _pause_at, _step_s = int(_pause_at), float(os.environ.get("TEST_STEP_S", "0"))
    _hang_at = tuple(map(int, os.environ["TEST_HANG_AT"].split(":"))) if os.environ.get("TEST_HANG_AT") else None
    _steps = [0]

    def _after_step(optimizer, args, kwargs):
        _steps[0] += 1
        rank = _rank()
        _trained_as[:] = [rank]
        _mark(f"steps-rank{rank}", str(_steps[0]))
        if _steps[0] == _pause_at and _pause_rank in ("", str(rank)):
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

    if os.environ.get("TEST_EVAL_S"):  # each evaluation batch takes that long: the scripts' evaluate() alone sums
        import torch.nn.functional as F
        _cross_entropy, _eval_s = F.cross_entropy, float(os.environ["TEST_EVAL_S"])

        def _slow_cross_entropy(*args, **kwargs):
            if kwargs.get("reduction") == "sum":
                _mark(f"evaluating-rank{_rank()}")
                time.sleep(_eval_s)
            return _cross_entropy(*args, **kwargs)
        F.cross_entropy = _slow_cross_entropy

    if os.environ.get("TEST_SEE_DIR"):  # in training mode, the dtype each Conv2d and Linear returned, and the threads
        import threading  # torch had at the first such call: SEE_DIR/<pid>.json, whenever something new is seen
        _see_lock = threading.Lock()
        _seen = {"pid": os.getpid(), "rank": None, "threads": None, "cpus": None, "dtypes": {}}

        def _write_seen():
            path = os.path.join(os.environ["TEST_SEE_DIR"], f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(_seen, f)
            os.replace(path + ".tmp", path)

        def _see(module, args, out):
            layers = (torch.nn.Conv2d, torch.nn.Linear)
            if not (module.training and isinstance(module, layers) and torch.is_tensor(out)):
                return
            kind = "Conv2d" if isinstance(module, torch.nn.Conv2d) else "Linear"  # FSDP renames the class FSDPConv2d
            with _see_lock:
                if _seen["threads"] is None or str(out.dtype) not in _seen["dtypes"].get(kind, []):
                    if _seen["threads"] is None:
                        _seen["threads"], _seen["cpus"] = torch.get_num_threads(), len(os.sched_getaffinity(0))
                        _seen["rank"] = _rank() if dist.is_initialized() else None
                    _seen["dtypes"][kind] = sorted({*_seen["dtypes"].get(kind, []), str(out.dtype)})
                    _write_seen()
        torch.nn.modules.module.register_module_forward_hook(_see)

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


if os.environ.get("TEST_SEMAPHORES"):  # the suite's named semaphores, told apart from other programs' in /dev/shm
    import multiprocessing  # (conftest's leftover check): sem.mp-tests-<tag>-*, in this process and in its children
    multiprocessing.current_process()._config["semprefix"] = os.environ["TEST_SEMAPHORES"]

if os.environ.get("TEST_START_METHOD"):  # how processes start, DataLoader workers too (fork, forkserver, spawn)
    import multiprocessing
    multiprocessing.set_start_method(os.environ["TEST_START_METHOD"], force=True)

# not in multiprocessing's helper processes (the resource tracker, the fork server), which train nothing: they would
# import torch for it
_HELPER = any(name in arg for arg in getattr(sys, "orig_argv", [])
              for name in ("multiprocessing.resource_tracker", "multiprocessing.forkserver"))
if os.environ.get("TEST_HOOKS") and not _HELPER:
    try:
        _install()
    except BaseException:  # Python would print one line and go on without the hooks: the test would mean nothing
        import traceback
        traceback.print_exc()
        os._exit(70)
