"""A Python that has imported torch once and forks a copy of itself for each run a test asks for: `python script.py
ARGS` (or `python -m MODULE ARGS`) starts in about 0.1 s of CPU instead of about 4 s. The tests use it for lone
processes and for ranks started by hand (env://) where the launcher is not what the test is about; torchrun, mp.spawn
and srun, and every test about how a process starts or ends, start real interpreters (processes.py).

What a forked run shares with a fresh interpreter, and what it does not:
- it runs the script as `__main__` (runpy), in its own session, with the environment, working directory, argv,
  sys.path (the script's folder first, then PYTHONPATH) and standard streams a fresh `python -u` would have, the
  signals at their defaults, PYTHONFAULTHANDLER honoured, and a sitecustomize.py on PYTHONPATH run first (the hooks
  of hooks.py);
- it inherits the modules imported here: torch, torchvision, tqdm, numpy, PIL, and torch.distributed's modules that
  the scripts import. These read the environment of this process when imported: the one conftest.clean_env gives
  (OMP_NUM_THREADS=1, no GPU visible). A run whose environment differs in what they read (another OMP_NUM_THREADS,
  a simulated platform) must start a real interpreter: processes.forkable says which.
- nothing of the project is imported here: a script imports its own common.py (a copy in another folder, too).

Protocol, one JSON object a line: a request on stdin {"argv", "cwd", "env", "out", "err"} is answered on stdout with
{"pid"}; a child's end with {"pid", "status"} (the status as subprocess gives it: the exit code, or minus the signal).
The server must be the only thread when it forks (no child inherits a lock held by another): it runs no thread of its
own, and polls for requests and ended children."""
import faulthandler
import io
import json
import multiprocessing.process
import os
import random
import runpy
import select
import signal
import sys
import tempfile
import traceback

import numpy
import PIL.Image  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.multiprocessing  # noqa: F401
import torch.nn.parallel  # noqa: F401
import torch.utils.data  # noqa: F401
import torchvision  # noqa: F401
import torchvision.transforms.v2  # noqa: F401
import tqdm  # noqa: F401

# what a fresh interpreter's sys.path holds after its first entry (the script's folder): the standard library and
# site-packages, without this file's folder and without PYTHONPATH (each run's own is put in)
BASE_PATH = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]


def run_child(request):
    """In the forked child: become `python ARGV` as a fresh interpreter would, run it, and never return."""
    code = 1
    try:
        os.setsid()
        for sig in range(1, signal.NSIG):
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets them at start-up
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in request.get("ignored", []):  # what the caller's process would have passed on ignored (nohup's)
            signal.signal(sig, signal.SIG_IGN)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # found again from TMPDIR, as a fresh interpreter does
        # what a fresh interpreter sets at its start, here of this process at its: the working directory that
        # mp.spawn's children resolve the script's path from, the authentication key of its children, the seeds
        multiprocessing.process.ORIGINAL_DIR = os.getcwd()
        multiprocessing.current_process().authkey = os.urandom(32)
        random.seed()
        numpy.random.seed()
        # `python -u`: unbuffered binary streams, text written through
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      errors="backslashreplace")
        sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        argv = request["argv"][1:]  # after "python"
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[0] == "-m":
            sys.argv, first = argv[1:], os.getcwd()
        else:
            sys.argv, first = argv, os.path.dirname(os.path.abspath(argv[0]))
        sys.path[:] = [first, *extra, *BASE_PATH]
        for folder in extra:  # site.py imports sitecustomize from the path at start-up
            if os.path.isfile(os.path.join(folder, "sitecustomize.py")):
                runpy.run_path(os.path.join(folder, "sitecustomize.py"), run_name="sitecustomize")
                break
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001 as the interpreter prints it
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def reply(message):
    sys.__stdout__.write(json.dumps(message) + "\n")
    sys.__stdout__.flush()


def serve():
    pending, children = "", set()
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.02)
        if readable:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            if not data:  # the tests ended: so does the server (its children are on their own)
                return
            pending += data.decode()
            while "\n" in pending:
                line, pending = pending.split("\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request)
                children.add(pid)
                reply({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                reply({"pid": pid, "status": code})


if __name__ == "__main__":
    serve()
