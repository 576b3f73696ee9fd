"""DataLoader workers started by a fork server, not forked from the training process, on the
Pythons where such a fork can deadlock the worker at its start, and the run with it.

The bug is CPython's, python/cpython#112275: a fork while another thread holds the runtime's
thread-list lock (as gloo's threads do when they free a tensor, about 25 times an epoch) leaves the
child waiting on that lock forever. Measured here on Python 3.11.7: 3 hangs in about 1,200 forked
worker starts; none in 8,000 from the fork server (docs/failures.md). Fixed in 3.8.20, 3.9.20,
3.10.15 and 3.11.10 (python/cpython#112336); 3.12 and later never had it. Delete this file when
no Python you run is older than those: common.make_loader then starts workers as torch does.

The server starts once, with torch and the script's own imports loaded: a worker, which runs the
script's top lines again, starts in milliseconds. Its Dataset is pickled to reach it."""
import inspect
import multiprocessing
import os
import sys

import common

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
    return dict(multiprocessing_context=context, worker_init_fn=leave_server)


def leave_server(worker_id):
    """In each worker: the server runs while any process holds its end of a pipe, the workers too,
    and a worker runs while its parent, the server, does. Closed here, the server ends with the
    training process even when that is killed outright, and each worker within 5 s of the server
    (torch's check of its parent). There is no public way to do this: a private name, skipped
    where it is missing. Then common.deaf's: the trainer alone acts on Ctrl-C and stop signals."""
    from multiprocessing import forkserver
    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    common.deaf(worker_id)
