"""A job's stop under every way DataLoader workers start: fork (Linux, to Python 3.13), forkserver (Linux's default from
Python 3.14) and spawn (macOS, Windows), each forced (the hooks' TEST_START_METHOD), under every launcher: the job test
of test_signals.py (the signal to every process of the job while every rank waits at step 6), in a file of its own so
that it runs beside that one. train_extras/workers.py is left out: the workers start as torch starts them, by the core's
own path (failsafe.DeafWorkersLoader), as on every Python where workers.py does nothing (3.11.10 and newer). A job's
stop signal reaches the workers and the helpers of their start method too: the fork server, the resource tracker, and
mp.spawn's parent's tracker, which its children use. (mp.spawn's children start their workers by spawn whatever the
default: they are spawned, and spawn's set-up sets it.)"""
import os
import shutil
import signal

import pytest

from hooks import Hooks
from processes import ROOT
from test_signals import PAUSE, stop_the_job, unbroken_job  # noqa: F401  (unbroken_job: a fixture)

START_CASES = [  # launch, signal, script, start method: each method once in the everyday tier
    ("torchrun", signal.SIGUSR1, "ddp_launch_train.py", "fork"),
    ("torchrun", signal.SIGTERM, "ddp_launch_train.py", "forkserver"),
    ("python", signal.SIGUSR1, "ddp_launch_train.py", "spawn"),
    *[pytest.param(launch, sig, script, method, marks=pytest.mark.full) for launch, sig, script, method in [
        ("python", signal.SIGTERM, "ddp_launch_train.py", "fork"),
        ("python", signal.SIGHUP, "ddp_launch_train.py", "forkserver"),
        ("torchrun", signal.SIGTERM, "ddp_launch_train.py", "spawn"),
        ("mp.spawn", signal.SIGUSR1, "ddp_spawn_train.py", "spawn")]]]


@pytest.fixture(scope="module")
def without_workers_py(tmp_path_factory):
    """A copy of the scripts, common.py, failsafe.py and train_extras/ but workers.py."""
    folder = tmp_path_factory.mktemp("checkout")
    for name in ("common.py", "failsafe.py", "ddp_launch_train.py", "ddp_spawn_train.py"):
        shutil.copy(ROOT / name, folder)
    shutil.copytree(ROOT / "train_extras", folder / "train_extras",
                    ignore=shutil.ignore_patterns("workers.py", "__pycache__"))
    return folder


@pytest.mark.workers
@pytest.mark.parametrize("launch, sig, script, method", START_CASES, ids=lambda v: getattr(v, "name", v))
def test_a_job_stop_saves_and_leaves_nothing_however_the_workers_start(launch, sig, script, method, images,
                                                                     unbroken_job, without_workers_py, short_tmp,
                                                                     tmp_path, measured):
    """test_signals.py's job test (the signal to every process of the job at step 6), with the workers started by
    `method`: one save at one agreed step, the signal's status, no other line, nothing left, a bit-exact resume."""
    hooks = Hooks(tmp_path, pause_at=PAUSE, start_method=method)
    stop_the_job(launch, sig, script, [], "job", hooks, images, unbroken_job, short_tmp, tmp_path, measured,
                 cwd=without_workers_py)


@pytest.mark.workers
@pytest.mark.parametrize("method", ["fork", pytest.param("forkserver", marks=pytest.mark.full),
                                    pytest.param("spawn", marks=pytest.mark.full)])
def test_a_job_under_a_tmpdir_too_deep_for_a_socket_trains_stops_and_leaves_nothing(method, images, unbroken_job,
                                                                                   without_workers_py, short_tmp,
                                                                                   tmp_path, measured):
    """TMPDIR 60 Cyrillic letters deep (a socket's path in it would pass 107 bytes; clusters set such ones): the
    workers' sockets go to one multiprocessing folder per trainer, made in /tmp, and the job test passes (one save,
    nothing left in TMPDIR, a bit-exact resume); each trainer's folder is gone after it."""
    deep = short_tmp / ("\u0434" * 60)
    deep.mkdir()
    assert len(os.fsencode(deep)) + len("/pymp-12345678/listener-12345678") > 107
    hooks = Hooks(tmp_path, pause_at=PAUSE, start_method=method)
    stop_the_job("torchrun", signal.SIGTERM, "ddp_launch_train.py", [], "job", hooks, images, unbroken_job, deep,
                 tmp_path, measured, cwd=without_workers_py)
    folders = hooks.ranks("mp-tempdir")
    assert sorted(folders) == [0, 1] and all(f.startswith("/tmp/pymp-") for f in folders.values()), folders
    assert not any(os.path.exists(f) for f in folders.values()), folders
