"""Signals prove the save: SIGTERM and SIGUSR1 (and SIGHUP, taken as SIGTERM) in every launch style (one plain process,
torchrun's workers, torchrun itself, mp.spawn's parent, ranks started by hand with env://; srun and sbatch in
test_cluster.py) stop the run with a checkpoint written *after* the signal, at one step every rank agreed on, and the
documented status (docs/failures.md: 0 after SIGUSR1, 143 after SIGTERM, 129 after SIGHUP; torchrun itself exits 1 and
names each worker's 143). The ranks learn of a signal at their next check (failsafe.Agreement.check: one all-reduce
about every 2 s, every --log-every steps if sooner, and at every save step), so that the stop comes a few steps after
the signal, at the latest at the next --save-every step, and for steps of seconds well inside a launcher's grace period.
A save that a signal or a kill interrupts, in the one-file format and in the sharded one written in the background
(fsdp_train.py --ckpt-format dcp --async-save), leaves a whole checkpoint to resume; one that outlives the launcher's
grace period is killed, and the previous checkpoint stays whole.

Each moment is made exact by the hooks of tests/hooks.py, which touch only torch's and Python's own functions: every
rank waits after optimizer step PAUSE until the test has sent its signal and the signalled processes have taken it; a
save waits half-written, or with its part written and its folder still ckpt-<step>.tmp, until the test has signalled or
killed; steps are made slow. What a test checks is what a user sees: exit statuses, the one `stopped by` line, the
files, and the optimizer steps each rank took (the hooks count them)."""
import contextlib
import json
import os
import re
import signal
import sys
import time

import pytest
import torch

from conftest import PROOF, assert_exit, checkpoint, max_diff, metrics, per_process
from hooks import Hooks
from processes import (LAUNCHER_PICKS_PORT, ROOT, Proc, Ranks, address_in_use, alive, children, command,
                       descendants, run, signal_pending, start_ranks, torchrun, worker_env)

# the proof runs' flags (conftest.PROOF: 16 steps an epoch at any number of processes), a checkpoint every 4 steps: an
# uninterrupted run is the shared proof run of its process count (conftest.SHARED)
STEPS_PER_EPOCH = 16


def flags(nproc):
    return [*PROOF, *per_process(nproc), "--save-every", 4]
PAUSE = 6  # the ranks wait after this optimizer step: the last checkpoint before the signal is step 4's
NEXT_SAVE = 8  # a signal at PAUSE is acted on at the latest here, where every rank checks before saving
CODE = {signal.SIGTERM: 143, signal.SIGUSR1: 0, signal.SIGHUP: 129}  # docs/failures.md, "Exit codes"
# from the ranks going on after the signal to the exit: below torchrun's 30 s between its SIGTERM and its SIGKILL;
# at most 7.4 s measured on this 2-core machine under a load average of 7
SECONDS = 30


def stopped(log, sig):
    """The steps of the `stopped by <SIG> at step N` lines (rank 0's, once): a line of its own, not an `error:`."""
    return [int(s) for s in re.findall(rf"^stopped by {sig.name} at step (\d+), where last.pt was saved", log, re.M)]


def position(ckpt, steps_per_epoch):
    return ckpt["epoch"] * steps_per_epoch + ckpt["step_in_epoch"]


def agreed_stop(log, sig, hooks, out, steps_per_epoch, after, by, group=True):
    """The step the run stopped at, having checked that it is one step (after `after`, by `by`): where rank 0 said
    it stopped, once, where every rank's optimizer stopped, and where last.pt was saved; and that every rank left
    with its process group whole (kept_groups; group=False: a script without one)."""
    steps = stopped(log, sig)
    assert len(steps) == 1 and after < steps[0] <= by, f"stopped at {steps}, not once in ({after}, {by}]\n{log[-3000:]}"
    assert set(hooks.steps().values()) == {steps[0]}, hooks.steps()  # every rank stopped there...
    assert position(load(out / "last.pt"), steps_per_epoch) == steps[0]  # ...and saved there, after the signal
    if group:
        kept_groups(hooks, hooks.steps())
    return steps[0]


def kept_groups(hooks, ranks):
    """Checks that each of `ranks` left with its process group whole: every thread that init_process_group started
    still ran as it asked for its exit. Freed by the gc after a stop, the group's destructor now and then waited
    forever for a gloo thread that waited for the GIL (failsafe.KEPT), until torchrun's SIGKILL 30 s later."""
    threads = hooks.group_threads()  # {rank: (threads running at its exit, threads started)}
    assert sorted(threads) == sorted(ranks), f"the ranks that counted their process group's threads: {threads}"
    for rank, (running, started) in threads.items():
        assert running == started > 0, f"rank {rank}: {running} of its process group's {started} threads at its exit"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def temporary(out):
    return sorted(p.name for p in out.iterdir() if ".tmp" in p.name)


def complete_sharded(out):
    """The complete ckpt-<step> folders (renamed from ckpt-<step>.tmp once DCP wrote every rank's part and the
    .metadata), by step."""
    return sorted((int(p.name[5:]) for p in out.glob("ckpt-*") if re.fullmatch(r"ckpt-\d+", p.name)
                   and (p / ".metadata").is_file()))


def sharded_position(folder, tmp_path):
    """The position a sharded checkpoint holds, from its conversion to one file (train_extras/sharded.py)."""
    from train_extras.sharded import to_file
    to_file(str(folder), str(tmp_path / f"{folder.name}.pt"))
    return position(load(tmp_path / f"{folder.name}.pt"), 16)


def workers(proc):
    """{rank: pid} of torchrun's workers."""
    found = {int(worker_env(pid)["RANK"]): pid for pid in children(proc.pid) if "RANK" in worker_env(pid)}
    assert len(found) == 2, f"workers of torchrun (pid {proc.pid}): {found}"
    return found


def start(tmp_path, cmd, hooks, **env):
    return Proc(cmd, tmp_path / "log", env={**hooks.env, **env}, merge=True)


def paused(proc, hooks, ranks):
    """Once every one of `ranks` waits at PAUSE: {rank: pid}. Nothing writes a checkpoint meanwhile."""
    proc.until(lambda: sorted(hooks.paused()) == sorted(ranks), f"ranks {ranks} waiting at step {PAUSE}")
    return hooks.paused()


def signal_at_the_pause(proc, hooks, ranks, sig, to=None, release=()):
    """Once every one of `ranks` waits at PAUSE: `sig` to the ranks `to` (a list; default: all), or to the launcher
    of pid `to` (an int), which passes it on; then, once every rank it was meant for has taken it, every rank goes on
    (release: only what waits there, of hooks.go; default: all that waits). Returns the monotonic time they went
    on."""
    pids = paused(proc, hooks, ranks)
    meant = [pids[r] for r in (ranks if to is None or isinstance(to, int) else to)]
    for pid in [to] if isinstance(to, int) else meant:
        os.kill(pid, sig)
    proc.until(lambda: all(hooks.handled(pid, sig) for pid in meant), f"{sig.name} taken by {meant}")
    hooks.go(*release)
    return time.monotonic()


def finish(proc, went_on, measured, what):
    proc.wait(expect=None)
    seconds = measured(f"{what}: seconds from going on after the signal to the exit", time.monotonic() - went_on,
                       SECONDS)
    assert seconds < SECONDS, f"{seconds:.1f} s from going on after the signal to the exit\n{proc.output()[-3000:]}"
    return proc.result()


@pytest.fixture
def reference(shared):
    """The final weights of the uninterrupted run of 2 processes (the shared proof run)."""
    return checkpoint(shared("launch2"))["model"]


# ---- one process: plain python
@pytest.mark.parametrize("script, sig", [
    pytest.param("ddp_launch_train.py", signal.SIGTERM, marks=pytest.mark.floor),
    pytest.param("dp_train.py", signal.SIGUSR1, marks=[pytest.mark.floor, pytest.mark.full]),
    pytest.param("ddp_launch_train.py", signal.SIGUSR1, marks=pytest.mark.full),
    pytest.param("dp_train.py", signal.SIGTERM, marks=pytest.mark.full),
    pytest.param("ddp_launch_train.py", signal.SIGHUP, marks=pytest.mark.full)],  # SIGHUP: a terminal closed
    ids=lambda v: getattr(v, "name", v))
def test_a_signal_to_one_process_saves_at_its_next_check_and_exits_with_its_status(script, sig, tmp_path, measured):
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    proc = start(tmp_path, [sys.executable, script, *flags(1), "--out-dir", out], hooks)
    try:
        paused(proc, hooks, [0])
        before = position(load(out / "last.pt"), STEPS_PER_EPOCH)
        went_on = signal_at_the_pause(proc, hooks, [0], sig)
        p = finish(proc, went_on, measured, f"{script} {sig.name}")
    finally:
        proc.kill()
    assert before == 4
    assert_exit(p, CODE[sig])
    agreed_stop(p.stdout, sig, hooks, out, STEPS_PER_EPOCH, PAUSE - 1, NEXT_SAVE, group=script != "dp_train.py")
    assert "Traceback" not in p.stdout, p.stdout[-3000:]
    assert temporary(out) == []


# ---- torchrun: the signal to its workers, as torchrun and SLURM send it
@pytest.mark.full
@pytest.mark.floor
def test_sigterm_to_the_torchrun_workers_saves_at_the_step_they_agreed_on_and_the_resume_ends_exactly(
        reference, tmp_path, measured):
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                 [*flags(2), "--out-dir", out], hooks)
    try:
        pids = paused(proc, hooks, [0, 1])
        before = position(load(out / "last.pt"), STEPS_PER_EPOCH)
        went_on = signal_at_the_pause(proc, hooks, [0, 1], signal.SIGTERM)
        p = finish(proc, went_on, measured, "torchrun SIGTERM")
    finally:
        proc.kill()
    assert before == 4
    assert_exit(p, 143, nproc=2)  # torchrun exits 1; its report: each worker's 143
    step = agreed_stop(p.stdout, signal.SIGTERM, hooks, out, STEPS_PER_EPOCH, PAUSE - 1, NEXT_SAVE)
    assert temporary(out) == []
    assert not [pid for pid in pids.values() if alive(pid)], "worker processes left running"
    log = run("ddp_launch_train.py", *flags(2), "--resume", "auto", "--out-dir", out,
              launcher="torchrun", nproc=2).stdout
    assert f"resuming at step {step}" in log
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert max_diff(load(out / "last.pt")["model"], reference) == 0


@pytest.mark.full
def test_sigusr1_to_one_fsdp_worker_stops_every_rank_at_one_step_in_one_sharded_checkpoint(shared, tmp_path,
                                                                                           measured):
    """A signal to one rank only (a scheduler that signals one process): every rank learns it at the same step, and
    each writes its part of the same ckpt-<step> folder."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    args = [*flags(2), "--ckpt-format", "dcp", "--out-dir", out]
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "fsdp_train.py") + args, hooks)
    try:
        paused(proc, hooks, [0, 1])
        before = complete_sharded(out)
        went_on = signal_at_the_pause(proc, hooks, [0, 1], signal.SIGUSR1, to=[1])
        p = finish(proc, went_on, measured, "fsdp_train.py SIGUSR1 to rank 1")
    finally:
        proc.kill()
    assert before == [4]
    assert_exit(p, 0)  # exit 0: torchrun restarts nothing, the job may requeue
    (step,) = stopped(p.stdout, signal.SIGUSR1) or [None]
    assert step is not None and PAUSE <= step <= NEXT_SAVE, p.stdout[-3000:]
    assert complete_sharded(out) == [4, step]
    ckpt = out / f"ckpt-{step}"
    assert sorted(os.listdir(ckpt)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json"]  # both parts
    assert sharded_position(ckpt, tmp_path) == step
    assert hooks.steps() == {0: step, 1: step}
    kept_groups(hooks, [0, 1])
    assert temporary(out) == []
    log = run("fsdp_train.py", *args, "--resume", "auto", launcher="torchrun", nproc=2).stdout
    assert f"resuming at step {step}" in log
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    ended = sorted(complete_sharded(out))[-1]
    assert ended == 48 and sharded_position(out / f"ckpt-{ended}", tmp_path) == 48
    converted = load(tmp_path / f"ckpt-{ended}.pt")
    assert max_diff(converted["model"], checkpoint(shared("fsdp2"))["model"]) == 0  # as if never stopped


# ---- mp.spawn: the signal to the parent (the process a scheduler started), which passes it on to its children
@pytest.mark.full
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_to_the_spawn_parent_reaches_every_child_which_save_at_one_step(sig, reference, tmp_path, measured):
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    args = ["--nprocs", "2", *flags(2), "--out-dir", out]
    proc = start(tmp_path, [sys.executable, "ddp_spawn_train.py", *args], hooks)
    try:
        pids = paused(proc, hooks, [0, 1])
        before = position(load(out / "last.pt"), STEPS_PER_EPOCH)
        went_on = signal_at_the_pause(proc, hooks, [0, 1], sig, to=proc.pid)
        p = finish(proc, went_on, measured, f"spawn {sig.name}")
    finally:
        proc.kill()
    assert before == 4
    assert_exit(p, CODE[sig])  # the parent's status
    step = agreed_stop(p.stdout, sig, hooks, out, STEPS_PER_EPOCH, PAUSE - 1, NEXT_SAVE)
    assert "Traceback" not in p.stdout, p.stdout[-3000:]
    assert temporary(out) == []
    assert not [pid for pid in pids.values() if alive(pid)], "child processes left running"
    if sig == signal.SIGUSR1:  # a time limit's notice: the requeued run goes on from there as if never stopped
        log = run("ddp_spawn_train.py", *args, "--resume", "auto").stdout
        assert f"resuming at step {step}" in log
        assert max_diff(load(out / "last.pt")["model"], reference) == 0  # spawn trains as torchrun


# ---- ranks started by hand (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each process's status the contract
def hand_launched(tmp_path, args, hooks):
    """Two ranks of ddp_launch_train.py `args`, rank 0 serving the rendezvous on a port picked free, once both wait
    at PAUSE; started again on another port while one failed on "address in use"."""
    for attempt in range(5):
        ranks = Ranks("ddp_launch_train.py", args, 2, env=hooks.env, folder=tmp_path / f"ranks{attempt}")
        while len(hooks.paused()) < 2 and all(r.poll() is None for r in ranks.procs):
            if time.monotonic() > ranks.procs[0].deadline:
                ranks.kill(diagnose=True)
                pytest.fail(f"timed out waiting for both ranks at step {PAUSE}\n{ranks.output()}")
            time.sleep(0.01)
        if len(hooks.paused()) == 2 or attempt == 4 or not any(address_in_use(r.output()) for r in ranks.procs):
            return ranks.procs
        ranks.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.full)],
                         ids=lambda s: s.name)
def test_a_signal_to_ranks_started_by_hand_saves_at_one_step_and_each_exits_with_its_status(sig, tmp_path, measured):
    """SIGTERM to every rank (as a scheduler stopping its processes), SIGUSR1 to rank 1 alone."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    ranks = hand_launched(tmp_path, [*flags(2), "--out-dir", out], hooks)
    try:
        for r in ranks:  # proc.until below fails at once on a rank that has ended: say why first
            assert r.poll() is None, f"a rank ended before step {PAUSE}\n{r.tail()}"
        before = position(load(out / "last.pt"), STEPS_PER_EPOCH)
        went_on = signal_at_the_pause(ranks[0], hooks, [0, 1], sig, to=[0, 1] if sig == signal.SIGTERM else [1])
        results = [finish(r, went_on, measured, f"hand-launched {sig.name}, rank {i}") for i, r in enumerate(ranks)]
    finally:
        for r in ranks:
            r.kill()
    assert before == 4
    for p in results:
        assert_exit(p, CODE[sig])  # each rank's own status
    agreed_stop(results[0].stdout + results[0].stderr, sig, hooks, out, STEPS_PER_EPOCH, PAUSE - 1, NEXT_SAVE)
    assert stopped(results[1].stdout + results[1].stderr, sig) == []  # printed once, by rank 0
    assert temporary(out) == []


# ---- a save that a signal or a kill interrupts
@pytest.mark.full
def test_sigterm_while_last_pt_is_half_written_finishes_it_then_saves_at_the_step_the_ranks_agreed_on(tmp_path,
                                                                                                    measured):
    """torchrun's workers get SIGTERM while rank 0 has written half of step 8's checkpoint: it finishes the file
    (the signal only noted), then every rank learns the signal at the next check, at the latest step 12's (the next
    save), and saves and stops there."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, stall_save=2)  # the second checkpoint, step 8's
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                 [*flags(2), "--out-dir", out], hooks)
    try:
        proc.until(lambda: hooks.ranks("saving"), "step 8's checkpoint half written")
        saving = json.loads(hooks.ranks("saving")[0])
        pids = workers(proc)
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        proc.until(lambda: hooks.handled(saving["pid"], signal.SIGTERM), "SIGTERM taken by rank 0")
        # the signal taken, the save goes on: its file still there, half written
        assert os.path.exists(saving["path"]), "the save was given up on SIGTERM"
        half = os.path.getsize(saving["path"])
        assert position(load(out / "last.pt"), STEPS_PER_EPOCH) == 4
        hooks.go()
        p = finish(proc, time.monotonic(), measured, "SIGTERM mid-save")
    finally:
        proc.kill()
    assert half == saving["written"] < saving["size"] and os.path.dirname(saving["path"]) == str(out)
    assert_exit(p, 143, nproc=2)
    agreed_stop(p.stdout, signal.SIGTERM, hooks, out, STEPS_PER_EPOCH, 8, 12)  # whole, and saved after the signal
    assert temporary(out) == []


def test_a_process_killed_while_it_writes_last_pt_leaves_the_previous_one_whole(tmp_path):
    out, hooks = tmp_path / "run", Hooks(tmp_path, stall_save=2)  # one process: steps 4 and 8 save
    args = ["ddp_launch_train.py", *flags(1), "--out-dir", out]
    proc = start(tmp_path, [sys.executable, *args], hooks)
    try:
        proc.until(lambda: hooks.ranks("saving"), "step 8's checkpoint half written")
        saving = json.loads(hooks.ranks("saving")[0])
        before = (out / "last.pt").read_bytes()
        proc.kill()  # SIGKILL, mid-save
    finally:
        proc.kill()
    assert (out / "last.pt").read_bytes() == before and position(load(out / "last.pt"), STEPS_PER_EPOCH) == 4
    partial = [out / name for name in temporary(out)]
    assert partial == [type(out)(saving["path"])] and partial[0].stat().st_size == saving["written"]
    with pytest.raises(Exception):
        load(partial[0])
    log = run(*args, "--resume", "auto").stdout  # and the run goes on from the previous checkpoint
    assert "resuming at step 4" in log
    assert load(out / "last.pt")["epoch"] == 3


SHARDED = [*flags(2), "--epochs", 1, "--ckpt-format", "dcp", "--async-save"]  # 16 steps


def stalled_in_the_background(tmp_path, hooks):
    """fsdp_train.py --async-save under torchrun, until both ranks' parts of step 8's save are written and DCP waits
    (the second save: step 4's is complete)."""
    out = tmp_path / "run"
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "fsdp_train.py") +
                 [*SHARDED, "--out-dir", out], hooks)
    try:
        proc.until(lambda: len(hooks.ranks("stalled")) == 2, "both ranks' parts of step 8 written")
        assert set(hooks.ranks("stalled").values()) == {str(out / "ckpt-8.tmp")}
        assert sorted(os.listdir(out / "ckpt-8.tmp")) == ["__0_0.distcp", "__1_0.distcp"]  # no .metadata: incomplete
    except BaseException:
        proc.kill()
        raise
    return proc, out


@pytest.mark.full
def test_sigterm_during_a_background_sharded_save_waits_for_it_then_saves_at_the_step_the_ranks_agreed_on(
        tmp_path, measured):
    hooks = Hooks(tmp_path, stall_dcp=2)
    proc, out = stalled_in_the_background(tmp_path, hooks)
    try:
        pids = workers(proc)
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        proc.until(lambda: not any(signal_pending(pid, signal.SIGTERM) for pid in pids.values()), "SIGTERM delivered")
        assert (out / "ckpt-8.tmp").is_dir() and complete_sharded(out) == [4]  # the signal came mid-save
        hooks.go()
        p = finish(proc, time.monotonic(), measured, "SIGTERM during a background sharded save")
    finally:
        proc.kill()
    assert_exit(p, 143, nproc=2)
    (step,) = stopped(p.stdout, signal.SIGTERM) or [None]
    # after step 8's save; at the latest at step 12's check, whose save waits for step 8's to end
    assert step is not None and 8 < step <= 12, p.stdout[-3000:]
    assert hooks.steps() == {0: step, 1: step}
    kept_groups(hooks, [0, 1])
    assert complete_sharded(out)[-2:] == [8, step]  # the newest complete checkpoint: the stop's, saved after the signal
    assert sorted(os.listdir(out / f"ckpt-{step}")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json"]
    assert sharded_position(out / f"ckpt-{step}", tmp_path) == step
    assert temporary(out) == []  # the background save finished too
    log = run("fsdp_train.py", *SHARDED, "--out-dir", out, "--resume", "auto", launcher="torchrun", nproc=2).stdout
    assert f"resuming at step {step}" in log
    assert metrics(out)[-1]["step"] == 16


@pytest.mark.full
def test_a_kill_during_a_background_sharded_save_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL to every process while step 8's ckpt-8.tmp is being written: --resume auto skips it, resumes from the
    newest complete one (step 4's), and the run in that --out-dir deletes the .tmp."""
    hooks = Hooks(tmp_path, stall_dcp=2)
    proc, out = stalled_in_the_background(tmp_path, hooks)
    proc.kill()  # SIGKILL to torchrun and its workers, mid-save
    assert sorted(os.listdir(out / "ckpt-8.tmp")) == ["__0_0.distcp", "__1_0.distcp"]  # still there after the kill
    assert complete_sharded(out) == [4]
    # --save-every 5: no save of its own at step 8 would replace ckpt-8.tmp
    log = run("fsdp_train.py", *SHARDED, "--save-every", 5, "--out-dir", out, "--resume", "auto", launcher="torchrun",
              nproc=2).stdout
    assert "resuming at step 4" in log
    assert temporary(out) == []  # the cut-short save was cleared away
    assert metrics(out)[-1]["step"] == 16


# ---- the launcher's grace period: torchrun's SIGTERM to its workers, then its SIGKILL 30 s later (SLURM's KillWait is
# 30 s too)
GRACE = 30
# 2 processes: 32 steps
SLOW = ["--model", "smooth", "--train-size", "768", "--val-size", "20", "--batch-size", "12", "--epochs", "1"]


def torchrun_run(tmp_path, hooks, *args):
    out = tmp_path / "run"
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                 [*SLOW, *args, "--out-dir", out], hooks)
    return proc, out


@pytest.mark.full
def test_sigterm_to_torchrun_with_steps_of_seconds_saves_at_one_step_well_within_its_grace_period(tmp_path, measured):
    """Steps of 1.5 s; SIGTERM to torchrun itself (as a scheduler stops a job), which passes it on to its workers,
    once they have taken 3 steps (no --save-every, and before the first --log-every step: only the checks' cadence
    in time brings the stop): every worker saves at the step they agreed on and exits 143, long before torchrun's
    SIGKILL."""
    hooks = Hooks(tmp_path, step_s=1.5)
    proc, out = torchrun_run(tmp_path, hooks)
    try:
        proc.until(lambda: len(hooks.steps()) == 2 and min(hooks.steps().values()) >= 3, "3 steps taken")
        t = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(expect=None)
        seconds = measured("seconds from SIGTERM to torchrun to its exit, steps of 1.5 s", time.monotonic() - t, GRACE)
    finally:
        proc.kill()
    p = proc.result()
    assert hooks.exits() == {0: 143, 1: 143}, p.stdout[-3000:]  # each worker's own status
    assert p.returncode == 1 and "got signal: 15" in p.stdout, p.stdout[-3000:]  # torchrun's, when signalled
    assert seconds < GRACE / 2, f"{seconds:.1f} s from SIGTERM to the exit\n{p.stdout[-3000:]}"
    agreed_stop(p.stdout, signal.SIGTERM, hooks, out, 32, 2, 5)  # at the first check or two after the signal
    assert temporary(out) == []


@pytest.mark.full
def test_a_save_that_outlives_the_grace_period_is_killed_and_the_previous_checkpoint_stays_whole(tmp_path, measured):
    """SIGTERM to torchrun at step 6; the save at the agreed step never ends (it waits half-written for a `go` that
    never comes): torchrun kills its workers 30 s after the signal, rank 1 too, which waits to learn whether rank 0's
    write succeeded. last.pt is step 4's, whole, and a resume goes on from there."""
    hooks = Hooks(tmp_path, pause_at=PAUSE, stall_save=2)  # step 4's save, then the stop's
    proc, out = torchrun_run(tmp_path, hooks, "--save-every", 4)
    try:
        t = signal_at_the_pause(proc, hooks, [0, 1], signal.SIGTERM, to=proc.pid, release=["pause"])  # not the save
        proc.until(lambda: hooks.ranks("saving"), "the stop's checkpoint half written")
        proc.wait(expect=None)
        seconds = measured("seconds from the signal to torchrun's exit, the save stalled", time.monotonic() - t)
    finally:
        proc.kill()
    p = proc.result()
    # rank 1 waits for rank 0's write (common.on_rank0: had it failed, rank 1 would stop with its line too); torchrun
    # kills rank 0, having waited 30 s for it, and rank 1 then, or rank 1 leaves first, seeing rank 0 gone (143)
    assert hooks.exits() in ({}, {1: 143}), (hooks.exits(), p.stdout[-3000:])
    assert re.search(rf"Unable to shutdown process {hooks.ranks('paused')[0]} via 15, forcefully exiting via 9",
                     p.stdout), p.stdout[-3000:]
    assert GRACE - 1 <= seconds < GRACE + 15, seconds
    assert position(load(out / "last.pt"), 32) == 4  # the one written before the signal, whole
    assert temporary(out) == [os.path.basename(json.loads(hooks.ranks("saving")[0])["path"])]  # and its successor's
    log = run("ddp_launch_train.py", *SLOW, "--max-steps", 6, "--resume", "auto", "--out-dir", out,
              launcher="torchrun", nproc=2).stdout
    assert "resuming at step 4" in log and load(out / "last.pt")["step_in_epoch"] == 6


# ---- a stop at an epoch's end: saved before the evaluation, which may outlast a launcher's grace period
# 4 steps an epoch; an evaluation of 16 batches made 4 s long (tests/hooks.py: eval_s), as a long one would be
EVAL = ["--model", "smooth", "--train-size", "64", "--batch-size", "16", "--epochs", "2", "--val-size", "256"]
EVAL_S = 0.25  # seconds per evaluation batch
GRACE_STAND_IN = 3  # seconds: a SIGKILL this long after the signal, shorter than one evaluation (4 s)


@pytest.mark.full
def test_a_stop_agreed_at_an_epochs_last_step_saves_before_the_evaluation_and_the_resume_evaluates_first(tmp_path):
    """SIGTERM at step 4, the epoch's last: the run saves that step and ends before its evaluation, well inside a grace
    period shorter than the evaluation (a timer's SIGKILL stands in for it). The resumed run evaluates epoch 1, writes
    its row, then trains epoch 2."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=4, eval_s=EVAL_S)
    proc = start(tmp_path, [sys.executable, "ddp_launch_train.py", *EVAL, "--out-dir", out], hooks)
    try:
        signal_at_the_pause(proc, hooks, [0], signal.SIGTERM)
        t = time.monotonic()
        while proc.poll() is None and time.monotonic() - t < GRACE_STAND_IN:
            time.sleep(0.05)
    finally:
        proc.kill()  # the grace period's end
    p = proc.result()
    assert_exit(p, 143)
    assert stopped(p.stdout, signal.SIGTERM) == [4] and hooks.steps() == {0: 4}, p.stdout[-3000:]
    kept_groups(hooks, [0])
    ckpt = load(out / "last.pt")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 0)  # the epoch's end, saved
    assert not (out / "metrics.jsonl").exists() or metrics(out) == []  # not evaluated
    log = run("ddp_launch_train.py", *EVAL, "--resume", "auto", "--out-dir", out,
              env=Hooks(tmp_path / "resumed", eval_s=EVAL_S).env).stdout
    assert re.search(r"resuming at step 4\nepoch 1 .*\nepoch 2 ", log), log
    rows = metrics(out)
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 4), (2, 8)] and rows[0]["val_count"] == 256
    assert rows[0]["eval_time_s"] > GRACE_STAND_IN  # the evaluation would have outlasted the grace period


@pytest.mark.full
def test_a_stop_during_the_evaluation_ends_the_run_at_its_end_without_training_on(tmp_path):
    """SIGTERM while epoch 1 evaluates (its checkpoint saved just before): the run writes the row and exits 143,
    training no further step; the resume goes on with epoch 2 and evaluates epoch 1 no second time."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, eval_s=EVAL_S)
    proc = start(tmp_path, [sys.executable, "ddp_launch_train.py", *EVAL, "--out-dir", out], hooks)
    try:
        proc.until(lambda: (out / "last.pt").exists(), "epoch 1's checkpoint")
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(expect=None)
    finally:
        proc.kill()
    p = proc.result()
    assert_exit(p, 143)
    assert stopped(p.stdout, signal.SIGTERM) == [4] and hooks.steps() == {0: 4}, p.stdout[-3000:]
    kept_groups(hooks, [0])
    assert [r["step"] for r in metrics(out)] == [4]
    log = run("ddp_launch_train.py", *EVAL, "--resume", "auto", "--out-dir", out).stdout
    assert re.search(r"resuming at step 4\nepoch 2 ", log), log
    assert [r["step"] for r in metrics(out)] == [4, 8]


# ---- SIGTERM twice: torchrun passes on each one it gets; SLURM signals every process of a step, and torchrun too
@pytest.mark.full
@pytest.mark.parametrize("to", ["one worker twice", "torchrun and its workers"])
def test_repeated_sigterms_never_cancel_the_agreed_save_and_the_resume_ends_exactly(to, reference, tmp_path, measured):
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    proc = start(tmp_path, torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") +
                 [*flags(2), "--out-dir", out], hooks)
    try:
        pids = paused(proc, hooks, [0, 1])
        if to == "one worker twice":
            for _ in range(2):
                os.kill(pids[1], signal.SIGTERM)
                time.sleep(0.1)
        else:  # as slurmstepd sends it: to every process at once (torchrun then passes its own on)
            for pid in [proc.pid, *pids.values()]:
                os.kill(pid, signal.SIGTERM)
        proc.until(lambda: all(hooks.handled(pid, signal.SIGTERM) for pid in pids.values()) or
                   to == "one worker twice" and hooks.handled(pids[1], signal.SIGTERM), "SIGTERM taken")
        time.sleep(0.5)  # torchrun's own SIGTERM reaches its workers too
        hooks.go()
        p = finish(proc, time.monotonic(), measured, f"SIGTERM: {to}")
    finally:
        proc.kill()
    if to == "one worker twice":
        assert_exit(p, 143, nproc=2)  # each worker saved and exited with its status: none killed by the second one
    else:  # torchrun, signalled itself, exits 1 and reports no worker: their own statuses, from the hooks
        assert hooks.exits() == {0: 143, 1: 143} and "got signal: 15" in p.stdout, p.stdout[-3000:]
    step = agreed_stop(p.stdout, signal.SIGTERM, hooks, out, STEPS_PER_EPOCH, PAUSE - 1, NEXT_SAVE)
    log = run("ddp_launch_train.py", *flags(2), "--resume", "auto", "--out-dir", out,
              launcher="torchrun", nproc=2).stdout
    assert f"resuming at step {step}" in log
    assert max_diff(load(out / "last.pt")["model"], reference) == 0


# ---- Ctrl-C: the terminal signals every process of its group, DataLoader workers included
@pytest.mark.full
@pytest.mark.parametrize("launch", ["python", "mp.spawn", "torchrun"])
def test_ctrl_c_to_the_whole_group_stops_at_one_step_with_a_save(launch, images, tmp_path, measured):
    """Ctrl-C, as `kill -INT -- -PGID`, with 2 DataLoader workers per trainer reading files. The DataLoader workers and
    spawn's children ignore it: the trainer (python), the spawn parent (a SIGTERM to its children) or torchrun (a
    SIGINT to each worker's own group) acts on it. One save at one agreed step; exit 130 (python, the spawn parent;
    each of torchrun's workers)."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    args = ["--dataset", "imagefolder", "--data-dir", images, "--image-size", 16, "--workers", 2, "--batch-size", 8,
            "--save-every", 4, "--epochs", 1, "--out-dir", out]
    cmd = {"python": [sys.executable, "ddp_launch_train.py"], "mp.spawn": [sys.executable, "ddp_spawn_train.py",
                                                                           "--nprocs", "2"],
           "torchrun": torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py")}[launch]
    ranks = [0] if launch == "python" else [0, 1]
    proc = start(tmp_path, cmd + [str(a) for a in args], hooks)
    try:
        pids = paused(proc, hooks, ranks)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's process group: every process but torchrun's workers
        sig = signal.SIGTERM if launch == "mp.spawn" else signal.SIGINT
        proc.until(lambda: all(hooks.handled(pid, sig) for pid in pids.values()), f"{sig.name} taken")
        hooks.go()
        p = finish(proc, time.monotonic(), measured, f"Ctrl-C under {launch}")
    finally:
        proc.kill()
    if launch == "torchrun":  # torchrun, signalled itself, exits 1 and reports no worker: theirs, from the hooks
        assert hooks.exits() == {0: 130, 1: 130} and "got signal: 2" in p.stdout, p.stdout[-3000:]
    else:
        assert_exit(p, 130)
    # the line names the user's Ctrl-C, SIGINT, also where spawn's parent passed it on as a SIGTERM
    agreed_stop(p.stdout, signal.SIGINT, hooks, out, 18 // len(ranks), PAUSE - 1, NEXT_SAVE)
    assert "KeyboardInterrupt" not in p.stdout and "exited unexpectedly" not in p.stdout, p.stdout[-3000:]


def test_a_second_ctrl_c_ends_the_run_at_once(tmp_path):
    """The first Ctrl-C is noted (a save to come); a second, while the rank still waits at step 6, ends it at once,
    killed by SIGINT, before that save: the previous checkpoint, step 4's, stays whole."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    proc = start(tmp_path, [sys.executable, "ddp_launch_train.py", *flags(1), "--out-dir", out], hooks)
    try:
        paused(proc, hooks, [0])
        os.kill(proc.pid, signal.SIGINT)
        proc.until(lambda: hooks.handled(proc.pid, signal.SIGINT), "the first Ctrl-C taken")
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(expect=-signal.SIGINT)
    finally:
        proc.kill()
    assert position(load(out / "last.pt"), STEPS_PER_EPOCH) == 4 and temporary(out) == []


# ---- the launcher gone: torchrun starts each worker in a session of its own, so that a torchrun killed (or dead of a
# SIGUSR1 it does not pass on: its default action) leaves them training, with nobody to stop them, beside a requeued
# job; mp.spawn's children likewise outlive a parent killed outright
GONE = {"torchrun SIGKILL": ("torchrun", signal.SIGKILL), "torchrun SIGUSR1": ("torchrun", signal.SIGUSR1),
        "mp.spawn SIGKILL": ("mp.spawn", signal.SIGKILL)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "torchrun SIGKILL" else pytest.mark.full)
                                  for c in GONE])
def test_workers_whose_launcher_is_gone_stop_at_their_next_check_saved_and_the_resume_is_exact(case, tmp_path,
                                                                                                reference):
    """The launcher killed while both ranks wait at PAUSE: each rank, its parent gone, stops at its next check (by
    NEXT_SAVE), saved, with one line, `stopped by SIGHUP at step N`, and exits 129; nothing
    is left running, and --resume auto ends bit for bit where an unbroken run does."""  # (as on SIGHUP: a hangup)
    launch, sig = GONE[case]
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    cmd = (torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") if launch == "torchrun"
           else [sys.executable, "ddp_spawn_train.py", "--nprocs", "2"])
    proc = start(tmp_path, [*cmd, *map(str, flags(2)), "--out-dir", str(out)], hooks)
    try:
        pids = paused(proc, hooks, [0, 1])
        os.kill(proc.pid, sig)
        proc.wait(expect=-sig)  # the launcher is gone; its workers wait at PAUSE
        went_on = time.monotonic()
        hooks.go()
        while any(alive(pid) for pid in pids.values()) and time.monotonic() - went_on < SECONDS:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in pids.values()), f"the orphaned ranks still run\n{proc.output()[-3000:]}"
    finally:
        proc.kill()
    assert hooks.exits() == {0: 129, 1: 129}, (hooks.exits(), proc.output()[-3000:])
    steps = [int(n) for n in re.findall(r"^stopped by SIGHUP at step (\d+), where last.pt was saved", proc.output(),
                                        re.M)]
    assert len(steps) == 1 and PAUSE < steps[0] <= NEXT_SAVE, proc.output()[-3000:]
    assert set(hooks.steps().values()) == {steps[0]} and position(load(out / "last.pt"), STEPS_PER_EPOCH) == steps[0]
    log = run("ddp_launch_train.py", *flags(2), "--resume", "auto", "--out-dir", out, launcher="torchrun",
              nproc=2).stdout
    assert f"resuming at step {steps[0]}" in log
    assert max_diff(load(out / "last.pt")["model"], reference) == 0


@pytest.mark.full
def test_torchrun_signals_to_handle_passes_sigusr1_on_to_its_workers(tmp_path):
    """docs/failures.md: `torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1` passes a SIGUSR1 sent
    to torchrun alone on to its workers, which save at one step and exit 0."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    cmd = torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,"
                   "SIGUSR1", "ddp_launch_train.py", *flags(2), "--out-dir", out)
    proc = start(tmp_path, cmd, hooks)
    try:
        pids = paused(proc, hooks, [0, 1])
        os.kill(proc.pid, signal.SIGUSR1)
        proc.until(lambda: all(hooks.handled(pid, signal.SIGUSR1) for pid in pids.values()), "SIGUSR1 passed on")
        hooks.go()
        proc.wait(expect=None)
    finally:
        proc.kill()
    assert hooks.exits() == {0: 0, 1: 0}, (hooks.exits(), proc.output()[-3000:])
    agreed_stop(proc.output(), signal.SIGUSR1, hooks, out, STEPS_PER_EPOCH, PAUSE, NEXT_SAVE)


# ---- a job's stop: the signal to every process of the job (scancel and a preemption, timeout, docker stop, systemd;
# torchrun to each worker's group), the DataLoader workers reading files and their helper processes included. The
# workers ignore it: their trainer saves at the step the ranks agree on, then ends them (failsafe.init_worker,
# end_workers)
JOB = {  # launch: the command before the script, the ranks (one process: rank 0)
    "python": ([sys.executable], [0]),
    "torchrun": (torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT), [0, 1]),
    "mp.spawn": ([sys.executable], [0, 1]),  # ddp_spawn_train.py --nprocs 2
    "ranks": (None, [0, 1]),  # started by hand over env://
}
JOB_STEPS = {1: 18, 2: 9}  # 144 images at a batch of 8 per process: the steps of an epoch
JOB_CODE = {**CODE, signal.SIGINT: 130}


def job_flags(images, out, *more):
    return ["--dataset", "imagefolder", "--data-dir", images, "--image-size", 16, "--workers", 2, "--batch-size", 8,
            "--save-every", 4, "--epochs", 2, "--out-dir", out, *more]


@pytest.fixture(scope="module")
def unbroken_job(images, tmp_path_factory):
    """get(script, processes): the final checkpoint of the uninterrupted run (every DDP script trains alike)."""
    made = {}

    def get(script, nproc):
        key = (script if script in ("fsdp_train.py", "dp_train.py") else "ddp_launch_train.py", nproc)
        if key not in made:
            out = tmp_path_factory.mktemp("unbroken")
            launcher = "python" if key[0] == "dp_train.py" else "ranks"
            run(key[0], *job_flags(images, out), launcher=launcher, nproc=None if launcher == "python" else nproc)
            made[key] = checkpoint(out)
        return made[key]
    return get


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f"{pid}: {f.read().replace(chr(0), ' ')[:150]}"
    except OSError:
        return f"{pid}: gone"


def start_job(launch, script, args, tmp_path, env, cwd=ROOT):
    """The job's processes that a scheduler knows of (one command, or each rank started by hand)."""
    cmd, ranks = JOB[launch]
    if cmd is None:
        return start_ranks(script, args, len(ranks), env=env, folder=tmp_path / "log", cwd=cwd).procs
    nprocs = ["--nprocs", "2"] if launch == "mp.spawn" else []
    return [Proc(cmd + [script, *nprocs] + [str(a) for a in args], tmp_path / "log", env=env, merge=True, cwd=cwd)]


def final_checkpoint(out, tmp_path):
    """last.pt, or the highest complete ckpt-<step> folder (--ckpt-format dcp) made one file."""
    if not (out / "last.pt").exists():
        from train_extras.sharded import to_file
        to_file(str(out / f"ckpt-{complete_sharded(out)[-1]}"), str(tmp_path / "final.pt"))
        return load(tmp_path / "final.pt")
    return checkpoint(out)


JOB_CASES = [  # launch, signal, script, more flags, to: "job" (every process), "twice" (0.1 s apart), "rank 1"
    ("torchrun", signal.SIGTERM, "ddp_launch_train.py", [], "job"),  # the everyday tier's: scancel of a torchrun
    pytest.param("torchrun", signal.SIGUSR1, "ddp_launch_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("python", signal.SIGTERM, "ddp_launch_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("python", signal.SIGUSR1, "dp_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("python", signal.SIGHUP, "ddp_launch_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("python", signal.SIGTERM, "ddp_launch_train.py", [], "twice", marks=pytest.mark.full),
    pytest.param("mp.spawn", signal.SIGTERM, "ddp_spawn_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("ranks", signal.SIGTERM, "ddp_amp_train.py", ["--precision", "fp32"], "job", marks=pytest.mark.full),
    pytest.param("ranks", signal.SIGUSR1, "ddp_launch_train.py", [], "rank 1", marks=pytest.mark.full),
    pytest.param("torchrun", signal.SIGTERM, "fsdp_train.py", [], "job", marks=pytest.mark.full),
    pytest.param("torchrun", signal.SIGTERM, "fsdp_train.py", ["--ckpt-format", "dcp"], "job",
                 marks=pytest.mark.full)]


@pytest.mark.workers
@pytest.mark.parametrize("launch, sig, script, more, to", JOB_CASES,
                         ids=lambda v: getattr(v, "name", None) or (" ".join(v) if isinstance(v, list) else v))
def test_a_stop_signal_to_every_process_of_the_job_saves_at_one_step_and_leaves_nothing(
        launch, sig, script, more, to, images, unbroken_job, short_tmp, tmp_path, measured):
    """The signal to every process of the job (or, twice 0.1 s apart; or to rank 1 and its workers only) while every
    rank waits at step 6, each trainer reading an ImageFolder with 2 DataLoader workers (started from
    train_extras/workers.py's fork server where the Python needs it): one save at one agreed step, the signal's
    status from every rank, no other line on the terminal (no traceback, no resource tracker's warning), no process
    left a few seconds after, nothing left in TMPDIR; resumed, the run ends bit for bit where the unbroken one does.
    SIGUSR1 kills torchrun itself (it does not handle it); its workers, which got it too, save."""
    stop_the_job(launch, sig, script, more, to, Hooks(tmp_path, pause_at=PAUSE), images, unbroken_job, short_tmp,
                 tmp_path, measured)


def stop_the_job(launch, sig, script, more, to, hooks, images, unbroken_job, tmp, tmp_path, measured, cwd=ROOT):
    """The job test above, its scripts run from `cwd`, its processes with `hooks`."""
    ranks = JOB[launch][1]
    out = tmp_path / "run"
    procs = start_job(launch, script, job_flags(images, out, *more), tmp_path, {**hooks.env, "TMPDIR": str(tmp)}, cwd)
    job = []
    try:
        procs[0].until(lambda: sorted(hooks.paused()) == ranks, f"ranks {ranks} waiting at step {PAUSE}")
        job = [pid for p in procs for pid in [p.pid, *descendants(p.pid)]]
        assert len(job) >= 3 * len(ranks), job  # each trainer and its 2 workers at least
        meant = [hooks.paused()[1], *descendants(hooks.paused()[1])] if to == "rank 1" else job
        for _ in range(2 if to == "twice" else 1):
            for pid in meant:
                with contextlib.suppress(ProcessLookupError):  # gone meanwhile (the launcher's signal came first)
                    os.kill(pid, sig)
            time.sleep(0.1)
        taken = [hooks.paused()[1]] if to == "rank 1" else hooks.paused().values()
        procs[0].until(lambda: all(hooks.handled(pid, sig) for pid in taken), f"{sig.name} taken")
        # none dies of it, but torchrun of the SIGUSR1 it does not handle: a worker or a helper of their start method
        # (the fork server, the resource tracker) killed now would fail the save, or say so on the terminal
        time.sleep(0.5)
        dying = launch == "torchrun" and sig == signal.SIGUSR1
        died = [cmdline(pid) for pid in job[dying:] if not alive(pid)]
        hooks.go()
        went_on = time.monotonic()
        while any(alive(pid) for pid in job):  # the launcher may end first (torchrun, killed by SIGUSR1)
            assert time.monotonic() < went_on + SECONDS, [cmdline(pid) for pid in job if alive(pid)]
            time.sleep(0.05)
        measured(f"{sig.name} to {to} under {launch}: seconds from going on to the last exit",
                 time.monotonic() - went_on, SECONDS)
        for p in procs:
            p.wait(expect=None)
    finally:
        for p in procs:
            p.kill()
    log = "\n".join(p.output() for p in procs)
    assert died == [], f"killed by {sig.name}: {died}\n{log[-3000:]}"
    assert hooks.exits() == {r: JOB_CODE[sig] for r in ranks}, log[-3000:]
    if script != "dp_train.py":  # (no process group)
        kept_groups(hooks, ranks)
    # the job's status (docs/failures.md): torchrun's own, 1 after the SIGTERM it handles, killed by the SIGUSR1 it
    # does not handle; the spawn parent's and a lone process's, the signal's
    launcher = {"torchrun": {signal.SIGTERM: 1, signal.SIGUSR1: -signal.SIGUSR1}.get(sig)}.get(launch, JOB_CODE[sig])
    assert [p.returncode for p in procs[:1]] == [launcher], log[-3000:]
    steps = stopped(log, sig)
    assert len(steps) == 1 and PAUSE < steps[0] <= NEXT_SAVE, log[-3000:]
    assert set(hooks.steps().values()) == {steps[0]}, hooks.steps()  # every rank stopped there, and saved there:
    assert position(final_checkpoint(out, tmp_path), JOB_STEPS[len(ranks)]) == steps[0]
    if launch == "torchrun":  # torchrun's own report of the signal it got (not the scripts'): its traceback
        log = re.sub(r"Traceback \(most recent call last\):\n(?:[ ^].*\n)*.*SignalException: Process "
                     rf"{procs[0].pid} got signal: {sig.value}\n", "", log)
    noise = [line for line in log.splitlines() if re.search(r"Traceback|Error|resource_tracker|leak", line)]
    assert noise == [], log[-3000:]
    # (torch's own, which it keeps: inductor's cache, made as torch.distributed.checkpoint is imported; torchrun's log
    # folder)
    assert [n for n in os.listdir(tmp) if not n.startswith(("torchinductor_", "torchelastic_"))] == [], "in TMPDIR"
    launcher, nproc = {"python": ("python", None), "mp.spawn": ("python", 2)}.get(launch, ("ranks", len(ranks)))
    resumed = run(script, *job_flags(images, out, *more), "--resume", "auto", launcher=launcher, nproc=nproc,
                  cwd=cwd).stdout
    assert f"resuming at step {steps[0]}" in resumed
    final, straight = final_checkpoint(out, tmp_path), unbroken_job(script, len(ranks))
    assert max_diff(final["model"], straight["model"]) == 0
    assert max_diff(final["optimizer"], straight["optimizer"]) == 0


# a run's ending (failsafe.run_and_exit) while a DataLoader's queue is freed and its thread, which holds the queue's two
# named semaphores until it ends, has not run yet: made certain here with a thread that starts 0.3 s late
QUEUE_THREAD_LATE = """
import multiprocessing, multiprocessing.queues, signal, time
import common
import failsafe

feed = multiprocessing.queues.Queue._feed


def late(*args):  # later than the exit's own steps take, even on a busy machine (0.3 s was not, 1 run in 3), and
    time.sleep(0.7)  # within the 1 s that the exit waits for each queue's thread
    feed(*args)


def main(args):
    multiprocessing.queues.Queue._feed = staticmethod(late)
    queue = multiprocessing.get_context("spawn").Queue()  # named semaphores, as forkserver's
    queue.put(0)
    raise failsafe.Stopped(signal.SIGUSR1, 6)


failsafe.run_and_exit(main, lambda: None)
"""


def test_a_run_that_ends_before_its_queues_threads_does_not_report_their_semaphores_as_leaked():
    """The stop's one line and nothing else: without the wait for the queues' threads, the resource tracker, which
    outlives the process, prints "There appear to be 2 leaked semaphore objects" (seen once in the job test above,
    under Python 3.11.7's forkserver: the default start method on Linux from Python 3.14, and spawn's on macOS)."""
    p = command([sys.executable, "-c", QUEUE_THREAD_LATE])
    assert (p.returncode, p.stdout) == (0, ""), p.stdout + p.stderr
    assert p.stderr == "stopped by SIGUSR1 at step 6, where last.pt was saved: --resume auto continues\n", p.stderr


@pytest.mark.workers
@pytest.mark.full
def test_a_job_stop_during_an_evaluation_with_workers_ends_it_with_its_row_and_the_resume_ends_exactly(
        images, unbroken_job, short_tmp, tmp_path, measured):
    """SIGTERM to every process of a torchrun job (torchrun, both trainers, their evaluation's DataLoader workers)
    while epoch 1 evaluates, each batch of it 2 s long: the evaluation ends, its row is written, each rank exits 143
    at the epoch's last step, saved before the evaluation, within torchrun's grace period; nothing else is said,
    nothing left; the resume evaluates no second time and ends bit for bit where the unbroken run does."""
    out, hooks, tmp = tmp_path / "run", Hooks(tmp_path, eval_s=2), short_tmp
    procs = start_job("torchrun", "ddp_launch_train.py", job_flags(images, out), tmp_path,
                      {**hooks.env, "TMPDIR": str(tmp)})
    try:
        procs[0].until(lambda: hooks.evaluating() == [0, 1], "both ranks evaluating")
        job = [procs[0].pid, *descendants(procs[0].pid)]
        assert len(job) >= 7, [cmdline(pid) for pid in job]  # torchrun, 2 trainers, their evaluation's 2 workers each
        for pid in job:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        procs[0].wait(expect=1)  # torchrun's status after the SIGTERM it handles (docs/failures.md)
        measured("job SIGTERM during an evaluation: seconds to torchrun's exit", time.monotonic() - signalled, GRACE)
        assert not [pid for pid in job if alive(pid)], [cmdline(pid) for pid in job if alive(pid)]
    finally:
        procs[0].kill()
    log = procs[0].output()
    assert hooks.exits() == {0: 143, 1: 143}, log[-3000:]
    kept_groups(hooks, [0, 1])
    assert stopped(log, signal.SIGTERM) == [JOB_STEPS[2]], log[-3000:]
    assert [r["step"] for r in metrics(out)] == [JOB_STEPS[2]], log[-3000:]  # the evaluation's row
    log = re.sub(r"Traceback \(most recent call last\):\n(?:[ ^].*\n)*.*SignalException: Process "
                 rf"{procs[0].pid} got signal: {signal.SIGTERM.value}\n", "", log)  # torchrun's own report
    noise = [line for line in log.splitlines() if re.search(r"Traceback|Error|resource_tracker|leak", line)]
    assert noise == [], log[-3000:]
    assert [n for n in os.listdir(tmp) if not n.startswith(("torchinductor_", "torchelastic_"))] == [], "in TMPDIR"
    resumed = run("ddp_launch_train.py", *job_flags(images, out), "--resume", "auto", launcher="ranks", nproc=2).stdout
    assert re.search(rf"resuming at step {JOB_STEPS[2]}\nepoch 2 ", resumed), resumed
    assert [r["step"] for r in metrics(out)] == [JOB_STEPS[2], 2 * JOB_STEPS[2]]
    final, straight = checkpoint(out), unbroken_job("ddp_launch_train.py", 2)
    assert max_diff(final["model"], straight["model"]) == 0
    assert max_diff(final["optimizer"], straight["optimizer"]) == 0
