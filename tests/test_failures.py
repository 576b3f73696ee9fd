"""Failure: bad input gets one line (printed once) and exit status 2, overwriting nothing; sharded checkpoints
(fsdp_train.py's) refused by the other scripts in one line naming the conversion, which works both ways; a NaN loss
stops every rank at the same step, status 1; a crashed mp.spawn child ends the others.
Statuses are asserted with conftest.assert_exit: the process's own under python and mp.spawn, every worker's in
torchrun's report under torchrun (docs/failures.md, "Exit codes")."""
import importlib.util
import os
import shutil
import signal
import sys
import time
import warnings
import zipfile

import pytest
import torch

import failsafe
from conftest import assert_exit, checkpoint, max_diff, metrics
from hooks import Hooks
from processes import Proc, alive, command, descendants, run
from train_extras import models
from train_extras.sharded import to_file, to_folder

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """An earlier run's output, which no failing run may touch; and files to feed bad input with."""
    d = tmp_path_factory.mktemp("fail")
    run("ddp_launch_train.py", *TINY, "--out-dir", d / "out")
    (d / "truncated.pt").write_bytes((d / "out" / "last.pt").read_bytes()[:5000])
    (d / "notackpt.pt").write_text("hello")
    damaged = bytearray((d / "out" / "last.pt").read_bytes())  # 4 KiB overwritten mid-file, in a tensor's bytes
    damaged[len(damaged) // 2:len(damaged) // 2 + 4096] = b"\x7f" * 4096
    (d / "damaged.pt").write_bytes(damaged)
    torch.save({"model": {"weight": torch.zeros(3)}}, d / "other_arch.pt")
    (d / "empty").mkdir()
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        to_folder(str(d / "out" / "last.pt"), str(d / "ckpt-8"))  # fsdp_train.py's format
    from PIL import Image
    for split, classes in (("train", ["a", "b"]), ("val", ["a", "c"])):
        for c in classes:
            (d / "mismatch" / split / c).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(d / "mismatch" / split / c / "0.png")
    return d


BAD = {  # name: (arguments, words the one error line must contain)
    "imagefolder_missing": (["--dataset", "imagefolder", "--data-dir", "{d}/nowhere"], "imagefolder"),
    "imagefolder_empty": (["--dataset", "imagefolder", "--data-dir", "{d}/empty"], "imagefolder"),
    "imagefolder_classes": (["--dataset", "imagefolder", "--data-dir", "{d}/mismatch", "--train-size", 2,
                             "--val-size", 2], "different classes"),  # (2 images in each split)
    "unknown_model": (["--model", "resnet9000"], "unknown --model"),
    "unknown_dataset": (["--dataset", "imagenet22k"], "argument --dataset: invalid choice"),
    "truncated_resume": (["--resume", "{d}/truncated.pt"], "not a readable checkpoint"),
    "not_a_checkpoint": (["--resume", "{d}/notackpt.pt"], "not a readable checkpoint"),
    "other_architecture": (["--resume", "{d}/other_arch.pt"], "other_arch.pt is not a training state of this model"),
    "other_architecture_weights": (["--weights", "{d}/other_arch.pt"], "holds no tensor of this --model's names"),
    # no network (a proxy that refuses): one line naming the file and the folder to put it in
    "pretrained_offline": (["--model", "resnet18", "--pretrained"], "resnet18-f37072fd.pth (from https://download."
                           "pytorch.org/models/resnet18-f37072fd.pth) in {d}/torch_home/hub/checkpoints"),
    # its bytes changed after its save (a bad copy, a disk): the CRCs torch wrote, checked wherever it is read
    "damaged_resume": (["--resume", "{d}/damaged.pt"], "damaged.pt is damaged (its record archive/data/"),
    "damaged_weights": (["--weights", "{d}/damaged.pt"], "damaged.pt is damaged (its record archive/data/"),
    "missing_resume": (["--resume", "{d}/nope.pt"], "nope.pt is not a readable checkpoint "
                       "(FileNotFoundError): missing"),
    # DCP is fsdp_train.py's: its checkpoints, and its flags, are one line here
    "sharded_resume": (["--resume", "{d}/ckpt-8"], "{d}/ckpt-8 is a sharded checkpoint: make it one file with "
                       "python -m train_extras.sharded {d}/ckpt-8 last.pt"),
    "ckpt_format_dcp": (["--ckpt-format", "dcp"], "unrecognized arguments: --ckpt-format dcp"),
    "async_save": (["--async-save"], "unrecognized arguments: --async-save"),
    "batch_size_0": (["--batch-size", 0], "argument --batch-size"),
    "epochs_0": (["--epochs", 0], "argument --epochs"),
    "negative_lr": (["--lr", -1], "argument --lr"),
    "out_dir_a_file": (["--out-dir", "{d}/notackpt.pt"], "--out-dir {d}/notackpt.pt: "),
    "sync_bn_cpu": (["--sync-bn"], "--sync-bn"),
    "tensorboard_missing": (["--tensorboard"], "pip install tensorboard"),
}
# also checked with 2 ranks (started by hand: each one's status is its own)
TWO_PROCESSES = {"imagefolder_missing", "truncated_resume", "other_architecture", "pretrained_offline", "batch_size_0",
                 "sharded_resume", "damaged_resume"}


def one_error_line(p, code=2, nproc=None):
    """The one `error:` line of a run that ended with the documented status `code` (2: bad input; under torchrun,
    every failed worker's status, all `nproc` of them if given)."""
    assert_exit(p, code, nproc)
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
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
    launch = dict(launcher="ranks", nproc=2) if name in TWO_PROCESSES else {}
    offline = {"TORCH_HOME": str(previous_run / "torch_home"), "https_proxy": "http://127.0.0.1:9"}
    # into the previous run's --out-dir, with --overwrite (else that run would be the one line): the bad input is
    # found before that run's files are replaced
    p = run("ddp_launch_train.py", *TINY, "--out-dir", out, "--overwrite", *args, check=False, env=offline, **launch)
    assert words.format(d=previous_run) in one_error_line(p, 2)  # from both ranks
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before  # nothing overwritten, nothing added


@pytest.mark.floor
@pytest.mark.parametrize("script", ["dp_train.py", "ddp_spawn_train.py", "ddp_amp_train.py"])
def test_bad_input_other_scripts(tmp_path, script):
    assert "--batch-size" in one_error_line(run(script, "--batch-size", 0, "--out-dir", tmp_path, check=False))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("script", ["dp_train.py"])  # the DDP scripts share ddp_launch_train.py's (test_bad_input)
def test_the_other_scripts_refuse_sharded_checkpoints_in_one_line_naming_the_conversion(previous_run, script,
                                                                                        tmp_path):
    p = run(script, *TINY, "--ckpt-format", "dcp", "--out-dir", tmp_path / "a", check=False)
    assert "unrecognized arguments: --ckpt-format dcp" in one_error_line(p)
    sharded = previous_run / "ckpt-8"
    p = run(script, *TINY, "--resume", sharded, "--out-dir", tmp_path / "b", check=False)
    assert f"python -m train_extras.sharded {sharded} last.pt" in one_error_line(p)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing made, nothing written


def test_sharded_checkpoint_converts_to_one_file_and_back(previous_run, tmp_path):
    """last.pt -> ckpt folder -> last.pt, in this one process (python -m train_extras.sharded): the same keys and
    tensors, and the file loads with weights_only=True into a plain model."""
    original = checkpoint(str(previous_run / "out"))
    assert sorted(os.listdir(previous_run / "ckpt-8")) == [".metadata", "__0_0.distcp"]
    run("-m", "train_extras.sharded", previous_run / "ckpt-8", tmp_path / "back.pt")
    back = checkpoint(str(tmp_path / "back.pt"))
    assert back.keys() == original.keys()
    assert max_diff(back["model"], original["model"]) == 0
    assert back["optimizer"]["param_groups"] == original["optimizer"]["param_groups"]
    for name, state in original["optimizer"]["state"].items():
        assert max_diff(back["optimizer"]["state"][name], state) == 0
    assert back["rng"][0]["cpu"].equal(original["rng"][0]["cpu"]) and back["scheduler"] == original["scheduler"]
    models.make("cnn", 1, 10).load_state_dict(back["model"])
    with pytest.raises(failsafe.UsageError, match="empty is not a complete sharded checkpoint"):
        to_file(str(previous_run / "empty"), str(tmp_path / "none.pt"))


def test_dp_gpus_naming_a_gpu_that_is_not_visible_is_one_line(tmp_path):
    p = run("dp_train.py", "--gpus", 1, "--out-dir", tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}, check=False)
    assert "--gpus 1: " in one_error_line(p) and "(CUDA_VISIBLE_DEVICES=0)" in one_error_line(p)
    assert not os.listdir(tmp_path)


NAN = ["--train-size", 384, "--val-size", 50, "--batch-size", 12, "--lr", 1e6, "--log-every", 5, "--save-every", 2]


@pytest.mark.full
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.floor), "spawn"])
def test_nan_stops_every_rank(tmp_path, launcher):
    t = time.time()
    if launcher == "torchrun":
        p = run("ddp_launch_train.py", *NAN, "--out-dir", tmp_path, launcher="torchrun", nproc=2, check=False)
    else:
        p = run("ddp_spawn_train.py", *NAN, "--nprocs", 2, "--out-dir", tmp_path, check=False)
    assert time.time() - t < 60  # promptly, no hang
    line = one_error_line(p, 1, nproc=2 if launcher == "torchrun" else None)  # spawn: the parent's own status
    assert "NaN/inf at step" in line
    first_bad = int(line.split("at step ")[1].split(":")[0])
    ckpt = checkpoint(str(tmp_path))  # the last good checkpoint, untouched: written before the first bad step
    assert ckpt["step_in_epoch"] < first_bad
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(tmp_path / "metrics.jsonl") or metrics(str(tmp_path)) == []


@pytest.mark.parametrize("launcher", ["python", "ranks"])
def test_a_save_that_fails_is_one_line_and_leaves_the_previous_checkpoint(tmp_path, launcher):
    """The second checkpoint's write fails as on a full disk (tests/hooks.py: TEST_FAIL_SAVE): one line naming the
    file and the cause, every rank exits 2 (none waits for rank 0), last.pt and metrics.jsonl are the first epoch's
    (no row for the epoch whose save failed), no temporary file."""
    hooks, nproc = Hooks(tmp_path, fail_save=2), 2 if launcher == "ranks" else None
    p = run("ddp_launch_train.py", *TINY[:-1], 2, "--batch-size", 6 if nproc else 12, "--out-dir", tmp_path / "out",
            launcher=launcher, nproc=nproc, env=hooks.env, check=False)
    line = one_error_line(p, 2)
    assert line.startswith(f"error: could not save {tmp_path / 'out' / 'last.pt'}: ") and \
        line.endswith(". The previous checkpoint is whole"), line
    assert checkpoint(str(tmp_path / "out"))["epoch"] == 1 and [r["epoch"] for r in metrics(str(tmp_path / "out"))] \
        == [1]
    assert sorted(os.listdir(tmp_path / "out")) == ["last.pt", "metrics.jsonl"]


@pytest.mark.full
def test_spawn_child_crash_ends_the_others(tmp_path):
    args = ["--train-size", 20000, "--val-size", 20, "--batch-size", 8, "--save-every", 5, "--out-dir", tmp_path]
    p = Proc([sys.executable, "ddp_spawn_train.py", "--nprocs", 2, *args], tmp_path / "log")
    try:
        p.until(lambda: (tmp_path / "last.pt").exists(), "the first checkpoint")
        workers = [w for w in descendants(p.pid) if "spawn_main" in open(f"/proc/{w}/cmdline").read()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # e.g. the OOM killer
        p.wait(expect=None, timeout=60)
        err = p.stderr
    finally:
        p.kill()
    # no documented status for a killed child: the parent exits 1 (ddp_spawn_train.py: a child's positive status is
    # passed on, a signal's negative one becomes 1)
    assert p.returncode == 1, (p.returncode, err)
    assert "error: process 1 terminated with signal SIGKILL" in err, err  # the parent says what happened to the child
    time.sleep(1)
    assert not [w for w in workers if alive(w)]


def test_a_damaged_checkpoint_is_refused_by_the_conversion_and_one_saved_without_crcs_is_not(previous_run, tmp_path):
    """The conversion to a sharded folder refuses the damaged last.pt in one line; a last.pt that torch wrote without
    CRCs (torch.serialization.set_crc32_options(False)) resumes as any other."""
    p = command([sys.executable, "-m", "train_extras.sharded", previous_run / "damaged.pt", tmp_path / "folder"])
    assert p.returncode == 1 and p.stderr.startswith(f"error: {previous_run / 'damaged.pt'} is damaged (its record "
                                                     "archive/data/"), p.stderr
    assert not (tmp_path / "folder").exists()
    out = tmp_path / "out"
    shutil.copytree(previous_run / "out", out)
    ckpt = checkpoint(str(out))
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(ckpt, out / "last.pt")
    finally:
        torch.serialization.set_crc32_options(True)
    assert {i.CRC for i in zipfile.ZipFile(out / "last.pt").infolist()} == {0}
    p = run("ddp_launch_train.py", *TINY, "--epochs", 2, "--resume", "auto", "--out-dir", out)
    assert "resuming at step 8" in p.stdout


@pytest.mark.full
def test_a_damaged_sharded_checkpoint_is_refused_wherever_it_is_read_and_one_saved_without_checksums_is_not(tmp_path):
    """fsdp_train.py's ckpt-4 with a shard's bytes overwritten: --resume auto (2 ranks, each checking its share of the
    files) and the conversion to one file each refuse it in one line naming the file; the same folder without its
    checksums.json (as saved before they were written) resumes unchecked."""
    out = tmp_path / "run"
    dcp = [*TINY, "--ckpt-format", "dcp", "--out-dir", out]
    run("fsdp_train.py", *dcp, "--max-steps", 4, launcher="torchrun", nproc=2)
    folder = out / "ckpt-4"
    whole = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    assert sorted(whole) == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json"]
    damaged = bytearray(whole["__1_0.distcp"])
    damaged[len(damaged) // 2:len(damaged) // 2 + 4096] = b"\x7f" * 4096
    (folder / "__1_0.distcp").write_bytes(damaged)
    p = run("fsdp_train.py", *dcp, "--resume", "auto", launcher="torchrun", nproc=2, check=False)
    line = one_error_line(p, 2, nproc=2)
    assert line == (f"error: {folder} is damaged: __1_0.distcp no longer matches the checksum saved with it (its "
                    "bytes changed after the save: a bad copy, a disk, a network filesystem); give another "
                    "checkpoint"), line
    p = command([sys.executable, "-m", "train_extras.sharded", folder, tmp_path / "last.pt"])
    assert p.returncode == 1 and f"{folder} is damaged: __1_0.distcp" in p.stderr, p.stderr
    (folder / "__1_0.distcp").write_bytes(whole["__1_0.distcp"])
    os.remove(folder / "checksums.json")
    p = run("fsdp_train.py", *dcp, "--epochs", 2, "--resume", "auto", launcher="torchrun", nproc=2)
    assert "resuming at step 4" in p.stdout
