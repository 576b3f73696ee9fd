"""Every machine and launcher users have, where this machine can show it: the device and backend chosen from torch's
own mapping (every accelerator type, faked: torch.accelerator answers what a CUDA, ROCm, XPU or MPS machine would),
each launcher's environment read (torchrun, a hand launch without LOCAL_RANK, Open MPI, MPICH, srun) and a partial
one refused in one line, a lone process that ignores a MASTER_ADDR left in the shell, the one-process scripts under
a launcher, flags that differ between ranks, and a SIGTERM before the first step. mpirun for real: test_cluster.py."""
import os
import signal
import sys
import time
from types import SimpleNamespace as ns

import pytest
import torch
import torch.nn as nn

import common
import failsafe
from processes import Proc, command, env_ranks, free_port, run

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]


def fake_accelerator(monkeypatch, kind, count=1):
    """This process's torch, as on a machine whose accelerator is `kind` (None: none) with `count` devices."""
    found = torch.device(kind) if kind else None
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: found)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count if kind else 0)


# ---- the device and the backend
@pytest.mark.parametrize("kind, script_kind, device, backend", [
    ("cuda", "ddp", "cuda", "cuda:nccl,cpu:gloo"),  # also ROCm: torch calls its GPUs cuda, its nccl is RCCL
    ("xpu", "ddp", "xpu", "xpu:xccl,cpu:gloo"),  # and gloo beside them, for the object collectives
    ("mps", "ddp", "cpu", "gloo"),  # no backend moves MPS tensors: the CPU
    ("mps", "dp", "mps", None),  # one process, no process group: the Mac's GPU
    (None, "ddp", "cpu", "gloo"),
    (None, "dp", "cpu", None)])
def test_the_default_device_and_backend_are_torchs_for_this_machines_accelerator(monkeypatch, kind, script_kind,
                                                                                 device, backend):
    fake_accelerator(monkeypatch, kind)
    assert common.device_type(None, collectives=script_kind == "ddp") == device
    if backend:
        args = ns(device=device, backend=None)
        assert common.pick_backend(args) == backend
    assert common.pick_backend(ns(device=device, backend="gloo")) == "gloo"


@pytest.mark.parametrize("kind, asked", [(None, "cuda"), ("cuda", "xpu")])
def test_a_device_this_machine_cannot_give_is_one_line(monkeypatch, kind, asked):
    fake_accelerator(monkeypatch, kind)
    with pytest.raises(failsafe.UsageError, match=f"^--device {asked}, but torch finds no {asked} device here$"):
        common.device_type(asked)


def test_dp_with_device_cpu_on_a_gpu_machine_trains_on_the_cpu(monkeypatch):
    """nn.DataParallel given no GPU raises IndexError inside torch on a machine with CUDA: --device cpu (the GPU
    report's CPU reference) must not build one. CUDA faked as DataParallel itself sees it."""
    import dp_train
    data_parallel = sys.modules["torch.nn.parallel.data_parallel"]  # the module (the package exports a function)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(data_parallel, "_get_available_device_type", lambda: "cuda")
    with pytest.raises(IndexError):  # the fake is faithful: what torch does with no device ids there
        nn.DataParallel(nn.Linear(2, 2), [])
    run_ = dp_train.setup_devices(ns(device="cpu", gpus=None, output_device=None, compile=False, deterministic=False))
    assert run_.gpus == [] and run_.device == torch.device("cpu")


def test_dp_compile_on_several_gpus_is_one_line(monkeypatch):
    """Module.compile sets a compiled call on the instance, which DataParallel's replicas copy: each would run the
    first GPU's module. Refused, with what to use instead."""
    import dp_train
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    args = ns(device="cuda", gpus=None, output_device=None, compile=True, deterministic=False)
    with pytest.raises(failsafe.UsageError, match="--compile with DataParallel on several GPUs"):
        dp_train.setup_devices(args)
    assert dp_train.setup_devices(ns(**{**vars(args), "gpus": "1"})).gpus == [1]


# ---- every launcher's environment
LAUNCHES = {
    "torchrun": ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 8, 1, 2)),
    "env:// without LOCAL_RANK": ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2, 0, 1)),  # a Kubernetes PyTorchJob
    "mpirun": ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (5, 8, 1, 4)),
    "mpiexec": ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (2, 4, 0, 2)),
    "srun": ({"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "12", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_STEP_TASKS_PER_NODE": "8,4", "SLURM_STEP_NODELIST": "gpu[3-4]", "SLURM_JOB_ID": "77"},
             (9, 12, 1, 4)),
}


@pytest.fixture
def environ(monkeypatch):
    """Sets this process's launcher variables to the given ones only (os.environ restored after the test)."""
    for k in list(os.environ):
        if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_", "MPI_", "SLURM_", "TORCHELASTIC")):
            monkeypatch.delenv(k)
    return lambda **env: [monkeypatch.setenv(k, v) for k, v in env.items()]


@pytest.mark.parametrize("name", LAUNCHES)
def test_each_launchers_environment_gives_rank_and_world(environ, name):
    env, expected = LAUNCHES[name]
    environ(**env, **({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"} if name != "srun" else {}))
    launcher = "env:// (no LOCAL_RANK: one process per machine)" if name.startswith("env://") else name
    assert common.launcher_env() == (*expected, launcher)
    if name == "srun":  # where rank 0 serves the rendezvous: srun's first node, a port of its job
        assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu3", str(15000 + 77))


@pytest.mark.parametrize("env, says", [
    ({"RANK": "0"}, "RANK and WORLD_SIZE go together: set both"),
    ({"WORLD_SIZE": "2"}, "RANK and WORLD_SIZE go together"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun: 2 processes, but no MASTER_ADDR and "
                                                                 "MASTER_PORT"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"},
     "torchrun: 2 processes, but no MASTER_ADDR and MASTER_PORT")])
def test_a_partial_launch_environment_is_one_line(environ, env, says):
    environ(**env)
    with pytest.raises(failsafe.UsageError, match=says):
        common.launcher_env()


def test_a_lone_process_is_no_launchers(environ):
    environ(MASTER_ADDR="10.0.0.1")  # left in the shell by an earlier job
    assert common.launcher_env() == (0, 1, 0, 1, None)


def test_a_lone_process_ignores_a_master_addr_left_in_the_shell(tmp_path):
    p = run("ddp_launch_train.py", *TINY, "--out-dir", tmp_path / "run", env={"MASTER_ADDR": "10.255.255.1"})
    assert "1 process, backend gloo" in p.stdout and (tmp_path / "run" / "last.pt").exists(), p.stderr[-3000:]


@pytest.mark.parametrize("script", ["dp_train.py", pytest.param("ddp_spawn_train.py", marks=pytest.mark.full)])
def test_a_one_process_script_under_the_old_launcher_says_how_it_is_started(script, tmp_path):
    """`python -m torch.distributed.launch` adds --local-rank=0, which these scripts do not know: the line says how
    they are started instead, even with one process."""
    p = command([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=1",
                 f"--master_port={free_port()}", script, *TINY])
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "start it with python, not python -m torch.distributed.launch (" in errors[0], \
        p.stderr[-3000:]


# ---- one run, one set of flags
def hand_launch(script, per_rank_args, tmp_path):
    """`script` as ranks started by hand (env://), rank r with per_rank_args[r]; retried while the port was taken."""
    for attempt in range(5):
        procs = [Proc([sys.executable, script, *a], tmp_path / f"ranks{attempt}", env=variables, fork=True,
                      name=f"rank{r}")
                 for r, (a, variables) in enumerate(zip(per_rank_args, env_ranks(len(per_rank_args), free_port())))]
        for p in procs:
            p.wait(expect=None, timeout=120)
        results = [(p.returncode, p.stdout, p.stderr) for p in procs]
        if not any("ddress already in use" in err for _, _, err in results) or attempt == 4:
            return results


def test_ranks_started_with_different_flags_stop_in_one_line_naming_the_flag(tmp_path):
    base = [*TINY, "--out-dir", tmp_path / "run"]
    # --workers may differ (a per-machine flag), --lr may not
    (r0, _, err0), (r1, _, err1) = hand_launch("ddp_launch_train.py", [base + ["--lr", "0.1", "--workers", "1"],
                                                                       base + ["--lr", "0.01", "--workers", "3"]],
                                               tmp_path)
    assert (r0, r1) == (2, 2), err0[-3000:] + err1[-3000:]
    assert err0.strip().splitlines()[-1] == "error: the ranks' flags differ: --lr is 0.1 on rank 0, 0.01 on rank 1", \
        err0[-3000:]
    assert "error" not in err1, err1[-3000:]  # printed once
    assert not (tmp_path / "run").exists()  # before anything is written


# ---- a signal before there is anything to save: the default action, at once
def listening(port):
    """Whether some process of this machine listens on TCP `port` (rank 0's store: it waits for its peers there)."""
    lines = [line.split() for table in ("/proc/net/tcp", "/proc/net/tcp6") for line in open(table).readlines()[1:]]
    return any(fields[1].endswith(f":{port:04X}") and fields[3] == "0A" for fields in lines)


def test_sigterm_while_rank_0_waits_for_its_peers_ends_it_at_once(tmp_path):
    """Rank 0 of 2, started alone, waits in the rendezvous for a rank that never comes: a SIGTERM ends it there, at
    once (nothing to save yet), not after the 10 minutes of the start-up timeout."""
    port = free_port()
    p = Proc([sys.executable, "ddp_launch_train.py", *TINY, "--out-dir", tmp_path / "r"], tmp_path / "log",
             env=env_ranks(2, port)[0], fork=True)
    try:
        p.until(lambda: listening(port), "rank 0 serving the rendezvous")
        time.sleep(0.5)
        os.kill(p.pid, signal.SIGTERM)
        p.wait(expect=None, timeout=10)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGTERM, p.returncode
