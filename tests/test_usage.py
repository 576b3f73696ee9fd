"""What a new user meets: flags checked by the parser (argparse types, choices and exclusive groups, and
failsafe.Parser's checks of flags together) in one `error:` line, subsets that keep every class, resumes that refuse
what they cannot continue, files named in one line, the wrong launcher refused (signals: test_signals.py), a fresh
run that never replaces an earlier last.pt, and logs that read well in a file."""
import argparse
import math
import os
import time
from types import SimpleNamespace as ns

import pytest
import torch

import common
import failsafe
from conftest import assert_exit, checkpoint, metrics, worker_exit_codes
from processes import run
from train_extras import finetune, models

TINY = ["--train-size", 96, "--val-size", 20, "--batch-size", 12, "--epochs", 1]
SCRIPTS = ["dp_train.py", "ddp_launch_train.py", "ddp_spawn_train.py", "ddp_amp_train.py", "fsdp_train.py"]


def defaults(**change):
    args = common.get_parser("").parse_args([])
    return argparse.Namespace(**{**vars(args), **change})


def refused(argv):
    """What the parser's refusal of `argv` says: a UsageError (exit status 2), which failsafe.run_and_exit prints
    once."""
    with pytest.raises(failsafe.UsageError) as e:
        common.get_parser("").parse_args(argv)
    assert e.value.code == 2 and len(str(e.value).splitlines()) == 1, e.value
    return str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--warmup-epochs", "nan"], "argument --warmup-epochs: must be at least 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be at least 0, got inf"),
    (["--lr", "-1"], "argument --lr: must be at least 0, got -1"),
    (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
    (["--momentum", "-1"], "argument --momentum: must be at least 0, got -1"),
    (["--weight-decay", "-1"], "argument --weight-decay"),
    (["--seed", "-1"], "argument --seed"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--workers", "-1"], "argument --workers"),
    (["--image-size", "3"], "argument --image-size: must be at least 7, got 3"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["--max-steps", "0"], "argument --max-steps"),
    (["--clip-grad", "0"], "argument --clip-grad: must be above 0"),
    (["--step-timeout", "0"], "argument --step-timeout: must be above 0"),
    (["--dataset", "imagenet22k"], "argument --dataset: invalid choice"),
    (["--pretrained", "--weights", "w.pt"], "argument --weights: not allowed with argument --pretrained"),
])
def test_the_parser_refuses_bad_flags_in_one_line(argv, words):
    assert words in refused(argv)


def test_the_defaults_parse_and_help_shows_them():
    args = common.get_parser("").parse_args([])
    assert (args.batch_size, args.dataset, args.synthetic_shape) == (64, "synthetic", "1x28x28")
    text = common.get_parser("").format_help()
    assert "(default: 64)" in text and "(default: synthetic)" in text


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_refuses_bad_flags_before_it_builds(script, tmp_path):
    p = run(script, "--momentum", "-5", "--out-dir", tmp_path / "out", check=False)
    assert_exit(p, 2)  # bad input
    assert p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr  # one line
    assert p.stderr.startswith("error: argument --momentum") and not (tmp_path / "out").exists()


def write_images(root, counts, size=8):
    from PIL import Image
    for split, per_class in counts.items():
        for c, n in per_class.items():
            os.makedirs(root / split / c, exist_ok=True)
            for i in range(n):
                Image.new("RGB", (size, size), (40 * i % 255, 0, 0)).save(root / split / c / f"{i}.png")


def test_imagefolder_subsets_are_seeded_random_not_the_first_files(tmp_path):
    write_images(tmp_path, {"train": {"a": 30, "b": 10}, "val": {"a": 6, "b": 6}})
    args = defaults(dataset="imagefolder", data_dir=str(tmp_path), train_size=8, val_size=4, image_size=8)
    train, val = common.load_data(args)
    assert (len(train), len(val)) == (8, 4)
    assert {label for _, label in train.samples} == {0, 1}  # 8 of 40 files, 10 of class b: the first 8 are all a
    again, _ = common.load_data(args)
    assert again.samples == train.samples  # seeded: the same on every rank and every run
    other, _ = common.load_data(defaults(**{**vars(args), "seed": 1}))
    assert other.samples != train.samples


def test_imagefolder_at_the_default_size_suggests_image_size(tmp_path, capsys):
    write_images(tmp_path, {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path)), download=True)  # rank 0's call
    assert "--image-size" in capsys.readouterr().out
    common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path)))  # the other ranks say nothing
    assert capsys.readouterr().out == ""


def test_classes_come_from_the_whole_dataset():
    train, _ = common.load_data(defaults(train_size=4, val_size=20, seed=4))
    assert models.channels_and_classes(train) == (1, 10)  # not the few labels of 4 samples


def test_one_class_is_refused(tmp_path):
    write_images(tmp_path, {"train": {"a": 4}, "val": {"a": 2}})
    train, _ = common.load_data(defaults(dataset="imagefolder", data_dir=str(tmp_path), image_size=8))
    with pytest.raises(failsafe.UsageError, match="at least 2"):
        models.channels_and_classes(train)


@pytest.mark.parametrize("shape", ["3x4", "3x4x4", "0x28x28", "axbxc"])
def test_a_bad_synthetic_shape_is_one_line(shape):
    """Checked where the synthetic data is built (train_extras/datasets.py), on rank 0 before anything is written."""
    with pytest.raises(failsafe.UsageError, match=f"^--synthetic-shape {shape}: give CxHxW with C >= 1 and H, W >= 7$"):
        common.load_data(defaults(synthetic_shape=shape))


def test_checkpoint_files_get_one_line_that_says_what_to_do(tmp_path):
    empty = tmp_path / "last.pt"
    empty.write_bytes(b"")
    with pytest.raises(failsafe.UsageError, match="last.pt is not a readable checkpoint .*truncated"):
        common.read_checkpoint(str(empty))
    torch.save(models.make("cnn", 1, 10), tmp_path / "whole.pt")  # a pickled model, not a state_dict
    with pytest.raises(failsafe.UsageError, match=r"whole.pt is not a readable .*save its state_dict\)\?$"):
        common.read_checkpoint(str(tmp_path / "whole.pt"))
    model = models.make("cnn", 1, 10)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "lightning.pt")  # timm/Lightning layout
    assert finetune.state_dict_in(str(tmp_path / "lightning.pt")).keys() == model.state_dict().keys()
    ten = {"model": model.state_dict(), "optimizer": {}, "args": {}, "global_batch": 64}
    torch.save(ten, tmp_path / "ten.pt")
    args, out = defaults(resume=str(tmp_path / "ten.pt")), str(tmp_path / "out")
    with pytest.raises(failsafe.UsageError, match="ten.pt is not a training state of this model .*classes"):
        common.checkpoint_to_resume(ns(args=args, out_dir=out, raw_model=models.make("cnn", 1, 3), global_batch=64,
                                   steps_per_epoch=8, train_set=range(512)))
    with pytest.raises(failsafe.UsageError, match="global batch of 64, this run's is 32"):
        common.checkpoint_to_resume(ns(args=args, out_dir=out, raw_model=models.make("cnn", 1, 10), global_batch=32,
                                  steps_per_epoch=8, train_set=range(512)))
    run = ns(args=args, out_dir=out, raw_model=models.make("cnn", 1, 10), global_batch=64, steps_per_epoch=8,
             train_set=range(512))
    assert common.checkpoint_to_resume(run)["global_batch"] == 64
    torch.save({**ten, "steps_per_epoch": 16}, tmp_path / "ten.pt")  # a data set twice the size
    with pytest.raises(failsafe.UsageError, match="ten.pt was trained with 16 steps per epoch, this run has 8: the "
                                                "data changed"):
        common.checkpoint_to_resume(run)


def test_resume_says_what_it_resumes_or_why_not(tmp_path, capsys):
    """--resume auto with nothing to resume says so and starts afresh; --resume <folder> takes the last.pt in it;
    another --optimizer than the checkpoint's is one line pointing to --weights (its state fits no other optimizer)."""
    model, out = models.make("cnn", 1, 10), str(tmp_path / "out")
    run = ns(args=defaults(resume="auto"), out_dir=out, raw_model=model, global_batch=64, steps_per_epoch=8,
             train_set=range(512))
    assert common.checkpoint_to_resume(run) is None
    assert capsys.readouterr().out == f"--resume auto: no checkpoint in {out}, starting afresh\n"
    (tmp_path / "data").mkdir()  # a typo, the data folder: no checkpoint, and no sharded one either
    run.args = defaults(resume=str(tmp_path / "data"))
    with pytest.raises(failsafe.UsageError, match=f"--resume {tmp_path / 'data'}: a folder that holds no checkpoint"):
        common.checkpoint_to_resume(run)
    (tmp_path / "old").mkdir()
    torch.save({"model": model.state_dict(), "optimizer": {}, "args": {"optimizer": "sgd"}, "global_batch": 64},
               tmp_path / "old" / "last.pt")
    run.args = defaults(resume=str(tmp_path / "old"))
    assert common.checkpoint_to_resume(run)["args"] == {"optimizer": "sgd"}
    run.args = defaults(resume=str(tmp_path / "old"), optimizer="adamw")
    with pytest.raises(failsafe.UsageError, match="old/last.pt was trained with --optimizer sgd: to start adamw from "
                                                "its weights, give it to --weights$"):
        common.checkpoint_to_resume(run)


def test_a_checkpoint_keeps_its_position_in_samples():
    run = ns(args=ns(seed=0), rank=0, scheduler=None, steps_per_epoch=10, global_batch=32, device=torch.device("cpu"),
             train_set=range(320))
    position = common.Position(run, {"epoch": 1, "step_in_epoch": 3, "samples_in_epoch": 96, "loss_sum": 6.0})
    assert (position.step, position.step_in_epoch) == (13, 3)
    state = position.state([6.0, 0.0])
    assert state["samples_in_epoch"] == 96 and state["global_batch"] == 32
    assert position.state([6.0, 0.0]) == state  # pure: asking twice changes nothing
    assert common.Position(run, state).step == 13


def test_a_nan_stop_says_whether_an_older_checkpoint_is_there():
    run = ns(args=ns(seed=0, log_every=20, max_steps=None, save_every=None), rank=0, scheduler=None,
             steps_per_epoch=10, global_batch=32, device=torch.device("cpu"), train_set=range(320))
    for saved, words in [(None, "stopped, nothing was saved$"),
                         ({"epoch": 1}, "stopped, the last checkpoint is older$")]:
        run.position = common.Position(run, saved)
        agreement = failsafe.Agreement(run)
        agreement.first_bad.fill_(3)  # the first NaN/inf step, as step_done notes it
        with pytest.raises(failsafe.NanLoss, match=words) as e:
            agreement.check()
        assert e.value.code == 1


def test_a_resume_with_other_flags_keeps_the_optimizers_state_and_takes_the_new_schedule(tmp_path):
    """--lr, --momentum, --weight-decay: the optimizer's state holds the checkpoint's, which go on (docs/failures.md
    says so); --epochs, --warmup-epochs: the schedule is rebuilt, from the resumed step on: the LR of the first resumed
    step follows the new schedule at the old peak."""
    out = tmp_path / "out"
    run("ddp_launch_train.py", *TINY, "--max-steps", 4, "--out-dir", out)
    run("ddp_launch_train.py", *TINY[:-1], 3, "--lr", 0.5, "--momentum", 0.5, "--max-steps", 5, "--resume", "auto",
        "--out-dir", out)
    ckpt = checkpoint(str(out))
    assert ckpt["optimizer"]["param_groups"][0]["momentum"] == 0.9
    # step 5 of a cosine over 3 epochs of 8 steps, from the peak 0.01
    assert ckpt["scheduler"]["_last_lr"][0] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 5 / 24)))


def test_float64_inputs_and_int32_labels_of_shape_1_are_made_what_the_model_and_loss_take():
    run = ns(device=torch.device("cpu"), args=ns(channels_last=False))
    x, y = common.to_device(run, None, torch.zeros(4, 2, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.int32))
    assert (x.dtype, y.dtype, y.shape) == (torch.float32, torch.int64, (4,))


def test_resume_auto_takes_the_highest_step_whatever_the_files_times(tmp_path, monkeypatch):
    """fsdp_train.py's --resume auto among ckpt-<step> folders and a last.pt: the highest step, though a copy wrote
    ckpt-25 after ckpt-30 (and last.pt, at step 20, after both)."""
    from train_extras import sharded
    for step in (30, 25):
        (tmp_path / f"ckpt-{step}").mkdir()
        (tmp_path / f"ckpt-{step}" / ".metadata").write_bytes(b"")
        time.sleep(0.01)
    torch.save({"epoch": 2, "samples_in_epoch": 4 * 64}, tmp_path / "last.pt")  # step 2 x 8 + 4 = 20
    monkeypatch.setattr(sharded, "read", lambda path, run: {"sharded": path})  # the folder chosen, not read
    run = ns(args=defaults(resume="auto"), out_dir=str(tmp_path), steps_per_epoch=8, global_batch=64)
    assert sharded.find(run)["sharded"] == str(tmp_path / "ckpt-30")


@pytest.mark.parametrize("script", ["dp_train.py", "ddp_launch_train.py", "fsdp_train.py"])
def test_an_optimizer_state_without_tensors_resumes(script, tmp_path):
    """SGD with --momentum 0 keeps no tensor per parameter: its checkpoint resumes all the same."""
    out = tmp_path / "out"
    run(script, *TINY, "--momentum", 0, "--max-steps", 2, "--out-dir", out)
    assert checkpoint(str(out))["optimizer"]["state"] == {}
    p = run(script, *TINY, "--momentum", 0, "--max-steps", 4, "--resume", "auto", "--out-dir", out)
    assert "resuming at step 2" in p.stdout and checkpoint(str(out))["epoch"] * 8 + \
        checkpoint(str(out))["step_in_epoch"] == 4, p.stdout


def test_resume_refuses_another_global_batch_and_max_steps_is_a_budget(tmp_path):
    out = tmp_path / "out"
    p = run("ddp_launch_train.py", *TINY, "--save-every", 2, "--max-steps", 3, "--out-dir", out)
    assert "epoch 0.375  train_loss" in p.stdout, p.stdout  # 3 of the epoch's 8 steps
    before = (out / "last.pt").read_bytes()
    p = run("ddp_launch_train.py", *TINY, "--max-steps", 3, "--resume", "auto", "--out-dir", out)
    assert "already at step 3 of 3 (--epochs 1, --max-steps 3): nothing to train" in p.stdout, p.stdout
    assert "epoch 1" not in p.stdout
    p = run("ddp_launch_train.py", *TINY[:4], "--batch-size", 6, "--epochs", 1, "--resume", "auto", "--out-dir", out,
            check=False)
    assert_exit(p, 2)
    assert "global batch of 12, this run's is 6" in p.stderr, p.stderr
    p = run("ddp_launch_train.py", *TINY, "--out-dir", out, check=False)  # a fresh run: it would replace last.pt
    assert_exit(p, 2)
    assert "--resume auto continues it, --overwrite replaces it" in p.stderr, p.stderr
    assert (out / "last.pt").read_bytes() == before and [r["step"] for r in metrics(str(out))] == [3]
    run("ddp_launch_train.py", *TINY, "--overwrite", "--out-dir", out)
    assert checkpoint(str(out))["epoch"] == 1
    done = (out / "last.pt").read_bytes()
    p = run("ddp_launch_train.py", *TINY, "--resume", "auto", "--out-dir", out)  # --epochs 1 reached: one line
    assert "already at step 8 of 8 (--epochs 1, --max-steps None): nothing to train" in p.stdout, p.stdout
    assert (out / "last.pt").read_bytes() == done


def test_a_run_of_one_step_logs_no_speed_it_did_not_measure(tmp_path):
    """The speed is timed from the end of an epoch's first step: --max-steps 1 (and --log-every 1) measured none,
    and the epoch's line, its log line and its row say none (not 0 samples/s)."""
    out = tmp_path / "out"
    p = run("ddp_launch_train.py", *TINY, "--max-steps", 1, "--log-every", 1, "--out-dir", out)
    line = [line for line in p.stdout.splitlines() if line.startswith("epoch 0.125")]
    assert len(line) == 1 and "samples/s" not in line[0] and line[0].endswith("lr 9.62e-03"), p.stdout
    assert "samples_per_s" not in p.stdout, p.stdout  # the --log-every line
    row = metrics(str(out))[-1]
    assert (row["samples_per_s"], row["epoch_time_s"]) == (None, None), row


def test_an_out_dir_that_cannot_be_a_folder_is_one_line(tmp_path):
    """No lock on the folder (two live runs into one --out-dir are not refused): what is refused before anything is
    written is a fresh run where an earlier run's last.pt is
    (test_resume_refuses_another_global_batch_and_max_steps_is_a_budget) and an --out-dir that cannot be a folder."""
    (tmp_path / "file").write_text("")
    p = run("ddp_launch_train.py", *TINY, "--out-dir", tmp_path / "file" / "out", check=False)
    assert_exit(p, 2)
    assert p.stderr.startswith(f"error: --out-dir {tmp_path / 'file' / 'out'}: ") and len(p.stderr.splitlines()) == 1, \
        p.stderr
    assert os.listdir(tmp_path) == ["file"] and (tmp_path / "file").read_text() == ""


@pytest.mark.full
@pytest.mark.parametrize("script", ["dp_train.py", "ddp_spawn_train.py"])
def test_the_one_process_scripts_refuse_torchrun(script, tmp_path):
    p = run(script, *TINY, "--out-dir", tmp_path, launcher="torchrun", nproc=2, check=False)
    assert_exit(p, 2, nproc=2)  # torchrun exits 1; both of its workers 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not torchrun" in errors[0], p.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("left", [{"RANK": 1, "WORLD_SIZE": 2}, {"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "x",
                                                                "MASTER_PORT": 1}], ids=["rank-1", "rank-0"])
def test_launcher_variables_left_in_the_shell_are_named_in_one_line(left, tmp_path):
    """`RANK=1 WORLD_SIZE=2 python ddp_spawn_train.py` (an earlier job's variables, still set): one line that names
    them, exit 2, also where the variables say rank 1 (whose lines rank 0 would print, were there one)."""
    p = run("ddp_spawn_train.py", *TINY, "--out-dir", tmp_path / "run", env=left, check=False)
    assert_exit(p, 2)
    lines = p.stderr.splitlines()
    told = " ".join(f"{k}={v}" for k, v in left.items() if k in ("RANK", "WORLD_SIZE"))
    assert len(lines) == 1 and lines[0].startswith("error: ddp_spawn_train.py starts its own processes") and \
        f"(its environment has {told})" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--batch-size", "--nprocs"])
def test_spawn_usage_errors_exit_2(tmp_path, flag):
    p = run("ddp_spawn_train.py", flag, 0, "--out-dir", tmp_path, check=False)
    assert_exit(p, 2)
    assert p.stderr == f"error: argument {flag}: must be at least 1, got 0 (see ddp_spawn_train.py --help)\n", p.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.full
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


# ---- refused before anything is built: what a run into a used or unwritable --out-dir, or more samples than the data
# has, would otherwise find out only after building the data and the model, or training
@pytest.mark.parametrize("script", ["ddp_launch_train.py", pytest.param("dp_train.py", marks=pytest.mark.full)])
def test_a_fresh_run_into_a_used_out_dir_is_refused_before_the_data_is_read(script, tmp_path):
    """The data folder does not exist: the refusal names the earlier run, so it came first."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes(b"an earlier run's")
    p = run(script, "--dataset", "imagefolder", "--data-dir", tmp_path / "none", "--out-dir", out, check=False)
    assert_exit(p, 2)
    assert p.stderr.strip().splitlines() == [f"error: {out} holds the last.pt of an earlier run: --resume auto "
                                             "continues it, --overwrite replaces it, or give another --out-dir"]


def test_more_samples_than_the_data_has_is_one_line(tmp_path):
    from test_scripts import write_imagefolder
    write_imagefolder(tmp_path / "images", per_class_train=12)  # 36 training images
    p = run("ddp_launch_train.py", "--dataset", "imagefolder", "--data-dir", tmp_path / "images", "--train-size", 5000,
            "--out-dir", tmp_path / "run", check=False)
    assert_exit(p, 2)
    assert p.stderr.strip().splitlines() == ["error: --train-size 5000: the data has 36 samples"]


def test_the_extras_flags_common_names_are_the_ones_each_extra_declares():
    """common.EXTRA_FLAGS (the file a flag of an extra not copied comes from) is a list kept by hand: it must name
    exactly the flags each train_extras module adds."""
    import importlib
    for name, flags in common.EXTRA_FLAGS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(f"train_extras.{name}").add_flags(parser)
        declared = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        assert declared == set(flags), (name, declared ^ set(flags))
