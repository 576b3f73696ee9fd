"""Documented claims that no other test checks, each checked on the real processes: Ctrl-C (docs/failures.md),
torchrun's --master_port=0 refused in one line (each torchrun script's setup_distributed), and the default thread
count (common.set_threads_and_math: the cores of the affinity mask shared among the processes of the machine)."""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import assert_exit, checkpoint
from hooks import Hooks
from processes import LAUNCHER_PICKS_PORT, SETTINGS, TIMEOUT, Proc, alive, clean_env, descendants, torchrun
from test_precision import see_env, seen


def finish(p, timeout):
    """p's output once it has exited; past `timeout` its whole tree is killed and the test fails."""
    p.wait(expect=None, timeout=timeout)
    return p.stdout, p.stderr


# ---- Ctrl-C: "every process unwinds, destroys its process group and exits; no half-written file, no orphan"
# Imported first by every Python process of the run (PYTHONPATH; not by mp.spawn's resource tracker, which would
# import torch for nothing): each destroy_process_group that returns leaves a file named after its process in
# GONE_DIR. The scripts call dist.destroy_process_group, looked up at each call: the patched one.
GONE = '''
import os, sys
if os.environ.get("GONE_DIR") and "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import torch.distributed as dist
    _destroy = dist.destroy_process_group

    def _destroyed(*args, **kwargs):
        result = _destroy(*args, **kwargs)
        open(os.path.join(os.environ["GONE_DIR"], str(os.getpid())), "w").close()
        return result
    dist.destroy_process_group = _destroyed
'''
LONG = ["--train-size", 20000, "--val-size", 20, "--batch-size", 8, "--save-every", 2]  # minutes of training


@pytest.mark.full
@pytest.mark.parametrize("launch", ["spawn", "torchrun"])
def test_ctrl_c_ends_every_process_cleanly(tmp_path, launch):
    """Ctrl-C in a terminal sends SIGINT to the foreground process group: here, the group of the session the run
    was started in. What then happens, from the code:

    * spawn: the parent and both children are in that group. The children ignore it (they start with SIGINT
      ignored); the parent passes it on as a SIGTERM, on which they save at one step and exit 143 through
      `failsafe.run_and_exit` (destroy_process_group); the parent then exits 130.
    * torchrun: its workers run in sessions of their own, so only the agent gets the SIGINT. Its handler raises
      SignalException, which stops the workers by sending each of them SIGINT (SIGKILL 30 s later if one is still
      there): each saves at one step and leaves through `failsafe.run_and_exit` (destroy_process_group). The agent
      then exits 1 with the SignalException ("got signal: 2"): torchrun's status for a launcher stopped by a signal."""
    out = tmp_path / "out"
    gone_dir, hook_dir = tmp_path / "gone", tmp_path / "hook"
    gone_dir.mkdir()
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(GONE)
    env = clean_env(GONE_DIR=str(gone_dir),
                    PYTHONPATH=os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")])))
    cmd = (torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") if launch == "torchrun"
           else [sys.executable, "ddp_spawn_train.py", "--nprocs", "2"])
    # SIGINT as a terminal leaves it (processes.Proc: whatever the shell that runs the tests ignores)
    p = Proc([*cmd, *map(str, LONG), "--out-dir", str(out)], tmp_path / "logs", env=env)
    try:
        p.until((out / "last.pt").exists, "training, and a checkpoint written")
        tree = descendants(p.pid)  # listed now: an orphan can no longer be traced to its launcher
        workers = [w for w in tree if "spawn_main" in open(f"/proc/{w}/cmdline").read()
                   or "ddp_launch_train.py" in open(f"/proc/{w}/cmdline").read()]
        assert len(workers) == 2, tree
        os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
        _, err = finish(p, 90)  # torchrun waits up to 30 s for its workers before it kills them
    finally:
        p.kill()
    t = time.time()
    while [q for q in tree if alive(q)] and time.time() - t < 30:  # mp.spawn's resource tracker leaves last
        time.sleep(0.2)
    orphans = [q for q in tree if alive(q)]
    for q in orphans:  # not left running after the test
        with contextlib.suppress(ProcessLookupError):
            os.kill(q, signal.SIGKILL)
    assert not orphans, f"orphans: {orphans} of {tree}\n{err[-4000:]}"
    destroyed = {int(f) for f in os.listdir(gone_dir)}
    assert set(workers) <= destroyed, f"workers {workers}, process groups destroyed by {destroyed}\n{err[-4000:]}"
    assert [f for f in os.listdir(out) if ".tmp" in f] == []  # no half-written file
    assert checkpoint(str(out))["step_in_epoch"] >= 2  # the last checkpoint is complete, loadable
    if launch == "spawn":
        assert p.returncode == 130, (p.returncode, err[-4000:])
    else:
        assert p.returncode == 1 and "got signal: 2" in err, (p.returncode, err[-4000:])


# ---- torchrun --master_port=0: refused by every worker, one line, before anything is written
@pytest.mark.parametrize("script", ["ddp_launch_train.py", "ddp_amp_train.py", "fsdp_train.py"])
def test_torchrun_master_port_0_is_one_error_line(tmp_path, script):
    """torchrun's static rendezvous on --master_port=0 binds its store on a port the OS picks, but tells the workers
    MASTER_PORT=0: the script's setup_distributed refuses it on every rank (a UsageError: status 2) rather than let
    them try to reach port 0 until the 10-minute timeout. conftest.run's torchrun adds a --master_port of its own:
    not used."""
    cmd = torchrun("--nproc_per_node=2", "--master_port=0", script, "--train-size", "64", "--val-size", "20",
                   "--batch-size", "8", "--max-steps", "2", "--out-dir", str(tmp_path / "out"))
    p = Proc(cmd, tmp_path / "logs")
    out, err = finish(p, 120)
    p = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    errors = [line for line in (out + err).splitlines() if "error:" in line]
    assert errors == ["error: MASTER_PORT=0 (torchrun --master_port=0): give a free port, or --standalone"], out + err
    assert_exit(p, 2)  # torchrun exits 1; each failed worker in its report, 2
    assert not (tmp_path / "out").exists()


# ---- threads: without OMP_NUM_THREADS, the cores of the affinity mask shared among this machine's processes
CPUS = sorted(os.sched_getaffinity(0))
TWO_CPUS = pytest.mark.skipif(len(CPUS) < 2, reason=f"needs 2 CPUs in this process's affinity mask, has {len(CPUS)}")


@pytest.mark.parametrize("script,nprocs,cpus,threads", [
    # torch's own default would be 2 (the cores of the mask) in each: set_threads_and_math makes it 2 // 2
    pytest.param("ddp_spawn_train.py", 2, 2, 1, marks=[TWO_CPUS, pytest.mark.full], id="spawn-2-processes-2-cpus"),
    pytest.param("ddp_launch_train.py", None, 2, 2, marks=TWO_CPUS, id="one-process-2-cpus"),
    pytest.param("ddp_launch_train.py", None, 1, 1, id="one-process-1-cpu"),
])
def test_default_threads_share_the_affinity_mask(tmp_path, script, nprocs, cpus, threads):
    """Observed in each training process (SEE's record at its first training forward), not computed here."""
    env, see_dir = see_env(tmp_path)
    env = clean_env(**env, OMP_NUM_THREADS=None)  # the case under test: nobody chose
    mask = ",".join(map(str, CPUS[:cpus]))
    cmd = [shutil.which("taskset"), "-c", mask, sys.executable, script, "--train-size", "64", "--val-size", "20",
           "--batch-size", "8", "--max-steps", "2", "--out-dir", str(tmp_path / "out")]
    cmd += ["--nprocs", str(nprocs)] if nprocs else []
    p = Proc(cmd, tmp_path / "logs", env=env)
    out, err = finish(p, TIMEOUT)
    assert p.returncode == 0, out[-2000:] + err[-4000:]
    processes = seen(see_dir)
    assert len(processes) == (nprocs or 1), processes
    assert [(s["cpus"], s["threads"]) for s in processes] == [(cpus, threads)] * len(processes), processes


# ---- SIGQUIT (Ctrl-\; torchrun passes it on): "quit at once" is its default action, which the scripts leave alone
@pytest.mark.workers
@pytest.mark.full
def test_sigquit_quits_at_once_and_leaves_what_docs_failures_md_says(images, short_tmp, tmp_path):
    """SIGQUIT to torchrun while its 2 workers, each with 2 DataLoader workers reading files, wait at step 6: every
    process ends within seconds, the last checkpoint (step 4's) is whole, and what stays is what docs/failures.md
    says: in TMPDIR, each trainer's multiprocessing folder (pymp-*) and, where train_extras/workers.py started a
    fork server, its workers-* folder; no semaphore (the resource tracker, in a session of its own, unlinks them,
    and warns of each)."""
    hooks = Hooks(tmp_path, pause_at=6)
    out = tmp_path / "out"
    proc = Proc(torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, "ddp_launch_train.py") + [
        "--dataset", "imagefolder", "--data-dir", images, "--image-size", 16, "--workers", 2, "--batch-size", 8,
        "--save-every", 4, "--epochs", 2, "--out-dir", out], tmp_path / "log",
        env={**hooks.env, "TMPDIR": str(short_tmp)}, merge=True)
    try:
        proc.until(lambda: sorted(hooks.paused()) == [0, 1], "both ranks waiting at step 6")
        job = [proc.pid, *descendants(proc.pid)]
        os.kill(proc.pid, signal.SIGQUIT)
        proc.wait(expect=None, timeout=60)
        deadline = time.monotonic() + 15
        while [pid for pid in job if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in job if alive(pid)] == [], job
    finally:
        proc.kill()
    ckpt = checkpoint(str(out))
    assert ckpt["epoch"] * 9 + ckpt["step_in_epoch"] == 4 and not [n for n in os.listdir(out) if ".tmp" in n]
    left = sorted(re.sub(r"-\w+$", "-*", n) for n in os.listdir(short_tmp)
                  if not n.startswith(("torchinductor_", "torchelastic_")))
    assert left in (["pymp-*", "pymp-*"], ["pymp-*", "pymp-*", "workers-*", "workers-*"]), left
    semaphores = "sem." + SETTINGS["semaphores"].lstrip("/")
    deadline = time.monotonic() + 15
    while [n for n in os.listdir("/dev/shm") if n.startswith(semaphores)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [n for n in os.listdir("/dev/shm") if n.startswith(semaphores)] == []
    assert "leaked semaphore objects" in proc.output(), proc.output()[-3000:]
