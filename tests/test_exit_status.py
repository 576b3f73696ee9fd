"""The documented exit statuses (docs/failures.md, "Exit codes") in the launch styles that the other tests do not
cover: ranks of ddp_launch_train.py started by hand (env://: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
by whoever starts them), where each process's own status is the contract; a hang (3) under mp.spawn, whose parent
passes on its first failed child's status; and srun, which returns the highest status of its tasks (its man page,
RETURN VALUE) and names each task's in its own report. Plain python and torchrun are covered in test_failures.py
(1, 2), test_usage.py and test_scripts.py (2); the signals (0 after SIGUSR1, 143) in test_signals.py.

A rank that stops answering is made with a sitecustomize.py on PYTHONPATH: it is imported by every Python process
that starts with that environment, mp.spawn's children included, and makes one rank sleep at one step."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import (ROOT, TIMEOUT, address_in_use, assert_exit, checkpoint, clean_env, env_ranks, free_port, max_diff,
                      metrics, run)
from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]  # 2 processes: 4 steps
NAN = [*TINY, "--lr", 1e6]  # the loss is NaN/inf within the first epoch
HANG = [*TINY, "--step-timeout", 3]  # rank 1 stops answering at step 2 (after the first, as the timeout needs)
HANG_AT = "1:2"
NAMED = re.compile(r"^error: a collective timed out after 3 s in \w+ \(\w+\.py:\d+\) at step 2: rank 1 \(at step 1\) "
                   r"never arrived$", re.M)

SITECUSTOMIZE = """
import os
if os.environ.get("TEST_HANG_AT"):  # "rank:step": that rank stops answering (sleeps) at that step
    import time
    import common
    rank, step = map(int, os.environ["TEST_HANG_AT"].split(":"))
    # the seconds a SIGTERM leaves to save and stop (20 in the scripts): what a launcher's SIGTERM to the stuck rank
    # costs here
    common.Watch.SAVE_BUDGET_S = float(os.environ.get("TEST_SAVE_BUDGET", common.Watch.SAVE_BUDGET_S))
    step_done = common.Watch.step_done
    def hang(self, s):
        if self.rank == rank and s == step:
            time.sleep(3600)
        return step_done(self, s)
    common.Watch.step_done = hang
"""


@pytest.fixture
def hang_env(tmp_path):
    """The environment that makes rank 1 stop answering at step 2 (SITECUSTOMIZE), with a SIGTERM save budget of
    2 s."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {"PYTHONPATH": os.pathsep.join([str(site), ROOT]), "TEST_HANG_AT": HANG_AT, "TEST_SAVE_BUDGET": "2"}


def errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- ranks started by hand: env://
class Ranks:
    """`nproc` processes of ddp_launch_train.py, each told its rank, the world size and where rank 0 serves the
    rendezvous, as a hand-written launch script or another launcher would; each in a session of its own, its output
    in files."""

    def __init__(self, folder, args, env, nproc):
        folder.mkdir(parents=True)
        self.folder, self.procs = folder, []
        for rank, variables in enumerate(env_ranks(nproc, free_port())):
            rank_env = clean_env(**env, **variables)
            with open(folder / f"{rank}.out", "wb") as out, open(folder / f"{rank}.err", "wb") as err:
                self.procs.append(subprocess.Popen([sys.executable, "ddp_launch_train.py", *map(str, args)], cwd=ROOT,
                                                   env=rank_env, stdout=out, stderr=err, start_new_session=True))

    def stdout(self, rank):
        return (self.folder / f"{rank}.out").read_text(errors="replace")

    def stderr(self, rank):
        return (self.folder / f"{rank}.err").read_text(errors="replace")

    def output(self):
        return "\n".join(f"--- rank {r}\n{self.stdout(r)[-2000:]}{self.stderr(r)[-4000:]}"
                         for r in range(len(self.procs)))

    def wait(self, rank, timeout=TIMEOUT):
        """The rank's own exit status. Past `timeout` every rank prints its stacks (SIGUSR2), is killed, and the test
        fails."""
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGUSR2)
            time.sleep(2)
            self.kill()
            pytest.fail(f"rank {rank} did not exit in {timeout} s\n{self.output()}")

    def kill(self, sig=signal.SIGKILL):
        """`sig` to every rank still running, and to what it started (its session): never to a pid already reaped."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        if sig == signal.SIGKILL:
            for p in self.procs:
                p.wait()


@contextlib.contextmanager
def hand_launched(tmp_path, *args, env=None, nproc=2):
    """Start the ranks by hand and wait for rank 0's exit; started again on a fresh port if rank 0 says another
    process took the one it was given. Yields the Ranks (the others may still run); every rank still running at the
    end is killed."""
    for attempt in range(5):
        ranks = Ranks(tmp_path / f"ranks{attempt}", args, env or {}, nproc)
        try:
            code = ranks.wait(0)
            if not (code != 0 and address_in_use(ranks.stdout(0) + ranks.stderr(0))) or attempt == 4:
                yield ranks
                return
        finally:
            ranks.kill()


@pytest.mark.floor
@pytest.mark.slow
def test_hand_launched_ranks_exit_0_with_torchruns_weights(tmp_path):
    with hand_launched(tmp_path, *TINY, "--out-dir", tmp_path / "env") as ranks:
        assert [ranks.wait(r) for r in (0, 1)] == [0, 0], ranks.output()
    assert [(r["epoch"], r["world_size"]) for r in metrics(str(tmp_path / "env"))] == [(1, 2)]
    run("ddp_launch_train.py", *TINY, "--out-dir", tmp_path / "torchrun", launcher="torchrun", nproc=2)
    assert max_diff(checkpoint(str(tmp_path / "env"))["model"], checkpoint(str(tmp_path / "torchrun"))["model"]) == 0


@pytest.mark.floor
def test_hand_launched_ranks_exit_2_on_bad_input(tmp_path):
    (tmp_path / "out").mkdir()
    with hand_launched(tmp_path, *TINY, "--resume", tmp_path / "nope.pt", "--out-dir", tmp_path / "out") as ranks:
        assert [ranks.wait(r) for r in (0, 1)] == [2, 2], ranks.output()  # each process's own status
        said = errors(ranks.stderr(0) + ranks.stderr(1))
    assert len(said) == 1 and "no such checkpoint" in said[0], ranks.output()  # once over both ranks
    assert not os.listdir(tmp_path / "out")


@pytest.mark.floor
def test_hand_launched_ranks_exit_1_on_a_nan_loss(tmp_path):
    with hand_launched(tmp_path, *NAN, "--out-dir", tmp_path / "out") as ranks:
        assert [ranks.wait(r) for r in (0, 1)] == [1, 1], ranks.output()
        said = errors(ranks.stderr(0) + ranks.stderr(1))
    assert len(said) == 1 and "NaN/inf at step" in said[0], ranks.output()


@pytest.mark.floor
@pytest.mark.slow
def test_hand_launched_rank_that_waited_for_a_stuck_one_exits_3(tmp_path, hang_env):
    with hand_launched(tmp_path, *HANG, "--out-dir", tmp_path / "out", env=hang_env) as ranks:
        assert ranks.wait(0) == 3, ranks.output()
        assert len(NAMED.findall(ranks.stderr(0))) == 1 and not errors(ranks.stderr(1)), ranks.output()
        # no launcher here, and nothing else ends the stuck rank: it sleeps on after rank 0 and its store have gone
        # (its heartbeat thread finds the store gone within about 2 s, and stops)
        try:
            pytest.fail(f"the stuck rank exited {ranks.procs[1].wait(timeout=5)} by itself\n{ranks.output()}")
        except subprocess.TimeoutExpired:
            pass
    assert ranks.procs[1].returncode == -signal.SIGKILL  # killed at the end of hand_launched


# ---- mp.spawn: the parent passes on the status of the first child that failed
@pytest.mark.slow
def test_spawn_exits_3_when_a_child_stops_answering(tmp_path, hang_env):
    t = time.monotonic()
    p = run("ddp_spawn_train.py", *HANG, "--nprocs", 2, "--out-dir", tmp_path, env=hang_env, check=False,
            timeout=180)
    seconds = time.monotonic() - t
    assert_exit(p, 3)
    assert len(NAMED.findall(p.stderr)) == 1 and len(errors(p.stderr)) == 1, p.stderr  # the parent adds no line
    # the parent ended the stuck child (SIGTERM: it leaves within its save budget, 2 s here), then exited itself
    assert seconds < 90, seconds


# ---- srun: its own status is the highest of its tasks'; its report names each task's
def srun_task_statuses(stderr):
    """{task: status} from srun's report: "srun: error: node: tasks 0-1: Exited with exit code 2", "...: task 1:
    Terminated" (a signal: its negative number)."""
    found = {}
    for tasks, what in re.findall(r"^srun: error: \S+: tasks? ([\d,\-]+): (.+)$", stderr, re.M):
        code = re.fullmatch(r"Exited with exit code (\d+)", what)
        status = int(code.group(1)) if code else {"Terminated": -signal.SIGTERM, "Killed": -signal.SIGKILL}[what]
        for part in tasks.split(","):
            first, _, last = part.partition("-")
            found.update({task: status for task in range(int(first), int(last or first) + 1)})
    return found


def srun(cluster, tmp_path, *args, env=None):
    """`srun --ntasks=2 --kill-on-bad-exit=1 python ddp_launch_train.py args` on the test cluster, as in
    slurm_example.sbatch: its CompletedProcess. Past the time limit, the step is cancelled and the test fails."""
    cmd = ["srun", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, "ddp_launch_train.py", *map(str, args)]
    env = cluster.env(**(env or {}))
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["scancel", "--user", str(os.getuid())], env=env, timeout=30)  # this module's cluster only
        pytest.fail(f"srun did not end in {TIMEOUT} s\n{e.stdout}\n{e.stderr}")


def test_srun_exits_2_on_bad_input(slurm, tmp_path):
    p = srun(slurm, tmp_path, *TINY, "--resume", tmp_path / "nope.pt", "--out-dir", tmp_path / "out")
    assert (p.returncode, srun_task_statuses(p.stderr)) == (2, {0: 2, 1: 2}), p.stderr
    said = errors(p.stderr)
    assert len(said) == 1 and "no such checkpoint" in said[0], p.stderr


def test_srun_exits_1_on_a_nan_loss(slurm, tmp_path):
    p = srun(slurm, tmp_path, *NAN, "--out-dir", tmp_path / "out")
    assert (p.returncode, srun_task_statuses(p.stderr)) == (1, {0: 1, 1: 1}), p.stderr
    said = errors(p.stderr)
    assert len(said) == 1 and "NaN/inf at step" in said[0], p.stderr


@pytest.mark.slow
def test_srun_reports_3_for_the_rank_that_waited_for_a_stuck_one(slurm, tmp_path, hang_env):
    """Task 0 exits 3. --kill-on-bad-exit then ends the step: SIGTERM to the stuck task, which leaves within its
    save budget with 143. srun's own status is the highest of the two, 143; its report names task 0's 3."""
    p = srun(slurm, tmp_path, *HANG, "--out-dir", tmp_path / "out", env=hang_env)
    assert (p.returncode, srun_task_statuses(p.stderr)) == (143, {0: 3, 1: 143}), p.stderr
    assert len(NAMED.findall(p.stderr)) == 1, p.stderr
