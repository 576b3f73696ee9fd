"""The documented exit statuses (docs/failures.md, "Exit codes") in the launch styles that the other tests do not
cover: ranks of ddp_launch_train.py started by hand (env://: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
by whoever starts them), where each process's own status is the contract; a hang (3) under torchrun, mp.spawn (whose
parent passes on its first failed child's status) and srun, which returns the highest status of its tasks (its man
page, RETURN VALUE) and names each task's in its own report. Plain python and torchrun are covered in
test_failures.py (1, 2), test_usage.py and test_scripts.py (2); the signals (0 after SIGUSR1, 143) in
test_signals.py.

A rank that stops answering is made by tests/hooks.py (TEST_HANG_AT): one rank sleeps after one optimizer step, in
every Python process that starts with that environment. The ranks that wait for it name it ("rank N never
arrived", train_extras/hangs.py), rank 0 stuck as well as another: the store they meet on answers whoever is stuck
(torchrun's agent holds it, or a thread of rank 0's process). Only a launcher ends the stuck rank: it takes a
SIGTERM only as a note to stop at its next check, which it never reaches, so the launcher's SIGKILL ends it at the
end of its grace period (torchrun's 30 s, SLURM's KillWait)."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import assert_exit, worker_exit_codes
from hooks import Hooks
from processes import (LAUNCHER_PICKS_PORT, ROOT, TIMEOUT, Proc, alive, children, command, descendants, free_port,
                       run, start_ranks, torchrun, worker_env)
from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)

TINY = ["--model", "smooth", "--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]  # 4 steps
NAN = [*TINY, "--lr", 1e6]  # the loss is NaN/inf within the first epoch
HANG = [*TINY, "--step-timeout", 3]  # the stuck rank stops answering after step 2 (after the first check)


def named(stuck):
    """The one line that names the stuck rank."""
    return re.compile(rf"^error: a collective timed out: rank {stuck} never arrived$", re.M)


def hang_env(tmp_path, stuck):
    """The environment that makes rank `stuck` stop answering after step 2, and its hooks."""
    hooks = Hooks(tmp_path, hang_at=f"{stuck}:2")
    return hooks.env, hooks


def errors(text):
    return [line for line in text.splitlines() if line.startswith("error:")]


# ---- ranks started by hand: env:// (each forked from tests/forker.py: not a launcher, as no launcher is)
def hand_launched(tmp_path, *args, env=None, wait_for=(0, 1), root=ROOT):
    """Two ranks of ddp_launch_train.py (of `root`) started by hand, once the ranks `wait_for` have ended (every
    rank still running is killed at the test's end: the caller's `finally`)."""
    ranks = start_ranks("ddp_launch_train.py", args, 2, env=env, cwd=root, folder=tmp_path / "ranks")
    for rank in wait_for:
        ranks.wait(rank)
    return ranks


@pytest.mark.floor
def test_hand_launched_ranks_exit_2_on_bad_input(tmp_path):
    (tmp_path / "out").mkdir()
    ranks = hand_launched(tmp_path, *TINY, "--resume", tmp_path / "nope.pt", "--out-dir", tmp_path / "out")
    assert [ranks.wait(r) for r in (0, 1)] == [2, 2], ranks.output()  # each process's own status
    said = errors(ranks.stderr(0) + ranks.stderr(1))
    assert len(said) == 1 and "nope.pt is not a readable checkpoint" in said[0], ranks.output()  # once over both
    assert not os.listdir(tmp_path / "out")


@pytest.mark.floor
def test_hand_launched_ranks_exit_1_on_a_nan_loss(tmp_path):
    ranks = hand_launched(tmp_path, *NAN, "--out-dir", tmp_path / "out")
    assert [ranks.wait(r) for r in (0, 1)] == [1, 1], ranks.output()
    said = errors(ranks.stderr(0) + ranks.stderr(1))
    assert len(said) == 1 and "NaN/inf at step" in said[0], ranks.output()


@pytest.mark.full
@pytest.mark.parametrize("stuck", [pytest.param(0, marks=pytest.mark.floor), 1], ids=["rank-0-stuck", "rank-1-stuck"])
def test_hand_launched_rank_that_waited_for_a_stuck_one_exits_3_naming_it(tmp_path, stuck):
    env, hooks = hang_env(tmp_path, stuck)
    waited = 1 - stuck
    ranks = hand_launched(tmp_path, *HANG, "--out-dir", tmp_path / "out", env=env, wait_for=[waited])
    try:
        assert ranks.wait(waited) == 3, ranks.output()
        assert len(named(stuck).findall(ranks.stderr(waited))) == 1, ranks.output()
        assert errors(ranks.stderr(stuck)) == [] and list(hooks.ranks("hung")) == [stuck], ranks.output()
        # no launcher here, and nothing else ends the stuck rank: it sleeps on
        time.sleep(5)
        assert ranks.procs[stuck].poll() is None, f"the stuck rank exited by itself\n{ranks.output()}"
    finally:
        ranks.kill()
    assert ranks.procs[stuck].returncode == -signal.SIGKILL  # killed by the test


@pytest.mark.full
def test_hand_launched_rank_0_frozen_with_the_store_it_holds_ends_rank_1_within_the_step_timeout_and_seconds(tmp_path):
    """Rank 0 stuck after step 2, then frozen (SIGSTOP: its process, which holds the store of an env:// launch by
    hand, srun's or mpirun's, answers nothing): rank 1's collective times out after --step-timeout, and its store
    calls wait a few seconds at most, not the store's start-up timeout of 10 minutes: rank 1 says so in one line and
    exits 3."""
    env, hooks = hang_env(tmp_path, 0)
    ranks = hand_launched(tmp_path, *HANG, "--out-dir", tmp_path / "out", env=env, wait_for=[])
    try:
        ranks.procs[0].until(lambda: hooks.ranks("hung"), "rank 0 stuck")
        os.kill(int(hooks.ranks("hung")[0]), signal.SIGSTOP)
        frozen = time.monotonic()
        assert ranks.wait(1, timeout=60) == 3, ranks.output()
        seconds = time.monotonic() - frozen
    finally:
        ranks.kill()
    said = errors(ranks.stderr(1))
    assert said == ["error: a collective timed out, and the store does not answer: rank 0, whose process holds it, "
                    "is gone or frozen"], ranks.output()
    assert seconds < 3 + 5 + 10, seconds  # --step-timeout, the store's few seconds, and the exit


@pytest.mark.full
def test_without_train_extras_hangs_the_rank_that_waited_exits_3_with_torchs_timeout_in_one_line(tmp_path):
    """The script and common.py copied without train_extras/hangs.py: the waiting rank does not name the stuck one,
    but ends all the same, with torch's own timeout error as its one line, and exit 3."""
    root = tmp_path / "copy"
    shutil.copytree(ROOT, root, ignore=lambda folder, names: [n for n in names if n in (
        "hangs.py", "tests", "docs", "benchmarks", ".git", ".venv", ".venv-floor", "runs", "data")])
    assert not (root / "train_extras" / "hangs.py").exists() and (root / "train_extras" / "datasets.py").exists()
    env, hooks = hang_env(tmp_path, 1)
    ranks = hand_launched(tmp_path, *HANG, "--out-dir", tmp_path / "out", env=env, wait_for=[0], root=root)
    try:
        assert ranks.wait(0) == 3, ranks.output()
        said = errors(ranks.stderr(0))
        assert len(said) == 1 and "(--step-timeout): a rank or a worker stopped answering" in said[0], ranks.output()
        assert "never arrived" not in said[0] and "Traceback" not in ranks.stderr(0), ranks.output()
    finally:
        ranks.kill()


# ---- torchrun: the waiting rank exits 3; torchrun ends the stuck one, by SIGKILL at the end of its grace period
@pytest.mark.full
def test_torchrun_names_a_stuck_rank_0_and_every_process_ends(tmp_path):
    """Rank 0 stuck: rank 1 names it through torchrun's store (its agent's), and exits 3; torchrun then sends the
    stuck rank SIGTERM, which it only notes, and SIGKILL 30 s later (its grace period after a failed worker, which
    no setting of torch's shortens). No process is left."""
    env, hooks = hang_env(tmp_path, 0)
    proc = Proc(torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                [*HANG, "--out-dir", tmp_path / "out"], tmp_path / "log", env=env, merge=True)
    try:
        proc.until(lambda: hooks.ranks("hung"), "rank 0 stuck")
        stuck = int(hooks.ranks("hung")[0])
        proc.wait(expect=1)
        log = proc.output()
    finally:
        proc.kill()
    assert len(named(0).findall(log)) == 1 and len(errors(log)) == 1, log[-4000:]
    assert worker_exit_codes(log) == {0: -signal.SIGKILL, 1: 3}, log[-4000:]  # in torchrun's report
    assert hooks.exits() == {1: 3} and not alive(stuck)


# a rank frozen (SIGSTOP: not even a signal's note reaches it) while the ranks evaluate, their evaluation's DataLoader
# workers reading an ImageFolder: the other rank's collective times out, and torchrun's SIGKILL ends the frozen rank's
# whole process group, its workers too, at the end of its grace period
# --step-timeout bounds each batch's wait for the DataLoader workers too, the first included, which waits for their
# start: from a fork server (Python 3.14's default), over 5 s on a 2-core machine whose speed probe is 0.5 s
STEP_TIMEOUT = 10
FROZEN = ["--dataset", "imagefolder", "--image-size", 16, "--workers", 2, "--batch-size", 8, "--epochs", 2,
          "--step-timeout", STEP_TIMEOUT]
EVAL_S = 1  # seconds per evaluation batch: 2 batches of the 21 images on each rank
GRACE, NAMING = 30, 5  # torchrun's grace period after a failed worker; hangs.py's wait for every stuck rank's mark


@pytest.mark.workers
@pytest.mark.full
def test_a_rank_frozen_while_the_ranks_evaluate_with_workers_ends_the_run_within_its_timeouts(images, short_tmp,
                                                                                            tmp_path, measured):
    """Rank 1 frozen at its first evaluation batch: rank 0 names it and exits 3 once its evaluation's collective has
    waited --step-timeout; torchrun kills rank 1 and its workers at the end of its grace period. The run ends within
    the sum of those times and rank 0's rest of the evaluation, with a margin for a loaded machine; no process of it
    is left. (What the SIGKILL leaves in TMPDIR, docs/failures.md says.)"""
    hooks = Hooks(tmp_path, eval_s=EVAL_S)
    proc = Proc(torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                [*FROZEN, "--data-dir", images, "--out-dir", tmp_path / "out"], tmp_path / "log",
                env={**hooks.env, "TMPDIR": str(short_tmp)}, merge=True)
    try:
        proc.until(lambda: hooks.evaluating() == [0, 1], "both ranks evaluating")
        rank1 = [pid for pid in descendants(proc.pid) if worker_env(pid).get("RANK") == "1"][0]
        group = [rank1, *descendants(rank1)]
        assert len(group) >= 3, group  # rank 1 and its evaluation's 2 workers
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.monotonic()
        proc.wait(expect=1)
        seconds = time.monotonic() - frozen
        log = proc.output()
    finally:
        proc.kill()
    bound = 2 * EVAL_S + STEP_TIMEOUT + NAMING + GRACE
    measured("a frozen rank with workers: seconds from the freeze to torchrun's exit", seconds, bound + 15)
    assert seconds < bound + 15, log[-4000:]
    assert len(named(1).findall(log)) == 1 and len(errors(log)) == 1, log[-4000:]
    assert worker_exit_codes(log) == {0: 3, 1: -signal.SIGKILL}, log[-4000:]
    # multiprocessing's resource tracker, in a session of its own (failsafe.start_resource_tracker), outlives the
    # SIGKILL and unlinks the semaphores of rank 1's DataLoader from /dev/shm (the session's end checks): its warning
    # says so
    deadline = time.monotonic() + 10
    while [pid for pid in group if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in group if alive(pid)] == [], group


# ---- mp.spawn: the parent passes on the status of the first child that failed
@pytest.mark.full
def test_spawn_exits_3_when_a_child_stops_answering(tmp_path):
    env, hooks = hang_env(tmp_path, 1)
    t = time.monotonic()
    p = run("ddp_spawn_train.py", *HANG, "--nprocs", 2, "--out-dir", tmp_path / "out", env=env, check=False,
            timeout=180)
    seconds = time.monotonic() - t
    assert_exit(p, 3)
    assert len(named(1).findall(p.stderr)) == 1 and len(errors(p.stderr)) == 1, p.stderr  # the parent adds no line
    # the parent ended the stuck child (10 s for its own way out, SIGTERM, which it only notes, then SIGKILL 10 s
    # later), then exited itself: about 70 s in all on this 2-core machine
    assert not alive(int(hooks.ranks("hung")[1])) and seconds < 120, seconds


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
        return command(cmd, env=env, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        command(["scancel", "--user", str(os.getuid())], env=env, timeout=30)  # this module's cluster only
        pytest.fail(f"srun did not end in {TIMEOUT} s\n{e.stdout}\n{e.stderr}")


@pytest.mark.full
def test_srun_exits_2_on_bad_input(slurm, tmp_path):
    p = srun(slurm, tmp_path, *TINY, "--resume", tmp_path / "nope.pt", "--out-dir", tmp_path / "out")
    assert (p.returncode, srun_task_statuses(p.stderr)) == (2, {0: 2, 1: 2}), p.stderr
    said = errors(p.stderr)
    assert len(said) == 1 and "nope.pt is not a readable checkpoint" in said[0], p.stderr


@pytest.mark.full
def test_srun_exits_1_on_a_nan_loss(slurm, tmp_path):
    p = srun(slurm, tmp_path, *NAN, "--out-dir", tmp_path / "out")
    assert (p.returncode, srun_task_statuses(p.stderr)) == (1, {0: 1, 1: 1}), p.stderr
    said = errors(p.stderr)
    assert len(said) == 1 and "NaN/inf at step" in said[0], p.stderr


@pytest.mark.full
def test_srun_reports_3_for_the_rank_that_waited_for_a_stuck_one(slurm, tmp_path):
    """Task 0 exits 3. --kill-on-bad-exit then ends the step: SIGTERM to the stuck task, which it only notes, then
    SIGKILL at the end of KillWait (30 s). srun's own status is the highest of the two, 137 (128 + SIGKILL); its
    report names task 0's 3."""
    env, hooks = hang_env(tmp_path, 1)
    p = srun(slurm, tmp_path, *HANG, "--out-dir", tmp_path / "out", env=env)
    assert (p.returncode, srun_task_statuses(p.stderr)) == (137, {0: 3, 1: -signal.SIGKILL}), p.stderr
    assert len(named(1).findall(p.stderr)) == 1, p.stderr


# ---- a finished run: status 0, reached without the interpreter's teardown
@pytest.mark.full
@pytest.mark.parametrize("script, launcher, nproc", [("ddp_spawn_train.py", "python", 2),
                                                     ("fsdp_train.py", "torchrun", 2), ("dp_train.py", "python", None)])
def test_a_finished_rank_leaves_without_the_interpreters_teardown(script, launcher, nproc, tmp_path):
    """Every rank that finished ends by os._exit(0) (failsafe.run_and_exit), as every failing one does: the
    interpreter's teardown, where gloo's threads now and then abort a process that has finished (SIGABRT, 'terminate
    called without an active exception', exit 1), never runs. Real interpreters (a forked run would end as its fork
    server makes it)."""
    hooks = Hooks(tmp_path)
    p = run(script, *TINY, "--out-dir", tmp_path / "out", launcher=launcher, nproc=nproc, env=hooks.env, check=False,
            fork=False)
    assert_exit(p, 0)
    assert hooks.exits() == {rank: 0 for rank in range(nproc or 1)}, p.stdout[-3000:]
    assert not hooks.ranks("teardown"), p.stdout[-3000:]  # (mp.spawn's children end by sys.exit: a status 0 alone
    # does not show it)


# ---- a peer killed outright: the others end within --step-timeout, naming it, without a traceback
LOST = [*TINY, "--epochs", 2, "--step-timeout", 5]


def gone_line(text):
    return [line for line in errors(text) if "a peer's connection closed" in line]


@pytest.mark.parametrize("victim, nproc", [(0, 2), pytest.param(1, 2, marks=pytest.mark.full),
                                           pytest.param(2, 3, marks=pytest.mark.full)])
def test_hand_launched_ranks_name_a_rank_killed_outright(victim, nproc, tmp_path):
    """Every rank waits after step 2 (tests/hooks.py); then rank `victim` is SIGKILLed and the others go on: each
    ends within --step-timeout and the naming's seconds, exit 3, and one line over all of them names the lost rank
    ("and the store does not answer" where it was rank 0, whose process held the store); no traceback."""
    hooks = Hooks(tmp_path, pause_at=2)
    ranks = start_ranks("ddp_launch_train.py", [*LOST, "--out-dir", tmp_path / "out"], nproc, env=hooks.env,
                        folder=tmp_path / "ranks")
    others = [r for r in range(nproc) if r != victim]
    try:
        for proc in ranks.procs:
            proc.until(lambda: len(hooks.paused()) == nproc, "every rank waiting at step 2")
        os.kill(hooks.paused()[victim], signal.SIGKILL)
        killed = time.monotonic()
        hooks.go()
        codes = [ranks.wait(r, timeout=60) for r in others]
        seconds = time.monotonic() - killed
    finally:
        ranks.kill()
    output = "".join(ranks.stderr(r) for r in others)
    store = ", and the store does not answer" if victim == 0 else ""
    assert codes == [3] * len(others) and gone_line(output) == [
        f"error: a peer's connection closed{store}: rank {victim} is gone"], ranks.output()
    assert "Traceback" not in output, ranks.output()
    assert seconds < 5 + 2 * NAMING + 10, seconds  # --step-timeout, the marks, rank 0's wait for them, the exit


@pytest.mark.full
def test_a_node_killed_outright_under_two_node_torchrun_is_named_by_the_other(tmp_path):
    """Two torchrun agents on this machine as two nodes (c10d rendezvous, 2 workers each); one node's agent and
    workers SIGKILLed at step 2: the other node's ranks end with one line naming the lost ranks and their node, no
    traceback of theirs, whichever node held the rendezvous's store."""
    hooks = Hooks(tmp_path, pause_at=2)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [Proc(torchrun("--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                           "ddp_launch_train.py", *LOST, "--out-dir", tmp_path / f"out{n}"), tmp_path / f"log{n}",
                  env=hooks.env, merge=True) for n in (0, 1)]
    try:
        for node in nodes:
            node.until(lambda: len(hooks.paused()) == 4, "every rank waiting at step 2")
        workers = {n: [int(worker_env(pid)["RANK"]) for pid in children(node.pid)] for n, node in enumerate(nodes)}
        lost, kept = (0, 1) if 0 in workers[1] else (1, 0)  # the node without rank 0
        nodes[lost].kill()
        hooks.go()
        nodes[kept].wait(expect=None, timeout=90)
        log = nodes[kept].output()
    finally:
        for node in nodes:
            node.kill()
    gone = sorted(workers[lost])
    said = gone_line(log)
    assert len(said) == 1 and re.search(rf"ranks {gone[0]} \(node \d\), {gone[1]} \(node \d\) are gone$", said[0]), \
        log[-4000:]
    assert 'ddp_launch_train.py", line' not in log, log[-4000:]  # (torchrun's own report is its traceback)


# ---- a whole job paused (Ctrl-Z, scontrol suspend: SIGSTOP, then SIGCONT) longer than --step-timeout
@pytest.mark.full
def test_a_job_paused_longer_than_the_step_timeout_blames_no_rank(tmp_path):
    """mp.spawn's 2 children, rank 0 held after its step 2 (tests/hooks.py) so that rank 1 waits in a collective;
    every process of the job then stopped (SIGSTOP) for longer than --step-timeout, continued (SIGCONT), and rank 0
    let go: the collective that waited across the pause times out, and the run ends with the one line that says
    so, exit 3, naming no rank as frozen or gone."""
    hooks = Hooks(tmp_path, pause_at="0:2")
    proc = Proc([sys.executable, "ddp_spawn_train.py", "--nprocs", "2", *map(str, LOST), "--out-dir",
                 str(tmp_path / "out")], tmp_path / "log", env=hooks.env, merge=True)
    try:
        proc.until(lambda: 0 in hooks.paused() and hooks.steps().get(1, 0) >= 2, "rank 0 held, rank 1 past step 2")
        time.sleep(1)  # rank 1 in step 3's collective
        job = proc.tree()
        for pid in job:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(5 + 3)  # longer than --step-timeout
        for pid in job:
            os.kill(pid, signal.SIGCONT)
        hooks.go()
        proc.wait(expect=3, timeout=60)
    finally:
        proc.kill()
    said = errors(proc.output())
    assert said and all("after this process was paused" in line for line in said), proc.output()[-4000:]
    assert not re.search("never arrived|is gone|are gone|frozen", proc.output()), proc.output()[-4000:]


# ---- launch mistakes: one line each, within a bounded wait for the process group to form (--step-timeout)
@pytest.mark.parametrize("mistake", ["WORLD_SIZE differs", pytest.param("MASTER_PORT taken", marks=pytest.mark.full)])
def test_hand_launched_ranks_that_cannot_join_end_with_one_line_each_within_the_step_timeout(mistake, tmp_path):
    """Ranks started by hand with WORLD_SIZE 2 and 3, or on a MASTER_PORT that another program listens on (it
    accepts, never answers): each rank ends within --step-timeout and 10 s with one line and exit 2; no
    traceback."""
    port = free_port()
    listener = None
    if mistake == "MASTER_PORT taken":
        listener = socket.socket()
        listener.bind(("127.0.0.1", port))
        listener.listen()
    sizes = [2, 3] if mistake == "WORLD_SIZE differs" else [2, 2]
    procs = []
    t = time.monotonic()
    try:
        for rank, size in enumerate(sizes):
            env = dict(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(Proc([sys.executable, "ddp_launch_train.py", *map(str, TINY), "--step-timeout", "5",
                               "--out-dir", str(tmp_path / f"out{rank}")], tmp_path / "log", env=env,
                              name=f"rank{rank}"))
        codes = [p.wait(expect=None, timeout=60) for p in procs]
        seconds = time.monotonic() - t
    finally:
        for p in procs:
            p.kill()
        if listener:
            listener.close()
    for p in procs:
        assert len(errors(p.stderr)) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert codes == [2, 2] and seconds < 5 + 10 + 10, (codes, seconds)  # the timer, the exit, the start-up
    if mistake == "MASTER_PORT taken":
        assert "the port is taken by another program" in errors(procs[0].stderr)[0]
    assert "did not join within --step-timeout" in errors(procs[-1].stderr)[0]
