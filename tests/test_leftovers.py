"""The suite's own leftover check (conftest.py): it fails a run whose tests leave something behind, and only then. A
pytest run of its own, with the suite's conftest.py, runs one test: in the first, a process the test starts leaves a
named semaphore in /dev/shm, as one whose resource tracker was killed would; in the second, another program (this
test, outside that run) writes into /tmp and /dev/shm while that run's test waits: files of its own, and the files
this session's tests make (another session of the suite, running meanwhile)."""
import os
import sys
import time

import pytest

from processes import SETTINGS, TESTS, Proc

INNER = '''
import os, sys, time
from processes import clean_env, command

LEAK = """
import multiprocessing, os
from multiprocessing import resource_tracker
semaphore = multiprocessing.get_context("spawn").Semaphore()  # named, in /dev/shm
resource_tracker.unregister(semaphore._semlock.name, "semaphore")  # as if the tracker were killed
os._exit(0)
"""


def test_a_run_leaves_a_semaphore():
    command([sys.executable, "-c", LEAK], env=clean_env(), check=True)


def test_another_program_writes_meanwhile():
    open(os.environ["INNER_STARTED"], "w").close()
    while not os.path.exists(os.environ["INNER_GO"]):
        time.sleep(0.05)
'''


INNER_TAG = f"inner{os.getpid()}"  # that run's tag (conftest.TAG), apart from this run's own tests'


def inner_semaphores():
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"sem.mp-tests-{INNER_TAG}-")}


def inner_run(tmp_path, test):
    """That run (its output, merged) of the one test named `test`, started in a session of its own."""
    (tmp_path / "test_inner.py").write_text(INNER)
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / f"test_inner.py::{test}")]
    env = {"PYTHONPATH": str(TESTS), "INNER_STARTED": str(tmp_path / "started"), "INNER_GO": str(tmp_path / "go"),
           "TEST_SESSION_TAG": INNER_TAG}
    return Proc(cmd, tmp_path / "log", cwd=tmp_path, env=env, merge=True, fork=False)


@pytest.mark.full
def test_the_leftover_check_fails_a_run_whose_test_leaves_a_semaphore(tmp_path):
    left = set()
    try:
        p = inner_run(tmp_path, "test_a_run_leaves_a_semaphore")
        p.wait(expect=None)
        left = inner_semaphores()
        lines = [line for line in p.output().splitlines() if "which fails the run" in line]
        assert p.returncode == 1 and len(lines) == 1 and len(left) == 1, (left, p.output()[-3000:])
        assert f"shm:{left.pop()}" in lines[0], p.output()[-3000:]
    finally:
        for name in inner_semaphores():  # not left for good: no check sees that run's names after it
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.full
def test_the_leftover_check_passes_a_run_while_another_program_writes_into_tmp_and_dev_shm(tmp_path):
    p, made = inner_run(tmp_path, "test_another_program_writes_meanwhile"), []
    try:
        p.until(lambda: (tmp_path / "started").exists(), "the inner test running")
        tag = f"other-{os.getpid()}-{time.monotonic_ns()}"
        made = [f"/tmp/{tag}", f"/tmp/{SETTINGS['short_tmp']}{tag}", f"/dev/shm/sem.mp-{tag}", f"/dev/shm/{tag}",
                f"/dev/shm/sem.{SETTINGS['semaphores'][1:]}-{tag}"]  # this session's tests' names too
        os.mkdir(made[0])
        for path in made[1:]:
            open(path, "w").close()
        (tmp_path / "go").touch()
        p.wait(expect=None)
        assert p.returncode == 0 and "left behind" not in p.output(), p.output()[-3000:]
    finally:
        for path in made:
            if os.path.isdir(path):
                os.rmdir(path)
            elif os.path.exists(path):
                os.unlink(path)
