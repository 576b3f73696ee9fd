"""What a new user meets: flags checked in one pure validate(), subsets that keep every class, resumes that refuse
what they cannot continue, files named in one line, the wrong launcher refused (signals: test_signals.py),
an output folder no run takes from another, and logs that read well in a file."""
import argparse
import os
import subprocess
import sys
import types

import pytest
import torch

import common
from conftest import ROOT, assert_exit, checkpoint, clean_env, metrics, run, worker_exit_codes

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]
SCRIPTS = ["dp_train.py", "ddp_launch_train.py", "ddp_spawn_train.py", "ddp_amp_train.py", "fsdp_train.py"]


def defaults(**change):
    args = common.get_parser("").parse_args([])
    return argparse.Namespace(**{**vars(args), "nprocs": None, **change})


@pytest.mark.parametrize("change, words", [
    (dict(warmup_epochs=float("nan")), "--warmup-epochs must be a finite number"),
    (dict(lr=float("inf")), "--lr must be a finite number"),
    (dict(lr=-1.0), "--lr must be a finite number at least 0"),
    (dict(momentum=-1.0), "--momentum must be a finite number at least 0 and below 1"),
    (dict(momentum=5.0), "--momentum"),
    (dict(weight_decay=-1.0), "--weight-decay"),
    (dict(seed=99999999999999999999), "--seed must be in 0 .. 4294967295"),
    (dict(seed=-1), "--seed"),
    (dict(workers=-1), "--workers"),
    (dict(image_size=3), "--image-size must be at least 7"),
    (dict(nprocs=0), "--nprocs must be at least 1"),
    (dict(batch_size=0), "--batch-size must be at least 1"),
    (dict(max_steps=0), "--max-steps"),
    (dict(synthetic_shape="3x4"), "--synthetic-shape"),
    (dict(model="resnet9000"), "unknown --model"),
    (dict(overwrite=True, resume="auto"), "choose one"),
])
def test_validate_refuses_bad_flags(change, words):
    with pytest.raises(common.UsageError, match=words.replace("(", r"\(")):
        common.validate(defaults(**change))


def test_validate_accepts_the_defaults_and_help_shows_them():
    common.validate(defaults())
    text = common.get_parser("").format_help()
    assert "(default: 64)" in text and "(default: synthetic)" in text
    with pytest.raises(SystemExit):
        common.get_parser("").parse_args(["--dataset", "imagenet22k"])  # a choice, not free text


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_validates_before_it_builds(script, tmp_path):
    p = run(script, "--momentum", "5", "--out-dir", tmp_path / "out", check=False)
    assert_exit(p, 2)  # bad input
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr  # one line
    assert p.stderr.startswith("error: --momentum") and not (tmp_path / "out").exists()


def write_images(root, counts, size=8):
    from PIL import Image
    for split, per_class in counts.items():
        for c, n in per_class.items():
            os.makedirs(root / split / c, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (size, size), (40 * i % 255, 0, 0)).save(root / split / c / f"{i}.png")


def test_imagefolder_subsets_keep_every_class_in_proportion(tmp_path):
    write_images(tmp_path, {"train": {"a": 30, "b": 10}, "val": {"a": 6, "b": 6}})
    args = defaults(dataset="imagefolder", data_dir=str(tmp_path), train_size=8, val_size=4, image_size=8)
    train, val = common.load_data(args)
    labels = lambda ds: sorted(label for _, label in ds.folder.samples)
    assert labels(train) == [0] * 6 + [1] * 2 and labels(val) == [0, 0, 1, 1]
    again, _ = common.load_data(args)
    assert again.folder.samples == train.folder.samples  # seeded: the same on every rank and every run
    other, _ = common.load_data(defaults(**{**vars(args), "seed": 1}))
    assert other.folder.samples != train.folder.samples
    with pytest.raises(common.UsageError, match="--val-size 1 leaves a class without any val sample"):
        common.load_data(defaults(**{**vars(args), "val_size": 1}))


def test_imagefolder_at_the_default_size_suggests_image_size(tmp_path, capsys):
    write_images(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path)), download=True)  # rank 0's call
    assert "--image-size" in capsys.readouterr().out
    common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path)))  # the other ranks say nothing
    assert capsys.readouterr().out == ""


def test_classes_come_from_the_whole_dataset():
    train, _ = common.load_data(defaults(train_size=4, val_size=20, seed=4))
    assert common.channels_and_classes(train) == (1, 10)  # not the few labels of 4 samples


def test_one_class_is_refused(tmp_path):
    write_images(tmp_path, {"train": {"a": 4}, "val": {"a": 2}})
    train, _ = common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path), image_size=8))
    with pytest.raises(common.UsageError, match="at least 2"):
        common.channels_and_classes(train)


def test_checkpoint_files_get_one_line_that_says_what_to_do(tmp_path):
    empty = tmp_path / "last.pt"
    empty.write_bytes(b"")
    with pytest.raises(common.UsageError, match="last.pt is not a readable checkpoint .*truncated or empty"):
        common.read_checkpoint(str(empty))
    torch.save(common.make_model("cnn", 1, 10), tmp_path / "whole.pt")  # a pickled model, not a state_dict
    with pytest.raises(common.UsageError, match=r"whole.pt holds Python objects.*state_dict\(\) instead$"):
        common.read_checkpoint(str(tmp_path / "whole.pt"))
    torch.save({"state_dict": common.make_model("cnn", 1, 10).state_dict()}, tmp_path / "lightning.pt")
    args = types.SimpleNamespace(weights=str(tmp_path / "lightning.pt"), model="cnn", freeze_backbone=False)
    assert len(common.load_weights(common.make_model("cnn", 1, 10), args, 1, 10)) == 8  # timm/Lightning layout
    ten = {"model": common.make_model("cnn", 1, 10).state_dict(), "optimizer": {}, "args": {}, "global_batch": 64}
    torch.save(ten, tmp_path / "ten.pt")
    with pytest.raises(common.UsageError, match=r"fc2.weight is \(10, 128\) there, \(3, 128\) here"):
        common.find_checkpoint(str(tmp_path / "ten.pt"), "", common.make_model("cnn", 1, 3), False, 64)
    with pytest.raises(common.UsageError, match="global batch of 64, this run's is 32"):
        common.find_checkpoint(str(tmp_path / "ten.pt"), "", common.make_model("cnn", 1, 10), False, 32)


def test_a_checkpoint_keeps_its_position_in_samples_and_old_ones_still_load():
    progress = common.Progress(10, 32, None, torch.device("cpu"), {"epoch": 1, "step_in_epoch": 3, "loss_sum": 6.0})
    assert (progress.step, progress.step_in_epoch) == (13, 3)  # format 1: steps only
    state = progress.state(6.0)
    assert state["format"] == 2 and state["samples_in_epoch"] == 96 and state["global_batch"] == 32
    assert common.Progress(10, 32, None, torch.device("cpu"), state).step == 13


@pytest.mark.slow
def test_resume_refuses_another_global_batch_and_max_steps_is_a_budget(tmp_path):
    out = tmp_path / "out"
    p = run("ddp_launch_train.py", *TINY, "--save-every", 2, "--max-steps", 3, "--out-dir", out)
    assert "epoch 1 (stopped at step 3 of 8)  train_loss" in p.stdout, p.stdout
    before = (out / "last.pt").read_bytes()
    p = run("ddp_launch_train.py", *TINY, "--max-steps", 3, "--resume", "auto", "--out-dir", out)
    assert "already at step 3 of --max-steps 3: nothing to train" in p.stdout and "epoch 1" not in p.stdout
    p = run("ddp_launch_train.py", *TINY[:4], "--batch-size", 6, "--epochs", 1, "--resume", "auto", "--out-dir", out,
            check=False)
    assert_exit(p, 2)
    assert "global batch of 12, this run's is 6" in p.stderr, p.stderr
    p = run("ddp_launch_train.py", *TINY, "--out-dir", out, check=False)  # a fresh run: it would replace last.pt
    assert_exit(p, 2)
    assert "--resume auto continues it, --overwrite starts afresh" in p.stderr, p.stderr
    assert (out / "last.pt").read_bytes() == before and [r["step"] for r in metrics(str(out))] == [3]
    run("ddp_launch_train.py", *TINY, "--overwrite", "--out-dir", out)
    assert checkpoint(str(out))["epoch"] == 1


def test_an_out_dir_in_use_or_a_file_is_refused(tmp_path):
    hold = ("import common, sys, time, types; common.claim_out_dir(sys.argv[1], types.SimpleNamespace(resume=None, "
            "overwrite=False)); print(1, flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "busy")], cwd=ROOT, env=clean_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        with pytest.raises(common.UsageError, match="in use by another run"):
            common.claim_out_dir(str(tmp_path / "busy"), defaults())
    finally:
        holder.kill()
        holder.wait()
    common.claim_out_dir(str(tmp_path / "busy"), defaults())  # its holder is gone (killed): free again
    (tmp_path / "file").write_text("")
    with pytest.raises(common.UsageError, match="--out-dir .*file: File exists: give a folder"):
        common.claim_out_dir(str(tmp_path / "file"), defaults())


@pytest.mark.parametrize("script", ["dp_train.py", "ddp_spawn_train.py"])
def test_the_one_process_scripts_refuse_torchrun(script, tmp_path):
    p = run(script, *TINY, "--out-dir", tmp_path, launcher="torchrun", nproc=2, check=False)
    assert_exit(p, 2, nproc=2)  # torchrun exits 1; both of its workers 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not torchrun" in errors[0], p.stderr
    assert not os.listdir(tmp_path)


def test_spawn_usage_errors_exit_2(tmp_path):
    p = run("ddp_spawn_train.py", "--batch-size", 0, "--out-dir", tmp_path, check=False)
    assert_exit(p, 2)
    assert p.stderr.strip() == "error: --batch-size must be at least 1, got 0", p.stderr


@pytest.mark.slow
def test_a_corrupt_image_is_named_by_the_rank_that_reads_it(tmp_path):
    write_images(tmp_path, {"train": {"a": 12, "b": 12}, "val": {"a": 3, "b": 3}})
    bad = tmp_path / "train" / "b" / "7.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    p = run("ddp_launch_train.py", "--dataset", "imagefolder", "--data-dir", tmp_path, "--image-size", 8,
            "--batch-size", 4, "--epochs", 1, "--workers", 1, "--out-dir", tmp_path / "out", launcher="torchrun",
            nproc=2, check=False, timeout=120)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0], p.stderr
    assert "remove or replace it" in errors[0]
    # bad input: the rank that read the file exits 2, torchrun's root cause; the other then loses its peer (or is
    # stopped by torchrun), whatever status that gives it
    root_cause = worker_exit_codes(p.stderr.split("Root Cause")[-1])
    assert p.returncode == 1 and list(root_cause.values()) == [2], (root_cause, p.stderr)
