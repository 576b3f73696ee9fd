"""Helpers for running the scripts as real subprocesses (real torchrun, real mp.spawn) on CPU/gloo."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TIMEOUT = 300  # no test may hang CI: every subprocess is killed after this many seconds


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script, *args, nproc=None, launcher="python", env=None, check=True, timeout=TIMEOUT):
    """Run one of the scripts. launcher: 'python' (plain; ddp_spawn_train.py spawns --nprocs itself) or 'torchrun'.
    Weight comparisons need equal threads per process, so OMP_NUM_THREADS=1 unless `env` says otherwise."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or k not in env:
            full_env.pop(k, None)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc or 1}",
               f"--master_port={free_port()}", script]
    else:
        cmd = [sys.executable, script] + ([f"--nprocs={nproc}"] if nproc else [])
    p = subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd + [str(a) for a in args])} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint(out_dir_or_file):
    path = out_dir_or_file if out_dir_or_file.endswith(".pt") else os.path.join(out_dir_or_file, "last.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


def max_diff(a, b):
    """Max absolute difference between two state dicts (same keys required)."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def summary_lines(output, prefix="epoch "):
    """The per-epoch summary lines (the progress bar is drawn on the same terminal line before them)."""
    return [line[line.index(prefix):] for line in output.replace("\r", "\n").splitlines()
            if prefix in line and "train_loss" in line]


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")
