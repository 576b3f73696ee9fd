"""DataLoader workers started by a fork server, not forked from the training process, on the
Pythons where such a fork can deadlock the worker at its start, and the run with it.

The bug is CPython's, python/cpython#112275: a fork while another thread holds the runtime's
thread-list lock (as gloo's threads do when they free a tensor, about 25 times an epoch) leaves the
child waiting on that lock forever. Measured here on Python 3.11.7: 3 hangs in about 1,200 forked
worker starts; none in 8,000 from the fork server (docs/failures.md). Fixed in 3.8.20, 3.9.20,
3.10.15 and 3.11.10 (python/cpython#112336); 3.12 and later never had it. Delete this file when
no Python you run is older than those: common.make_loader then starts workers as torch does.

The server is forked from the training process at its start (fork_server), while that is the only
thread, with all it has imported: a worker starts in milliseconds, its Dataset pickled to reach it.
Where fork_server made none (start), the server is a fresh interpreter that imports torch and the
script's modules again: 3.4 s from the first DataLoader to its first batch on 2 cores, against
about 0.1 s forked (benchmarks/files.py); and each worker runs the script's top lines again."""
import inspect
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading

import failsafe

# the first release of each line with the fix; 3.12 and later never had the bug
FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
AFFECTED = sys.version_info < (3, 12) and \
    sys.version_info[2] < FIXED.get(sys.version_info[:2], 99)


def start(ds):
    """The DataLoader's arguments that start its workers from the fork server, where needed."""
    if not AFFECTED or "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    context = multiprocessing.get_context("forkserver")
    # what the script imported, and what the Dataset's attributes come from (a torchvision
    # transform is imported where the Dataset is made): Python 3.11's preload of __main__ finds none
    main, own = vars(sys.modules["__main__"]).values(), getattr(ds, "__dict__", {}).values()
    imported = {v.__name__ if inspect.ismodule(v) else getattr(v, "__module__", None)
                for v in [ds, *own, *main]}
    context.set_forkserver_preload(sorted(m for m in imported if isinstance(m, str)
                                          and not m.startswith("_")))
    from multiprocessing import forkserver
    # where fork_server made none: a fresh interpreter, deaf to the stop signals as every helper
    # of the workers (the tracker first: forkserver's own start would start it in this group)
    failsafe.start_deaf(forkserver.ensure_running)
    return dict(multiprocessing_context=context)  # its workers: failsafe.init_worker, as every one


def fork_server(args):
    """The fork server, forked from this process now: the script's first step, before the process
    group's threads, where no other thread runs yet. Only where the run reads files with workers
    (--dataset imagefolder, or a Dataset of your own: no --dataset flag), and on Linux (macOS's
    system libraries are not safe to fork: there the server below starts as a fresh interpreter).
    torchvision, which ImageFiles' workers use, is imported first."""
    if not (AFFECTED and args.workers and sys.platform == "linux" and threading.active_count() == 1
            and getattr(args, "dataset", "imagefolder") == "imagefolder"):
        return
    if hasattr(args, "dataset"):
        import torchvision.transforms.v2  # noqa: F401
    from multiprocessing import forkserver
    failsafe.start_resource_tracker()  # as forkserver's own start would: the workers share it
    # its socket in a folder of its own, which the server removes as it ends (the scripts end by
    # os._exit: multiprocessing's own pymp-* folder would stay in TMPDIR, one each run)
    folder = tempfile.mkdtemp(prefix="workers-")
    # a socket's path ends at 107 bytes, not characters: a deep TMPDIR gets "path too long"
    if len(os.fsencode(folder)) > 90:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="workers-", dir="/tmp")
    listener, address = socket.socket(socket.AF_UNIX), os.path.join(folder, "server")
    listener.bind(address)
    listener.listen()
    alive_r, alive_w = os.pipe()  # it ends when this process does (its end of alive_w closes)
    if (pid := os.fork()) == 0:
        os.close(alive_w)
        for sig in failsafe.STOP_SIGNALS:  # the trainer's to act on; its workers inherit it
            signal.signal(sig, signal.SIG_IGN)
        try:
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(0)
    os.close(alive_r)
    listener.close()
    # forkserver.ensure_running's own state, private names (as on every Python this file runs on)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd = address, alive_w
    server._forkserver_pid = pid
