"""The launchers for real, on CPU with gloo: torchrun restarting a killed worker (one node, and two elastic nodes),
two torchrun "nodes" on one machine, the deprecated torch.distributed.launch (one node and two), SLURM (srun, sbatch,
the example batch script) on a one-node cluster started for the tests, and a process killed while it writes its
checkpoint.

Runs that are compared bit for bit use one thread per process (OMP_NUM_THREADS=1): the same arithmetic everywhere.
Every command started here is killed, with every process under it, at its time limit (TIMEOUT); Python processes
print their stacks first (PYTHONFAULTHANDLER and SIGABRT), so that a hang shows where it hung.
"""
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import children, descendants, free_port
from conftest import clean_env as fresh_env
from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds, for any one command
# 384 samples, 2 processes x 12: 16 steps per epoch, a checkpoint every 4 steps
TINY = ["--train-size", "384", "--val-size", "101", "--batch-size", "12", "--epochs", "3", "--save-every", "4",
        "--resume", "auto"]
STEPS_PER_EPOCH = 16
EXTRA = {"ddp_amp_train.py": ["--precision", "bf16"]}


def clean_env(base=None, **extra):
    """The environment of a fresh launch (conftest.clean_env), with Python's stacks printed on SIGABRT and this
    Python first on PATH. Of a SLURM cluster's environment `base` it keeps SLURM_CONF, which names the cluster."""
    env = fresh_env(base, PYTHONFAULTHANDLER="1",
                    PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]), **extra)
    if base is not None and "SLURM_CONF" in base:
        env["SLURM_CONF"] = base["SLURM_CONF"]
    return env


def torchrun(*launcher_args):
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args]


def script_args(script, out_dir, *more):
    return [script, *TINY, *EXTRA.get(script, []), "--out-dir", str(out_dir), *more]


def worker_env(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


class Proc:
    """A command in a session of its own, output to a file; killed with everything it started at its deadline."""

    def __init__(self, cmd, log, env=None, cwd=REPO):
        self.cmd, self.log = [str(c) for c in cmd], Path(log)
        self.p = subprocess.Popen(self.cmd, cwd=cwd, env=env or clean_env(), stdout=open(self.log, "wb"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.deadline = time.monotonic() + TIMEOUT

    def output(self):
        return self.log.read_text(errors="replace")

    def kill(self, diagnose=False):
        """Kill the command and every process under it (torchrun starts its workers in sessions of their own).
        diagnose: first SIGABRT, on which Python processes print their stacks (PYTHONFAULTHANDLER)."""
        if self.p.poll() is not None:  # ended and reaped: its pid may be another process's by now
            return
        tree = [self.p.pid] + descendants(self.p.pid)  # before any dies: orphans are untraceable
        for sig in ((signal.SIGABRT,) if diagnose else ()) + (signal.SIGKILL,):
            for pid in tree:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGABRT:
                time.sleep(2)
        self.p.wait()

    def wait(self, expect=0):
        try:
            rc = self.p.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill(diagnose=True)
            pytest.fail(f"timed out after {TIMEOUT}s: {' '.join(self.cmd)}\n{self.output()[-3000:]}")
        if expect is not None:
            assert rc == expect, f"exit status {rc}: {' '.join(self.cmd)}\n{self.output()[-3000:]}"
        return self.output()


def run(cmd, log, env=None, cwd=REPO):
    return Proc(cmd, log, env, cwd).wait()


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, f"weights differ from the reference run in {different}"


def metrics(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final weights of an uninterrupted `torchrun --nproc_per_node=2` run of a script with TINY, computed once."""
    cache = {}

    def get(script, *more):
        if (script, more) not in cache:
            out = tmp_path_factory.mktemp("reference")
            launch = torchrun("--nproc_per_node=2", f"--master_port={free_port()}")
            run(launch + script_args(script, out / "run", *more), out / "log")
            rows = metrics(out / "run")
            assert [r["epoch"] for r in rows] == [1, 2, 3] and {r["world_size"] for r in rows} == {2}
            cache[script, more] = weights(out / "run" / "last.pt")
        return cache[script, more]
    return get


# ---- 1. torchrun restarts a worker group after one of its workers died, from the mid-epoch checkpoint
@pytest.mark.slow
@pytest.mark.parametrize("script, victim_rank, more", [
    ("ddp_launch_train.py", 0, ("--model", "squeezenet1_1")),  # with dropout: the saved RNG states make it exact
    ("ddp_amp_train.py", 1, ()), pytest.param("fsdp_train.py", 1, (), marks=pytest.mark.floor)])
def test_torchrun_restart_after_a_killed_worker_ends_with_the_uninterrupted_weights(script, victim_rank, more,
                                                                                   reference, tmp_path):
    out = tmp_path / "run"
    last = out / "last.pt"
    proc = Proc(torchrun("--nproc_per_node=2", "--max-restarts=3", f"--master_port={free_port()}")
                + script_args(script, out, *more), tmp_path / "log")
    try:
        # the first checkpoint appears at step 4 of epoch 1 (of 16): kill one worker right then, mid-epoch
        while not last.exists():
            assert proc.p.poll() is None, f"the run ended before its first checkpoint\n{proc.output()[-3000:]}"
            assert time.monotonic() < proc.deadline, "no checkpoint appeared"
            time.sleep(0.01)
        workers = {int(worker_env(pid).get("RANK", -1)): pid for pid in children(proc.p.pid)}
        assert set(workers) >= {0, 1}, f"workers of torchrun (pid {proc.p.pid}) not found: {workers}"
        os.kill(workers[victim_rank], signal.SIGKILL)
        log = proc.wait()
    finally:
        proc.kill()
    resumed = [int(s) for s in re.findall(r"resuming at step (\d+)", log)]
    assert len(resumed) == 1, f"expected one restart that resumes from the checkpoint\n{log[-3000:]}"
    assert 0 < resumed[0] < STEPS_PER_EPOCH, f"resumed at step {resumed[0]}: not in the middle of epoch 1"
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert_same_weights(weights(last), reference(script, *more))


# ---- 2. two nodes (two torchrun agents) on one machine
def two_nodes(tmp_path, name, *more, launcher=torchrun):
    port = free_port()
    nodes = [Proc(launcher("--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                           f"--master_port={port}") + script_args("ddp_launch_train.py", tmp_path / f"node{r}", *more),
                  tmp_path / f"{name}-node{r}.log") for r in (0, 1)]
    try:
        for node in nodes:
            node.wait()
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.slow
def test_two_nodes_train_like_one_node_with_two_processes_and_resume_from_node0s_checkpoint(reference, tmp_path):
    # stop mid-epoch 2 (step 20 of 48): only node 0 (rank 0) writes; node 1 has no checkpoint of its own
    two_nodes(tmp_path, "first", "--max-steps", "20")
    ckpt = torch.load(tmp_path / "node0" / "last.pt", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["world_size"]) == (1, 4, 2)
    assert not (tmp_path / "node1" / "last.pt").exists()
    # --resume auto on both nodes: rank 0 reads node 0's file and sends it to node 1
    two_nodes(tmp_path, "second")
    assert "resuming at step 20" in (tmp_path / "second-node0.log").read_text()
    assert [r["epoch"] for r in metrics(tmp_path / "node0")] == [1, 2, 3]
    assert_same_weights(weights(tmp_path / "node0" / "last.pt"), reference("ddp_launch_train.py"))
    assert not (tmp_path / "node1" / "last.pt").exists()


def signal_pending(pid, sig):
    """Whether `sig` waits for delivery to `pid` (as a signal sent to a stopped process does), from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone: whatever was sent has been delivered
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (sig - 1) & 1 for mask in pending)


@pytest.mark.slow
def test_elastic_two_nodes_restart_together_after_a_worker_dies(reference, tmp_path):
    # torchrun's elastic rendezvous (c10d) with two nodes. A worker on one node dies: its agent restarts it and counts
    # a restart; the other agent restarts its own worker because a node waits to rejoin, and counts none. The new
    # workers must find each other at once all the same: each node starts its worker exactly twice.
    port = free_port()
    out = tmp_path / "run"  # one folder for both nodes, like a shared filesystem: rank 0 may move between nodes
    nodes = [Proc(torchrun("--nnodes=2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test{port}")
                  + script_args("ddp_launch_train.py", out), tmp_path / f"node{r}.log") for r in (0, 1)]
    started = [set(), set()]  # worker pids seen under each node's agent

    def watch(until):
        while not until():
            for node, pids in zip(nodes, started):
                pids.update(pid for pid in children(node.p.pid) if "RANK" in worker_env(pid))
            assert time.monotonic() < nodes[0].deadline, f"timed out\n{nodes[0].output()[-3000:]}"
            time.sleep(0.02)

    try:
        watch(lambda: (out / "last.pt").exists() or any(n.p.poll() is not None for n in nodes))
        assert all(len(pids) == 1 for pids in started), f"workers: {started}"
        alive, victim = (pids.copy().pop() for pids in started)
        os.kill(alive, signal.SIGSTOP)  # so that it cannot fail on its own when its peer dies...
        os.kill(victim, signal.SIGKILL)
        watch(lambda: signal_pending(alive, signal.SIGTERM))  # ...but only stops when its agent ends it
        os.kill(alive, signal.SIGCONT)
        watch(lambda: all(n.p.poll() is not None for n in nodes))
        logs = [n.wait() for n in nodes]
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


@pytest.mark.slow
@pytest.mark.parametrize("script, use_env", [pytest.param("ddp_launch_train.py", False, marks=pytest.mark.floor),
                                             ("ddp_amp_train.py", True)])
def test_the_deprecated_launcher_trains_as_torchrun(script, use_env, reference, tmp_path):
    """Without --use-env it passes --local-rank=N before the script's arguments (and sets LOCAL_RANK); with it,
    nothing."""
    log = run(deprecated_launch("--nproc_per_node=2", f"--master_port={free_port()}", *["--use-env"] * use_env)
              + script_args(script, tmp_path / "run"), tmp_path / "log")
    assert "torch.distributed.launch is deprecated" in log  # it really was the old launcher
    assert_same_weights(weights(tmp_path / "run" / "last.pt"), reference(script))


@pytest.mark.slow
def test_the_deprecated_launcher_on_two_nodes_trains_as_torchrun(reference, tmp_path):
    two_nodes(tmp_path, "launch", launcher=deprecated_launch)  # --nnodes=2 --node_rank=0/1 --master_addr=127.0.0.1
    assert "torch.distributed.launch is deprecated" in (tmp_path / "launch-node1.log").read_text()
    assert_same_weights(weights(tmp_path / "node0" / "last.pt"), reference("ddp_launch_train.py"))


# ---- 4. SLURM
def sbatch(cluster, args, tmp_path, cwd=REPO, signal_once=None):
    """Submit a batch job and wait for its end (polling faster than `sbatch --wait`); fail unless it completed.
    signal_once: (file, signal name): once the file exists, send the signal to the batch script, as --signal=B:..."""
    env = clean_env(cluster.env())
    submitted = run(["sbatch", "--parsable", "--time=2", *args], tmp_path / "sbatch.log", env=env, cwd=cwd)
    job = re.findall(r"^(\d+)(?:;\S*)?$", submitted, re.M)[-1]  # "<job id>[;<cluster>]", after any warnings
    deadline = time.monotonic() + TIMEOUT
    while True:
        info = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True,
                              env=env, timeout=30).stdout
        state = re.search(r"JobState=(\S+)", info)
        if signal_once and Path(signal_once[0]).exists():
            subprocess.run(["scancel", "--batch", f"--signal={signal_once[1]}", job], env=env, timeout=30, check=True)
            signal_once = None
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED"):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"batch job {job} did not end in {TIMEOUT}s: {info}")
        time.sleep(0.2)
    output = (Path(cwd) / re.search(r"StdOut=(\S+)", info).group(1)).read_text(errors="replace") \
        if "StdOut=" in info else ""
    assert state.group(1) == "COMPLETED", f"batch job {job}: {info}\n{output[-3000:]}"
    return output


@pytest.mark.slow
@pytest.mark.floor
def test_srun_trains_like_torchrun(slurm, reference, tmp_path):
    out = tmp_path / "run"
    run(["srun", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable] + script_args("ddp_launch_train.py", out),
        tmp_path / "log", env=clean_env(slurm.env()))
    assert {r["world_size"] for r in metrics(out)} == {2}
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


@pytest.mark.floor
def test_plain_python_in_an_sbatch_script_is_one_process(slurm, tmp_path):
    # the batch script runs once, on the first node, with SLURM_PROCID=0 and SLURM_NTASKS=2 but no job step:
    # the script must train alone there, not wait for a second rank that nothing starts
    out = tmp_path / "run"
    batch = tmp_path / "job.sh"
    batch.write_text("#!/bin/bash\nset -e\nenv | grep ^SLURM_ | sort > env.txt\n"
                     f"exec {sys.executable} {REPO / 'ddp_launch_train.py'} --train-size 96 --val-size 20 "
                     f"--batch-size 12 --epochs 1 --out-dir {out}\n")
    sbatch(slurm, ["--ntasks=2", f"--output={tmp_path / 'job.out'}", batch], tmp_path, cwd=tmp_path)
    job_env = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines())
    assert job_env["SLURM_NTASKS"] == "2" and "SLURM_STEP_NUM_TASKS" not in job_env  # what the test is about
    assert [(r["epoch"], r["world_size"]) for r in metrics(out)] == [(1, 1)]


@pytest.mark.slow
def test_the_example_sbatch_script_trains_on_the_cluster(slurm, reference, tmp_path):
    out = tmp_path / "run"
    # one node with 2 CPUs: override the script's nodes, tasks and CPUs (and its output file) on the command line
    # --time=10: the script's --signal=B:USR1@120 must not come at once, as it would within a 2-minute limit
    sbatch(slurm, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                           f"--output={tmp_path / 'job.out'}",
                           REPO / "slurm_example.sbatch"] + script_args("ddp_launch_train.py", out)[1:], tmp_path)
    assert {r["world_size"] for r in metrics(out)} == {2}, (tmp_path / "job.out").read_text()[-3000:]
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


@pytest.mark.slow
def test_a_job_signalled_before_its_time_limit_saves_requeues_itself_and_ends_exactly(slurm, reference,
                                                                                      tmp_path):
    # what --signal=B:USR1@120 does near the time limit: SIGUSR1 to the batch script, here once the first checkpoint
    # is written (step 4 of epoch 1); the script passes it on, the tasks save and stop, the job requeues itself
    out = tmp_path / "run"
    # --time=10: the script's --signal=B:USR1@120 must not come at once, as it would within a 2-minute limit
    sbatch(slurm, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                           f"--output={tmp_path / 'job.out'}",
                           REPO / "slurm_example.sbatch"] + script_args("ddp_launch_train.py", out)[1:], tmp_path,
           signal_once=(out / "last.pt", "USR1"))
    log = (tmp_path / "job.out").read_text()  # both runs of the job: the script opens it to append
    stopped = re.findall(r"stopped by SIGUSR1 at step (\d+), where last.pt was saved", log)
    assert len(stopped) == 1 and "requeued" in log, log[-3000:]
    assert f"resuming at step {stopped[0]}" in log and 4 < int(stopped[0]) < STEPS_PER_EPOCH, log[-3000:]
    assert [r["epoch"] for r in metrics(out)] == [1, 2, 3]
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))


# ---- 5. a process killed while it writes a checkpoint leaves the previous one intact
DIE_IN_SECOND_SAVE = r"""
import io, os, runpy, shutil, signal, sys
import torch
real_save, calls, last = torch.save, [], os.environ["TEST_LAST_PT"]
def save(obj, f, *args, **kwargs):
    calls.append(isinstance(obj, dict) and "model" in obj)  # a checkpoint (torch also saves objects it sends)
    if sum(calls) < 2:
        return real_save(obj, f, *args, **kwargs)
    shutil.copyfile(last, last + ".before")  # the checkpoint as it was when this save began
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    f.write(buf.getvalue()[:len(buf.getvalue()) // 2])  # half of it written to disk...
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)  # ...when the process dies
torch.save = save
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_intact(tmp_path):
    out = tmp_path / "run"
    last = out / "last.pt"
    # one process: 32 steps per epoch, saves at steps 4 and 8; the second save dies half-written
    Proc([sys.executable, "-c", DIE_IN_SECOND_SAVE, "ddp_launch_train.py", *TINY, "--epochs", "1", "--out-dir", out],
         tmp_path / "log", env=clean_env(TEST_LAST_PT=str(last))).wait(expect=-signal.SIGKILL)
    before = (out / "last.pt.before").read_bytes()
    assert last.read_bytes() == before
    partial = [p for p in out.iterdir() if p.name.startswith("last.pt.tmp")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size, "the killed save did not write to a temporary file"
    ckpt = torch.load(io.BytesIO(before), map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 4)
    with pytest.raises(Exception):
        torch.load(partial[0], map_location="cpu", weights_only=True)
    # and the run goes on from it
    log = run([sys.executable, "ddp_launch_train.py", *TINY, "--epochs", "1", "--out-dir", out], tmp_path / "log2")
    assert "resuming at step 4" in log
    assert torch.load(last, map_location="cpu", weights_only=True)["epoch"] == 1


# ---- 6. a signal saves the run where it is and stops it; a rank that stops answering is named
WRAP = r"""
import os, runpy, sys, time
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
import common, torch
if os.environ.get("TEST_HANG_AT"):  # "rank:step": that rank stops answering after that step
    rank, step = map(int, os.environ["TEST_HANG_AT"].split(":"))
    step_done = common.Watch.step_done
    def hang(self, s):
        if self.rank == rank and s == step:
            time.sleep(3600)
        return step_done(self, s)
    common.Watch.step_done = hang
if os.environ.get("TEST_SLOW_SAVES"):  # a save budget of this many seconds; saving a checkpoint past step 4: an hour
    common.Watch.SAVE_BUDGET_S = float(os.environ["TEST_SLOW_SAVES"])
    save = torch.save
    def slow(obj, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step_in_epoch", 0) > 4:
            time.sleep(3600)
        return save(obj, *args, **kwargs)
    torch.save = slow
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def running(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"  # not a zombie
    except OSError:
        return False


def start_and_signal(tmp_path, sig, *more, env=None, stacks_first=False):
    """torchrun with 2 workers (no restarts) of ddp_launch_train.py; once the first checkpoint is written (step 4 of
    epoch 1), `sig` to both workers (after a SIGUSR2 with stacks_first). Returns (Proc, seconds from the signal to
    torchrun's exit, workers' pids)."""
    (tmp_path / "wrap.py").write_text(WRAP)
    out = tmp_path / "run"
    proc = Proc(torchrun("--nproc_per_node=2", f"--master_port={free_port()}", tmp_path / "wrap.py")
                + script_args("ddp_launch_train.py", out, *more), tmp_path / "log", env=clean_env(**(env or {})))
    try:
        while not (out / "last.pt").exists():
            assert proc.p.poll() is None, f"the run ended before its first checkpoint\n{proc.output()[-3000:]}"
            assert time.monotonic() < proc.deadline, "no checkpoint appeared"
            time.sleep(0.01)
        workers = [pid for pid in children(proc.p.pid) if "RANK" in worker_env(pid)]
        assert len(workers) == 2, workers
        for pid in workers if stacks_first else []:  # one at a time: two dumps at once interleave their lines
            os.kill(pid, signal.SIGUSR2)
            time.sleep(0.3)
        t = time.monotonic()
        for pid in workers:
            os.kill(pid, sig)
        proc.p.wait(timeout=60)
        return proc, time.monotonic() - t, workers
    finally:
        proc.kill()


@pytest.mark.slow
@pytest.mark.floor
def test_sigterm_saves_where_the_workers_stopped_and_the_resume_ends_exactly(reference, tmp_path):
    proc, seconds, _ = start_and_signal(tmp_path, signal.SIGTERM, stacks_first=True)
    log, ckpt = proc.output(), torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)
    assert log.count("most recent call first") >= 2, log[-3000:]  # SIGUSR2: each worker printed its stacks...
    assert 'ddp_launch_train.py", line' in log  # ...in the training script, and went on
    stopped = re.findall(r"stopped by SIGTERM at step (\d+), where last.pt was saved", log)
    assert len(stopped) == 1, f"expected one line from rank 0\n{log[-3000:]}"
    assert ckpt["epoch"] * STEPS_PER_EPOCH + ckpt["step_in_epoch"] == int(stopped[0]) > 4  # after the first save
    assert ckpt["step_in_epoch"] > 0  # and mid-epoch
    assert proc.p.returncode != 0 and seconds < 10, (proc.p.returncode, seconds)
    print(f"SIGTERM to exit: {seconds:.2f} s")
    log = run(torchrun("--nproc_per_node=2", f"--master_port={free_port()}")
              + script_args("ddp_launch_train.py", tmp_path / "run"), tmp_path / "log2")
    assert f"resuming at step {stopped[0]}" in log
    assert [r["epoch"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert_same_weights(weights(tmp_path / "run" / "last.pt"), reference("ddp_launch_train.py"))


@pytest.mark.slow
def test_sigusr1_to_the_spawn_parent_reaches_every_child_and_the_resume_ends_exactly(reference, tmp_path):
    # a scheduler signals the process it started: here mp.spawn's parent, which passes it on to its children
    out = tmp_path / "run"
    proc = Proc([sys.executable, "ddp_spawn_train.py", "--nprocs", "2", *script_args("ddp_spawn_train.py", out)[1:]],
                tmp_path / "log")
    try:
        while not (out / "last.pt").exists():
            assert proc.p.poll() is None, f"the run ended before its first checkpoint\n{proc.output()[-3000:]}"
            assert time.monotonic() < proc.deadline, "no checkpoint appeared"
            time.sleep(0.01)
        os.kill(proc.p.pid, signal.SIGUSR1)
        log = proc.wait(expect=0)  # saved on SIGUSR1: exit 0, so that a launcher does not restart it
    finally:
        proc.kill()
    stopped = re.findall(r"stopped by SIGUSR1 at step (\d+), where last.pt was saved", log)
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    assert len(stopped) == 1 and ckpt["step_in_epoch"] == int(stopped[0]) > 4, log[-3000:]
    log = run([sys.executable, "ddp_spawn_train.py", "--nprocs", "2", *script_args("ddp_spawn_train.py", out)[1:]],
              tmp_path / "log2")
    assert f"resuming at step {stopped[0]}" in log
    assert_same_weights(weights(out / "last.pt"), reference("ddp_launch_train.py"))  # spawn trains as torchrun


@pytest.mark.slow
def test_sigterm_past_the_save_budget_leaves_the_previous_checkpoint(tmp_path):
    proc, seconds, _ = start_and_signal(tmp_path, signal.SIGTERM, env={"TEST_SLOW_SAVES": "2"})
    log = proc.output()
    assert log.count("not saved and stopped within 2 s: leaving without a new checkpoint") == 1, log[-3000:]
    assert 2 <= seconds < 10 and proc.p.returncode != 0, (seconds, proc.p.returncode)
    ckpt = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 4)  # the one written before the signal, intact
    assert [p.name for p in (tmp_path / "run").iterdir() if ".tmp" in p.name] == []  # its half-written successor: gone


@pytest.mark.slow
@pytest.mark.floor
def test_a_rank_that_stops_answering_is_named_and_every_process_ends(tmp_path):
    (tmp_path / "wrap.py").write_text(WRAP)
    proc = Proc(torchrun("--nproc_per_node=2", f"--master_port={free_port()}", tmp_path / "wrap.py")
                + script_args("ddp_launch_train.py", tmp_path / "run", "--step-timeout", "3"), tmp_path / "log",
                env=clean_env(TEST_HANG_AT="1:6"))
    try:
        t = time.monotonic()
        while not (tmp_path / "run" / "last.pt").exists() and proc.p.poll() is None:
            time.sleep(0.01)
        t = time.monotonic()  # step 4: the hang is 2 steps away
        tree = [proc.p.pid] + descendants(proc.p.pid)
        proc.p.wait(timeout=60)
        seconds = time.monotonic() - t
    finally:
        proc.kill()
    log = proc.output()
    named = re.findall(r"error: a collective timed out after 3 s in (\w+) .* at step 6: rank 1 \(at step 5\) never "
                       r"arrived", log)
    assert len(named) == 1, f"expected one line naming rank 1\n{log[-3000:]}"
    print(f"hang to exit: {seconds:.1f} s (step timeout 3 s), timed out in {named[0]}")
    assert seconds < 3 + 30, seconds  # the step timeout, then at most torchrun's SIGTERM and the 20 s save budget
    alive = [pid for pid in tree if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes left: {alive}"
