"""The launchers for real, on CPU with gloo: torchrun restarting a killed worker (one node, and two elastic nodes),
two torchrun "nodes" on one machine, the deprecated torch.distributed.launch (one node and two), SLURM (srun, sbatch,
the example batch script, signals to srun and to the batch script) on a one-node cluster started for the tests.
A rank that stops answering, under each launcher: test_exit_status.py. Signals and interrupted saves in the other
launch styles: test_signals.py.

A torchrun watched while it runs picks its own port (conftest.LAUNCHER_PICKS_PORT); those that need a port known
beforehand (two nodes, the deprecated launcher) are started again on another if a process took it first.

Runs that are compared bit for bit use one thread per process (OMP_NUM_THREADS=1): the same arithmetic everywhere.
Every command started here is killed, with every process under it, at its time limit (TIMEOUT); Python processes
print their stacks first (PYTHONFAULTHANDLER and SIGABRT), so that a hang shows where it hung.
"""
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import PROOF, STEPS_PER_EPOCH, assert_exit, per_process
from hooks import Hooks
from processes import (LAUNCHER_PICKS_PORT, ROOT, TIMEOUT, Proc, address_in_use, children, clean_env, command,
                       free_port, run, signal_pending, torchrun, worker_env)
from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)

# the proof runs' flags (conftest.PROOF), 2 processes: 16 steps per epoch, 3 epochs, a checkpoint every 4 steps
TINY = [*PROOF, *per_process(2), "--save-every", "4", "--resume", "auto"]
EXTRA = {"ddp_amp_train.py": ["--precision", "bf16"]}


def script_args(script, out_dir, *more):
    return [script, *TINY, *EXTRA.get(script, []), "--out-dir", str(out_dir), *more]


def start(cmd, folder, env=None, cwd=ROOT, fork=False):
    return Proc(cmd, folder, env=env, cwd=cwd, merge=True, fork=fork)


def run_on_a_free_port(make_cmd, folder):
    """make_cmd(port) to its end, on a port picked free, again on another while it fails on "address in use"."""
    for attempt in range(5):
        proc = start(make_cmd(free_port()), folder / f"attempt{attempt}")
        proc.wait(expect=None)
        if not (proc.returncode and address_in_use(proc.output())) or attempt == 4:
            break
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.tail()}"
    return proc.output()


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, f"weights differ from the reference run in {different}"


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(shared, tmp_path_factory):
    """The final weights of an uninterrupted run of 2 processes of a script with TINY: the shared proof run where
    there is one (conftest.SHARED), else one made once here; by hand (env://), which trains as torchrun does
    (test_proof.test_launch_style_invariance)."""
    names, made = {("ddp_launch_train.py", ()): "launch2", ("fsdp_train.py", ()): "fsdp2"}, {}

    def get(script, *more):
        if (script, more) in names:
            return weights(os.path.join(shared(names[script, more]), "last.pt"))
        if (script, more) not in made:
            out = tmp_path_factory.mktemp("reference") / "run"
            run(*script_args(script, out, *more), launcher="ranks", nproc=2)
            rows = metrics(out)
            assert [r["epoch"] for r in rows] == [1, 2, 3] and {r["world_size"] for r in rows} == {2}
            made[script, more] = out
        return weights(made[script, more] / "last.pt")
    return get


# ---- 1. torchrun restarts a worker group after one of its workers died, from the mid-epoch checkpoint
@pytest.mark.parametrize("script, victim_rank, more", [
    # with dropout: the saved RNG states make it exact
    pytest.param("ddp_launch_train.py", 0, ("--model", "squeezenet1_1"), marks=pytest.mark.full),
    ("ddp_amp_train.py", 1, ()), pytest.param("fsdp_train.py", 1, (), marks=[pytest.mark.floor, pytest.mark.full])])
def test_torchrun_restart_after_a_killed_worker_ends_with_the_uninterrupted_weights(script, victim_rank, more,
                                                                                   reference, tmp_path):
    out = tmp_path / "run"
    last = out / "last.pt"
    proc = start(torchrun("--nproc_per_node=2", "--max-restarts=3", *LAUNCHER_PICKS_PORT)
                 + script_args(script, out, *more), tmp_path / "log")
    try:
        # the first checkpoint appears at step 4 of epoch 1 (of 16): kill one worker right then, mid-epoch
        proc.until(last.exists, "the first checkpoint")
        workers = {int(worker_env(pid).get("RANK", -1)): pid for pid in children(proc.pid)}
        assert set(workers) >= {0, 1}, f"workers of torchrun (pid {proc.pid}) not found: {workers}"
        os.kill(workers[victim_rank], signal.SIGKILL)
        proc.wait()
        log = proc.output()
    finally:
        proc.kill()
    resumed = [int(s) for s in re.findall(r"resuming at step (\d+)", log)]
    assert len(resumed) == 1, f"expected one restart that resumes from the checkpoint\n{log[-3000:]}"
    assert 0 < resumed[0] < STEPS_PER_EPOCH, f"resumed at step {resumed[0]}: not in the middle of epoch 1"
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert_same_weights(weights(last), reference(script, *more))


# ---- 2. two nodes (two torchrun agents) on one machine
def start_nodes(make_nodes, ready):
    """The nodes make_nodes(port) starts, on a port picked free, once ready(nodes) or one of them has ended; started
    again on another port while one ends failing on "address in use" (another process took the port first)."""
    for attempt in range(5):
        nodes = make_nodes(free_port(), attempt)
        while not (ready(nodes) or any(n.poll() is not None for n in nodes)):
            if time.monotonic() > nodes[0].deadline:
                for n in nodes:
                    n.kill(diagnose=True)
                pytest.fail(f"timed out\n{nodes[0].output()[-3000:]}")
            time.sleep(0.02)
        if attempt < 4 and any(n.poll() for n in nodes) and any(address_in_use(n.output()) for n in nodes):
            for n in nodes:
                n.kill()
            continue
        return nodes


def two_nodes(tmp_path, name, *more, launcher=torchrun):
    """Both nodes' output, once they have ended."""
    nodes = start_nodes(lambda port, attempt: [
        start(launcher("--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                       f"--master_port={port}") + script_args("ddp_launch_train.py", tmp_path / f"node{r}", *more),
              tmp_path / f"{name}-{attempt}-node{r}") for r in (0, 1)], ready=lambda nodes: False)
    try:
        if any(n.returncode for n in nodes):  # one failed: the other may wait for it until its deadline
            for n in nodes:
                n.kill()
        for node in nodes:
            node.wait()
        return [node.output() for node in nodes]
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.full
def test_two_nodes_train_like_one_node_with_two_processes_and_resume_from_node0s_checkpoint(reference, tmp_path):
    # stop mid-epoch 2 (step 20 of 48): only node 0 (rank 0) writes; node 1 has no checkpoint of its own
    two_nodes(tmp_path, "first", "--max-steps", "20")
    ckpt = torch.load(tmp_path / "node0" / "last.pt", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["world_size"]) == (1, 4, 2)
    assert not (tmp_path / "node1" / "last.pt").exists()
    # --resume auto on both nodes: rank 0 reads node 0's file and sends it to node 1
    assert "resuming at step 20" in two_nodes(tmp_path, "second")[0]
    assert [r["epoch"] for r in metrics(tmp_path / "node0")] == [1, 2, 3]
    assert_same_weights(weights(tmp_path / "node0" / "last.pt"), reference("ddp_launch_train.py"))
    assert not (tmp_path / "node1" / "last.pt").exists()


@pytest.mark.full
def test_elastic_two_nodes_restart_together_after_a_worker_dies(reference, tmp_path):
    # torchrun's elastic rendezvous (c10d) with two nodes. A worker on one node dies: its agent restarts it and counts
    # a restart; the other agent restarts its own worker because a node waits to rejoin, and counts none. The new
    # workers must find each other at once all the same: each node starts its worker exactly twice.
    out = tmp_path / "run"  # one folder for both nodes, like a shared filesystem: rank 0 may move between nodes
    started = [set(), set()]  # worker pids seen under each node's agent

    def watch(until, nodes):
        while not until():
            for node, pids in zip(nodes, started):
                pids.update(pid for pid in children(node.pid) if "RANK" in worker_env(pid))
            assert time.monotonic() < nodes[0].deadline, f"timed out\n{nodes[0].output()[-3000:]}"
            time.sleep(0.02)

    def first_checkpoint(nodes):  # the workers seen meanwhile (any of an attempt on a port taken: none)
        started[:] = [set(), set()]
        watch(lambda: (out / "last.pt").exists() or any(n.poll() is not None for n in nodes), nodes)
        return True

    nodes = start_nodes(lambda port, attempt: [
        start(torchrun("--nnodes=2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test{port}")
              + script_args("ddp_launch_train.py", out), tmp_path / f"node{r}-{attempt}") for r in (0, 1)],
        first_checkpoint)
    try:
        assert all(len(pids) == 1 for pids in started), f"workers: {started}"
        alive, victim = (pids.copy().pop() for pids in started)
        os.kill(alive, signal.SIGSTOP)  # so that it cannot fail on its own when its peer dies...
        os.kill(victim, signal.SIGKILL)
        watch(lambda: signal_pending(alive, signal.SIGTERM), nodes)  # ...but only stops when its agent ends it
        os.kill(alive, signal.SIGCONT)
        watch(lambda: all(n.poll() is not None for n in nodes), nodes)
        for n in nodes:
            n.wait()
        logs = [n.output() for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [len(pids) for pids in started] == [2, 2], f"worker starts per node: {started}\n{logs[0][-3000:]}"
    resumed = [int(s) for s in re.findall(r"resuming at step (\d+)", "".join(logs))]
    assert len(resumed) == 1 and 0 < resumed[0] < STEPS_PER_EPOCH, resumed
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


# ---- 3. the deprecated `python -m torch.distributed.launch`, as older tutorials type it
def deprecated_launch(*launcher_args):
    return [sys.executable, "-m", "torch.distributed.launch", *launcher_args]


@pytest.mark.parametrize("script, use_env", [pytest.param("ddp_launch_train.py", False, marks=pytest.mark.floor),
                                             pytest.param("ddp_amp_train.py", True, marks=pytest.mark.full)])
def test_the_deprecated_launcher_trains_as_torchrun(script, use_env, reference, tmp_path):
    """Without --use-env it passes --local-rank=N before the script's arguments (and sets LOCAL_RANK); with it,
    nothing."""
    log = run_on_a_free_port(lambda port: deprecated_launch("--nproc_per_node=2", f"--master_port={port}",
                                                            *["--use-env"] * use_env)
                             + script_args(script, tmp_path / "run"), tmp_path / "log")
    assert "torch.distributed.launch is deprecated" in log  # it really was the old launcher
    assert_same_weights(weights(tmp_path / "run" / "last.pt"), reference(script))


@pytest.mark.full
def test_the_deprecated_launcher_on_two_nodes_trains_as_torchrun(reference, tmp_path):
    # --nnodes=2 --node_rank=0/1 --master_addr=127.0.0.1
    assert "torch.distributed.launch is deprecated" in two_nodes(tmp_path, "launch", launcher=deprecated_launch)[1]
    assert_same_weights(weights(tmp_path / "node0" / "last.pt"), reference("ddp_launch_train.py"))


# ---- 3b. ranks started by hand without LOCAL_RANK (a Kubernetes PyTorchJob), and mpirun of Open MPI and of MPICH
def mpi(program):
    """The path of `program` (mpirun.openmpi, mpiexec.mpich: Debian's openmpi-bin and mpich); skipped where it is
    not installed, failed instead with REQUIRE_MPI=1 (CI, which installs both: green means they ran)."""
    found = shutil.which(program)
    if not found:
        reason = f"{program} is not installed (Debian: openmpi-bin, mpich)"
        pytest.fail(f"REQUIRE_MPI=1, but {reason}") if os.environ.get("REQUIRE_MPI") == "1" else pytest.skip(reason)
    return found


MPI_LAUNCH = {  # how each passes the rendezvous (and one thread per process) to its ranks
    "openmpi": lambda port: [mpi("mpirun.openmpi"), "--allow-run-as-root", "--oversubscribe", "-np", "2",
                             "-x", "OMP_NUM_THREADS=1", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}"],
    "mpich": lambda port: [mpi("mpiexec.mpich"), "-n", "2", "-genv", "OMP_NUM_THREADS", "1",
                           "-genv", "MASTER_ADDR", "127.0.0.1", "-genv", "MASTER_PORT", str(port)]}


@pytest.mark.parametrize("flavour", [pytest.param("openmpi", marks=pytest.mark.floor),
                                     pytest.param("mpich", marks=pytest.mark.full)])
def test_mpirun_trains_like_torchrun(flavour, reference, tmp_path):
    out = tmp_path / "run"
    log = run_on_a_free_port(lambda port: MPI_LAUNCH[flavour](port) + [sys.executable]
                             + script_args("ddp_launch_train.py", out), tmp_path / "log")
    assert "ddp: 2 processes" in log and {r["world_size"] for r in metrics(out)} == {2}, log[-3000:]
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


@pytest.mark.parametrize("flavour", ["openmpi", pytest.param("mpich", marks=pytest.mark.full)])
def test_bad_input_under_mpirun_is_one_line_from_rank_0(flavour, tmp_path):
    """Each rank refuses `--epochs 0`; only the one that mpirun calls rank 0 prints it (failsafe.run_and_exit reads its
    rank)."""
    proc = start(MPI_LAUNCH[flavour](free_port()) + [sys.executable, "ddp_launch_train.py", "--epochs", "0"],
                 tmp_path / "log")
    proc.wait(expect=None)
    log = proc.output()
    assert proc.returncode != 0, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--epochs" in errors[0], log[-3000:]


def test_ranks_started_by_hand_without_local_rank_train_like_torchrun(reference, tmp_path):
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only, as a Kubernetes PyTorchJob sets them: one process per
    machine (here two "machines" on one)."""
    out = tmp_path / "run"
    nodes = start_nodes(lambda port, attempt: [
        start([sys.executable] + script_args("ddp_launch_train.py", out), tmp_path / f"rank{r}-{attempt}",
              env=dict(RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port), fork=True)
        for r in (0, 1)], ready=lambda nodes: False)
    for node in nodes:
        node.wait()
    assert "ddp: 2 processes" in nodes[0].output()
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


# ---- 4. SLURM
def sbatch(cluster, args, tmp_path, cwd=ROOT, each_poll=None, env=None):
    """Submit a batch job and wait for its end (polling faster than `sbatch --wait`); fail unless it completed.
    each_poll(job, env): called at every poll while the job is there (to signal it); env: more variables for it."""
    env = clean_env(cluster.env(), **(env or {}))
    submitted = command(["sbatch", "--parsable", "--time=2", *args], env=env, cwd=cwd, check=True).stdout
    job = re.findall(r"^(\d+)(?:;\S*)?$", submitted, re.M)[-1]  # "<job id>[;<cluster>]", after any warnings
    deadline = time.monotonic() + TIMEOUT
    while True:
        info = command(["scontrol", "show", "job", "--oneliner", job], env=env, timeout=30).stdout
        state = re.search(r"JobState=(\S+)", info)
        if each_poll:
            each_poll(job, env)
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
            break
        if time.monotonic() > deadline:
            command(["scancel", job], env=env, timeout=30)
            pytest.fail(f"batch job {job} did not end in {TIMEOUT}s: {info}")
        time.sleep(0.2)
    output = (Path(cwd) / re.search(r"StdOut=(\S+)", info).group(1)).read_text(errors="replace") \
        if "StdOut=" in info else ""
    assert state.group(1) == "COMPLETED", f"batch job {job}: {info}\n{output[-3000:]}"
    return output


def srun(cluster, tmp_path, options, args, hooks=None, ready=None):
    """`srun --ntasks=2 <options> python <args>`, started; once ready(proc) (or it ended), started again (a new job:
    a new port, which the scripts derive from the job id) while it failed on "address in use"."""
    for attempt in range(5):
        proc = start(["srun", "--ntasks=2", *options, sys.executable, *args], tmp_path / f"srun{attempt}",
                     env=clean_env(cluster.env(), **(hooks.env if hooks else {})))
        while not (ready and ready(proc)) and proc.poll() is None and time.monotonic() < proc.deadline:
            time.sleep(0.02)
        if not (proc.poll() and address_in_use(proc.output())) or attempt == 4:
            return proc


@pytest.mark.full
@pytest.mark.floor
def test_srun_trains_like_torchrun(slurm, reference, tmp_path):
    out = tmp_path / "run"
    srun(slurm, tmp_path, ["--kill-on-bad-exit=1"], script_args("ddp_launch_train.py", out)).wait()
    assert {r["world_size"] for r in metrics(out)} == {2}
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


PAUSE = 6  # the ranks wait after this optimizer step (tests/hooks.py): the last checkpoint before it is step 4's
# a signal that came during the pause is acted on at the ranks' next check (failsafe.Agreement.check: about every 2 s,
# every --log-every steps if sooner, and at every save step), at the latest at the next --save-every step
NEXT_SAVE = 8


def agreed_stop(log, sig):
    """The one step the run stopped at after `sig`, checked to be after the pause and by the next save step."""
    steps = [int(s) for s in re.findall(rf"stopped by {sig.name} at step (\d+), where last.pt was saved", log)]
    assert len(steps) == 1 and PAUSE < steps[0] <= NEXT_SAVE, f"stopped at {steps}, not once in ({PAUSE}, " \
        f"{NEXT_SAVE}]\n{log[-3000:]}"
    return steps[0]


@pytest.mark.full
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 0)], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_an_srun_step_reaches_every_task_which_save_at_the_step_they_agreed_on(slurm, sig, code,
                                                                                          tmp_path):
    """SIGTERM as SLURM sends it when it cancels or preempts a job (`scancel <job>`: SIGTERM to every task, SIGKILL
    after KillWait; a SIGTERM to srun itself makes it kill its tasks at once: "srun: forcing job termination"), and
    SIGUSR1 to srun, which passes it on to its tasks (srun(1), SIGNALS). Every rank learns it at their next check,
    saves at that one step and stops with the documented status, which srun returns (the highest of its tasks')."""
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    proc = srun(slurm, tmp_path, [], script_args("ddp_launch_train.py", out, "--epochs", "1"), hooks,
                ready=lambda proc: len(hooks.paused()) == 2)
    try:
        proc.until(lambda: sorted(hooks.paused()) == [0, 1], f"both tasks waiting at step {PAUSE}")
        before = torch.load(out / "last.pt", map_location="cpu", weights_only=True)["step_in_epoch"]
        job = worker_env(hooks.paused()[0])["SLURM_JOB_ID"]
        if sig == signal.SIGUSR1:
            os.kill(proc.pid, sig)  # to srun
        else:
            command(["scancel", job], env=clean_env(slurm.env()), timeout=30, check=True)
        proc.until(lambda: all(hooks.handled(pid, sig) for pid in hooks.paused().values()), f"{sig.name} taken")
        hooks.go()
        proc.wait(expect=None)
        log = proc.output()
    finally:
        proc.kill()
    assert before == 4
    assert_exit(proc.result(), code)
    stop = agreed_stop(log, sig)
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, stop)  # saved after the signal, where they stopped
    assert hooks.steps() == {0: stop, 1: stop}  # every rank stopped at that one step
    assert [p.name for p in out.iterdir() if ".tmp" in p.name] == []



@pytest.mark.workers
@pytest.mark.full
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGUSR1, 0)], ids=["SIGTERM", "SIGUSR1"])
def test_scancel_to_tasks_reading_files_with_dataloader_workers_saves_and_says_nothing_else(slurm, sig, code, images,
                                                                                           short_tmp, tmp_path):
    """`scancel <job>` (SIGTERM) and `scancel --signal=USR1 <job>` (what slurm_example.sbatch passes on) signal every
    process of the step: the tasks, their DataLoader workers (2 each, reading an ImageFolder) and the workers'
    helper processes. The tasks save at one agreed step and exit with the signal's status; the output holds the
    `stopped` line and no traceback or warning; nothing is left in TMPDIR."""
    out, hooks, tmp = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE), short_tmp
    args = ["ddp_launch_train.py", "--dataset", "imagefolder", "--data-dir", str(images), "--image-size", "16",
            "--workers", "2", "--batch-size", "8", "--save-every", "4", "--epochs", "1", "--out-dir", str(out)]
    hooks.env["TMPDIR"] = str(tmp)  # srun passes its environment on to the tasks
    proc = srun(slurm, tmp_path, [], args, hooks, ready=lambda proc: len(hooks.paused()) == 2)
    try:
        proc.until(lambda: sorted(hooks.paused()) == [0, 1], f"both tasks waiting at step {PAUSE}")
        job = worker_env(hooks.paused()[0])["SLURM_JOB_ID"]
        options = ["--signal=USR1"] if sig == signal.SIGUSR1 else []  # else SIGTERM, then SIGKILL after KillWait
        command(["scancel", *options, job], env=clean_env(slurm.env()), timeout=30, check=True)
        proc.until(lambda: all(hooks.handled(pid, sig) for pid in hooks.paused().values()), f"{sig.name} taken")
        hooks.go()
        proc.wait(expect=None)
        log = proc.output()
    finally:
        proc.kill()
    assert_exit(proc.result(), code)
    agreed_stop(log, sig)
    noise = [line for line in log.splitlines() if re.search(r"Traceback|Error|resource_tracker|leak", line)]
    assert noise == [], log[-3000:]
    assert [n for n in os.listdir(tmp) if not n.startswith("torchinductor_")] == [], "left in TMPDIR"  # (torch's cache)

@pytest.mark.full
@pytest.mark.floor
def test_plain_python_in_an_sbatch_script_is_one_process(slurm, tmp_path):
    # the batch script runs once, on the first node, with SLURM_PROCID=0 and SLURM_NTASKS=2 but no job step:
    # the script must train alone there, not wait for a second rank that nothing starts
    out = tmp_path / "run"
    batch = tmp_path / "job.sh"
    batch.write_text("#!/bin/bash\nset -e\nenv | grep ^SLURM_ | sort > env.txt\n"
                     f"exec {sys.executable} {ROOT / 'ddp_launch_train.py'} --train-size 96 --val-size 20 "
                     f"--batch-size 12 --epochs 1 --out-dir {out}\n")
    sbatch(slurm, ["--ntasks=2", f"--output={tmp_path / 'job.out'}", batch], tmp_path, cwd=tmp_path)
    job_env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines())
    assert job_env["SLURM_NTASKS"] == "2" and "SLURM_STEP_NUM_TASKS" not in job_env  # what the test is about
    assert [(r["epoch"], r["world_size"]) for r in metrics(out)] == [(1, 1)]


@pytest.mark.full
def test_the_example_sbatch_script_trains_on_the_cluster(slurm, reference, tmp_path):
    out = tmp_path / "run"
    # one node with 2 CPUs: override the script's nodes, tasks and CPUs (and its output file) on the command line
    # --time=10: the script's --signal=B:USR1@120 must not come at once, as it would within a 2-minute limit
    sbatch(slurm, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                   f"--output={tmp_path / 'job.out'}",
                   ROOT / "slurm_example.sbatch"] + script_args("ddp_launch_train.py", out)[1:], tmp_path)
    assert {r["world_size"] for r in metrics(out)} == {2}, (tmp_path / "job.out").read_text()[-3000:]
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


@pytest.mark.full
def test_a_job_signalled_before_its_time_limit_saves_requeues_itself_and_ends_exactly(slurm, images, short_tmp,
                                                                                      tmp_path):
    # what --signal=B:USR1@120 does near the time limit: SIGUSR1 to the batch script, here while both tasks wait at
    # step 6 (tests/hooks.py), each reading an ImageFolder with 2 DataLoader workers; the script passes it on to every
    # process of the step, the tasks save at their next check's step and stop, saying nothing else, the job requeues
    # itself and ends bit for bit where an unbroken run does
    out, hooks = tmp_path / "run", Hooks(tmp_path, pause_at=PAUSE)
    hooks.env["TMPDIR"] = str(short_tmp)  # sbatch and srun pass their environment on
    data = ["--dataset", "imagefolder", "--data-dir", str(images), "--image-size", "16", "--workers", "2",
            "--batch-size", "8", "--save-every", "4", "--epochs", "3"]
    sent = []

    def signal_at_the_pause(job, env):
        paused = hooks.paused()
        if not sent and sorted(paused) == [0, 1]:
            command(["scancel", "--batch", "--signal=USR1", job], env=env, timeout=30, check=True)
            sent.append(paused)
        if sent and all(hooks.handled(pid, signal.SIGUSR1) for pid in sent[0].values()):
            hooks.go()  # both tasks have it: on they go
    # --time=10: the script's --signal=B:USR1@120 must not come at once, as it would within a 2-minute limit
    sbatch(slurm, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                   f"--output={tmp_path / 'job.out'}",
                   ROOT / "slurm_example.sbatch", *data, "--out-dir", str(out)], tmp_path,
           each_poll=signal_at_the_pause, env=hooks.env)
    log = (tmp_path / "job.out").read_text()  # both runs of the job: the script opens it to append
    stop = agreed_stop(log, signal.SIGUSR1)
    assert "requeued" in log, log[-3000:]
    assert f"resuming at step {stop}" in log, log[-3000:]  # from the checkpoint saved after the signal
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    noise = [line for line in log.splitlines() if re.search(r"Traceback|Error|resource_tracker|leak", line)]
    assert noise == [], log[-3000:]
    assert [n for n in os.listdir(short_tmp) if not n.startswith("torchinductor_")] == [], "left in TMPDIR"
    run("ddp_launch_train.py", *data, "--out-dir", tmp_path / "unbroken", launcher="ranks", nproc=2)
    assert_same_weights(weights(out / "last.pt"), weights(tmp_path / "unbroken" / "last.pt"))
