"""The launchers beyond torchrun and python: srun (SLURM), mpirun (Open MPI), mpiexec (MPICH, Intel
MPI), a Kubernetes PyTorchJob (env:// without LOCAL_RANK: one process per machine) and the
deprecated `python -m torch.distributed.launch` (its --local-rank flag). common.launcher_env asks
this file first, where it is copied; without it, a run that one of these started stops at once with
one line naming this file."""
import argparse
import re
import sys

import failsafe

MPI = {  # how an MPI launcher names (rank, world size, local rank, local size)
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    "mpiexec": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}  # MPICH, Intel MPI
# every variable of theirs that names a process: a one-process script names those it finds
VARIABLES = [n for names in MPI.values() for n in names] + ["SLURM_PROCID", "SLURM_LOCALID"]
LOCAL_RANKS = [names[2] for names in MPI.values()] + ["SLURM_LOCALID"]


def add_flags(parser):
    # the deprecated launcher (without --use-env) adds --local-rank=N (--local_rank=N before torch
    # 2.0) before the script's own arguments: accepted, not listed, and ignored; the rank comes
    # from LOCAL_RANK, which it also sets
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)


def launcher_env(env):
    """(rank, world size, local rank, local size, launcher) where one of these launchers started
    this process, else None (torchrun's, or no launcher's: common.launcher_env's)."""
    if "RANK" in env and "WORLD_SIZE" in env:  # env://: torchrun, a Kubernetes pod, the old one
        if "LOCAL_RANK" not in env:
            launcher = "env:// (no LOCAL_RANK: one process per machine)"
        elif any(a.startswith("--local") for a in sys.argv):
            launcher = "python -m torch.distributed.launch"
        else:
            return None
        return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                int(env.get("LOCAL_WORLD_SIZE", 1)), launcher)
    for launcher, (rank, size, local_rank, local_size) in MPI.items():  # the first that is set
        if rank in env or size in env:
            if not (rank in env and size in env):
                raise failsafe.UsageError(f"{rank} and {size} go together: set both")
            return (int(env[rank]), int(env[size]), int(env.get(local_rank, 0)),
                    int(env.get(local_size, 1)), launcher)
    if "SLURM_STEP_NUM_TASKS" in env:  # (not in sbatch's own script)
        return srun_env(env)
    return None


def srun_env(env):
    """An srun task's (rank, ...); rank 0 is met on the step's first node, on a port of the
    job's."""
    counts = re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_STEP_TASKS_PER_NODE"])  # "8(x2),4"
    per_node = [int(n) for count, times in counts for n in [count] * int(times or 1)]
    first_node = re.match(r"[^,\[]+(\[[^,\-\]]+)?", env["SLURM_STEP_NODELIST"]).group(0)
    env.setdefault("MASTER_ADDR", first_node.replace("[", ""))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))  # one per job
    return (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"]),
            per_node[int(env["SLURM_NODEID"])], "srun")
