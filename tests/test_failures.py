"""Failure: bad input gets one line (printed once) and a non-zero exit, overwriting nothing; a NaN loss stops every
rank at the same step; SIGTERM ends every process cleanly; a crashed mp.spawn child ends the others."""
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, checkpoint, clean_env, descendants, free_port, kill_tree, metrics, run

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """An earlier run's output, which no failing run may touch; and files to feed bad input with."""
    d = tmp_path_factory.mktemp("fail")
    run("ddp_launch_train.py", *TINY, "--out-dir", d / "out")
    (d / "truncated.pt").write_bytes((d / "out" / "last.pt").read_bytes()[:5000])
    (d / "notackpt.pt").write_text("hello")
    torch.save({"model": {"weight": torch.zeros(3)}}, d / "other_arch.pt")
    (d / "empty").mkdir()
    from PIL import Image
    for split, classes in (("train", ["a", "b"]), ("val", ["a", "c"])):
        for c in classes:
            (d / "mismatch" / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(d / "mismatch" / split / c / "0.png")
    return d


BAD = {  # name: (arguments, words the one error line must contain)
    "imagefolder_missing": (["--dataset", "imagefolder", "--data-dir", "{d}/nowhere"], "imagefolder"),
    "imagefolder_empty": (["--dataset", "imagefolder", "--data-dir", "{d}/empty"], "imagefolder"),
    "imagefolder_classes": (["--dataset", "imagefolder", "--data-dir", "{d}/mismatch"], "different classes"),
    "unknown_model": (["--model", "resnet9000"], "unknown --model"),
    "unknown_dataset": (["--dataset", "imagenet22k"], "--dataset: invalid choice"),
    "truncated_resume": (["--resume", "{d}/truncated.pt"], "not a readable checkpoint"),
    "not_a_checkpoint": (["--resume", "{d}/notackpt.pt"], "not a readable checkpoint"),
    "other_architecture": (["--resume", "{d}/other_arch.pt"], "does not hold this model"),
    "other_architecture_weights": (["--weights", "{d}/other_arch.pt"], "holds no tensor of this --model's names"),
    # no network (a proxy that refuses): one line naming the file and the folder to put it in
    "pretrained_offline": (["--model", "resnet18", "--pretrained"], "resnet18-f37072fd.pth (from https://download."
                           "pytorch.org/models/resnet18-f37072fd.pth) in {d}/torch_home/hub/checkpoints"),
    "missing_resume": (["--resume", "{d}/nope.pt"], "no such checkpoint"),
    "device_cuda": (["--device", "cuda"], "no CUDA"),
    "backend_nccl": (["--backend", "nccl"], "nccl"),
    "batch_size_0": (["--batch-size", 0], "--batch-size"),
    "epochs_0": (["--epochs", 0], "--epochs"),
    "negative_lr": (["--lr", -1], "--lr"),
    "sync_bn_cpu": (["--sync-bn"], "--sync-bn"),
    "tensorboard_missing": (["--tensorboard"], "pip install tensorboard"),
}
# also checked under torchrun -n 2
TWO_PROCESSES = {"imagefolder_missing", "truncated_resume", "other_architecture", "pretrained_offline"}


def one_error_line(p):
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0, p.stderr
    assert len(lines) == 1, p.stderr  # once, not once per rank
    assert "[rank" not in p.stderr  # no worker traceback (torchrun adds a failure report of its own)
    if "torch.distributed.run" not in p.args:
        assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")
@pytest.mark.parametrize("name", BAD)
def test_bad_input(previous_run, name):
    if name == "tensorboard_missing" and importlib.util.find_spec("tensorboard"):
        pytest.skip("tensorboard is installed here")
    args, words = BAD[name]
    args = [str(a).format(d=previous_run) for a in args]
    out = previous_run / "out"
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    launch = dict(launcher="torchrun", nproc=2) if name in TWO_PROCESSES else {}
    offline = {"TORCH_HOME": str(previous_run / "torch_home"), "https_proxy": "http://127.0.0.1:9"}
    p = run("ddp_launch_train.py", *TINY, *args, "--out-dir", out, check=False, env=offline, **launch)
    assert words.format(d=previous_run) in one_error_line(p)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # nothing overwritten, nothing added


@pytest.mark.floor
@pytest.mark.parametrize("script", ["dp_train.py", "ddp_spawn_train.py", "ddp_amp_train.py"])
def test_bad_input_other_scripts(tmp_path, script):
    assert "--batch-size" in one_error_line(run(script, "--batch-size", 0, "--out-dir", tmp_path, check=False))
    assert not os.listdir(tmp_path)


def test_dp_gpus_naming_a_gpu_that_is_not_visible_is_one_line(tmp_path):
    p = run("dp_train.py", "--gpus", 1, "--out-dir", tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}, check=False)
    assert "--gpus 1: " in one_error_line(p) and "(CUDA_VISIBLE_DEVICES=0)" in one_error_line(p)
    assert not os.listdir(tmp_path)


NAN = ["--train-size", 384, "--val-size", 50, "--batch-size", 12, "--lr", 1e6, "--log-every", 5, "--save-every", 2]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.floor), "spawn"])
def test_nan_stops_every_rank(tmp_path, launcher):
    t = time.time()
    if launcher == "torchrun":
        p = run("ddp_launch_train.py", *NAN, "--out-dir", tmp_path, launcher="torchrun", nproc=2, check=False)
    else:
        p = run("ddp_spawn_train.py", *NAN, "--nprocs", 2, "--out-dir", tmp_path, check=False)
    assert time.time() - t < 60  # promptly, no hang
    line = one_error_line(p)
    assert "NaN/inf at step" in line
    first_bad = int(line.split("at step ")[1].split(":")[0])
    ckpt = checkpoint(str(tmp_path))  # the last good checkpoint, untouched: written before the first bad step
    assert ckpt["step_in_epoch"] < first_bad
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(tmp_path / "metrics.jsonl") or metrics(str(tmp_path)) == []


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def launch_long(script_cmd, out):
    args = ["--train-size", 20000, "--val-size", 20, "--batch-size", 8, "--save-every", 5, "--out-dir", out]
    return subprocess.Popen([sys.executable, *script_cmd, *map(str, args)], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(path, p, seconds=120):
    t = time.time()
    while not os.path.exists(path):
        assert p.poll() is None, p.communicate()
        assert time.time() - t < seconds, "timed out"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("launch", [pytest.param("torchrun", marks=pytest.mark.floor), "spawn"])
def test_sigterm_ends_everything_cleanly(tmp_path, launch):
    cmd = (["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "ddp_launch_train.py"]
           if launch == "torchrun" else ["ddp_spawn_train.py", "--nprocs", "2"])
    p = launch_long(cmd, tmp_path)
    try:
        wait_for(tmp_path / "last.pt", p)  # training, with a checkpoint written
        workers = descendants(p.pid)
        assert len(workers) >= 2
        p.send_signal(signal.SIGTERM)  # as SLURM does on preemption
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            kill_tree(p.pid)
    assert p.returncode != 0
    time.sleep(1)
    assert not [w for w in workers if alive(w)], "orphan worker processes"
    assert [f for f in os.listdir(tmp_path) if ".tmp" in f] == []  # no half-written file
    checkpoint(str(tmp_path))  # the last checkpoint is complete


@pytest.mark.slow
def test_spawn_child_crash_ends_the_others(tmp_path):
    p = launch_long(["ddp_spawn_train.py", "--nprocs", "2"], tmp_path)
    try:
        wait_for(tmp_path / "last.pt", p)
        workers = [w for w in descendants(p.pid) if "spawn_main" in open(f"/proc/{w}/cmdline").read()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # e.g. the OOM killer
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            kill_tree(p.pid)
    assert p.returncode != 0
    assert "SIGKILL" in err, err  # the parent says what happened to the child
    time.sleep(1)
    assert not [w for w in workers if alive(w)]
