"""One --out-dir, one run: a resume never replaces another run's checkpoints or mixes two runs' metrics; --overwrite
replaces the whole earlier run (every last.pt and ckpt-<step> folder), never part of it; a resume on other data (a
seed, a size, a data set, a sample count) is refused, even where the steps per epoch agree."""
import json
import os
import shutil
import sys

import pytest

from conftest import assert_exit, checkpoint, metrics
from processes import command, run

ARGS = ["--epochs", 2, "--train-size", 256, "--val-size", 50, "--batch-size", 32]  # 8 steps an epoch


def one_line(p):
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


@pytest.mark.parametrize("script", ["ddp_launch_train.py", pytest.param("dp_train.py", marks=pytest.mark.full)])
def test_a_resume_from_elsewhere_never_replaces_the_run_in_out_dir_and_overwrite_starts_its_metrics_afresh(
        script, tmp_path):
    y, x = tmp_path / "Y", tmp_path / "X"
    run(script, *ARGS, "--lr", 0.05, "--out-dir", y)
    run(script, *ARGS, "--epochs", 1, "--max-steps", 3, "--out-dir", x)
    before, rows = (y / "last.pt").read_bytes(), (y / "metrics.jsonl").read_text()
    p = run(script, *ARGS, "--out-dir", y, "--resume", x / "last.pt", check=False)
    assert_exit(p, 2)
    assert "give another --out-dir, or --overwrite" in one_line(p)
    assert (y / "last.pt").read_bytes() == before and (y / "metrics.jsonl").read_text() == rows
    p = run(script, *ARGS, "--out-dir", y, "--resume", "auto", "--overwrite", check=False)
    assert_exit(p, 2)
    assert "--overwrite would delete the checkpoint that --resume auto continues" in one_line(p)
    assert (y / "last.pt").read_bytes() == before
    # --overwrite with a checkpoint that this run cannot continue (its seed: other data): refused before anything of
    # the earlier run is deleted
    p = run(script, *ARGS, "--seed", 3, "--out-dir", y, "--resume", x / "last.pt", "--overwrite", check=False)
    assert_exit(p, 2)
    assert "was trained on other data (--seed 0, this run's 3)" in one_line(p)
    assert (y / "last.pt").read_bytes() == before and (y / "metrics.jsonl").read_text() == rows
    if script == "dp_train.py":
        return
    log = run(script, *ARGS, "--out-dir", y, "--resume", x / "last.pt", "--overwrite").stdout
    assert "resuming at step 3" in log
    assert [r["step"] for r in metrics(y)] == [8, 16]  # Y's old rows gone; X's row of step 3 is X's
    assert checkpoint(str(y))["args"]["lr"] == 0.01


@pytest.mark.full
def test_fsdp_overwrite_replaces_every_checkpoint_of_the_earlier_run(tmp_path):
    """Run A leaves ckpt-4, ckpt-8; run B (--overwrite, another seed) saves ckpt-4 only: no folder of A's stays, and
    --resume auto continues B. A last.pt of A beside B's folders goes likewise."""
    z = tmp_path / "Z"
    b = ["--ckpt-format", "dcp", "--epochs", 1, "--train-size", 256, "--val-size", 32, "--batch-size", 16, "--out-dir",
         z]
    run("fsdp_train.py", *b, "--max-steps", 8, "--save-every", 4)
    run("fsdp_train.py", *b, "--ckpt-format", "file", "--max-steps", 12, "--resume", "auto")  # and a last.pt
    assert sorted(n for n in os.listdir(z) if n != "metrics.jsonl") == ["ckpt-4", "ckpt-8", "last.pt"]
    run("fsdp_train.py", *b, "--max-steps", 4, "--overwrite", "--seed", 5)
    assert sorted(os.listdir(z)) == ["ckpt-4", "metrics.jsonl"] and [r["step"] for r in metrics(z)] == [4]
    log = run("fsdp_train.py", *b, "--max-steps", 6, "--seed", 5, "--resume", "auto").stdout
    assert "resuming at step 4" in log and [r["step"] for r in metrics(z)] == [6]  # step 4's mid-epoch row goes


def test_a_resume_on_other_data_is_refused_even_with_the_same_steps_per_epoch(tmp_path):
    out = tmp_path / "run"
    run("ddp_launch_train.py", *ARGS, "--epochs", 1, "--out-dir", out)  # 256 and 280 samples: 8 steps of 32
    before = (out / "last.pt").read_bytes()
    for change, what in [(["--seed", 3], "--seed 0, this run's 3"),
                         (["--train-size", 280], "training samples 256, this run's 280"),
                         (["--val-size", 60], "--val-size 50, this run's 60")]:
        p = run("ddp_launch_train.py", *ARGS, *change, "--resume", "auto", "--out-dir", out, check=False)
        assert_exit(p, 2)
        line = one_line(p)
        assert f"trained on other data ({what})" in line and "--weights" in line, line
        assert (out / "last.pt").read_bytes() == before


@pytest.mark.parametrize("script", ["ddp_launch_train.py", pytest.param("fsdp_train.py", marks=pytest.mark.full)])
def test_an_earlier_runs_metrics_without_its_checkpoint_are_never_replaced_unasked(script, tmp_path):
    """Its checkpoints deleted (a full disk), its metrics.jsonl kept: a fresh run, and a --resume auto that finds
    nothing to continue, are refused in one line, the rows byte for byte the same; --overwrite starts afresh."""
    out = tmp_path / "run"
    run(script, *ARGS, "--out-dir", out, *(["--ckpt-format", "dcp"] if script == "fsdp_train.py" else []))
    for name in os.listdir(out):
        if name != "metrics.jsonl":
            shutil.rmtree(out / name) if (out / name).is_dir() else os.remove(out / name)
    rows = (out / "metrics.jsonl").read_text()
    assert len(rows.splitlines()) == 2
    for more in ([], ["--resume", "auto"]):
        p = run(script, *ARGS, "--epochs", 1, "--max-steps", 4, "--out-dir", out, *more, check=False)
        assert_exit(p, 2)
        assert "holds the metrics.jsonl of an earlier run (2 rows)" in one_line(p)
        assert (out / "metrics.jsonl").read_text() == rows and os.listdir(out) == ["metrics.jsonl"]
    run(script, *ARGS, "--epochs", 1, "--out-dir", out, "--overwrite")
    assert [r["step"] for r in metrics(out)] == [8]


# lines of a metrics.jsonl that the scripts did not write: another tool's rows, rows keyed global_step, a float or a
# string step, a note by hand, an integer step without an epoch
FOREIGN = ['{"epoch": 1, "loss": 0.5}', '{"global_step": 8, "epoch": 1, "val_loss": 0.4}', '{"step": 8.0, "epoch": 1}',
           '{"step": "8", "epoch": 1}', "lr halved by hand here", '{"step": 4}']


def test_every_line_of_an_earlier_metrics_jsonl_is_someones_data(tmp_path):
    """A fresh run refuses a folder whose metrics.jsonl holds lines it cannot read, in one line, the file byte for
    byte the same; a resume keeps every such line where it was and drops only its own rows that its checkpoint does
    not cover."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text("\n".join(FOREIGN) + "\n")
    p = run("ddp_launch_train.py", *ARGS, "--max-steps", 4, "--out-dir", fresh, check=False)
    assert_exit(p, 2)
    assert f"holds the metrics.jsonl of an earlier run ({len(FOREIGN)} rows)" in one_line(p)
    assert (fresh / "metrics.jsonl").read_text() == "\n".join(FOREIGN) + "\n" and os.listdir(fresh) == ["metrics.jsonl"]
    out = tmp_path / "run"
    run("ddp_launch_train.py", *ARGS, "--epochs", 1, "--out-dir", out)  # last.pt at step 8, its row
    at_8 = (out / "last.pt").read_bytes()
    run("ddp_launch_train.py", *ARGS, "--resume", "auto", "--out-dir", out)  # and step 16's row
    own = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([own[0], *FOREIGN[:3], own[1], *FOREIGN[3:]]) + "\n")
    (out / "last.pt").write_bytes(at_8)  # back to step 8: its resume drops step 16's row, and only it
    run("ddp_launch_train.py", *ARGS, "--resume", "auto", "--out-dir", out)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines[:len(FOREIGN) + 1] == [own[0], *FOREIGN], lines
    assert [json.loads(line)["step"] for line in lines[len(FOREIGN) + 1:]] == [16], lines


@pytest.mark.full
def test_a_script_that_reads_last_pt_says_how_to_continue_fsdps_sharded_folders(tmp_path):
    """A folder holding only fsdp_train.py's ckpt-4: ddp_launch_train.py, started afresh, names the conversion that
    makes it a last.pt, and --resume auto is refused with the same advice rather than starting afresh beside it;
    once converted, --resume auto continues it."""
    out = tmp_path / "run"
    run("fsdp_train.py", *ARGS, "--ckpt-format", "dcp", "--max-steps", 4, "--out-dir", out, launcher="torchrun",
        nproc=2)
    assert sorted(os.listdir(out)) == ["ckpt-4", "metrics.jsonl"]
    convert = f"python -m train_extras.sharded {out / 'ckpt-4'} {out / 'last.pt'}"
    for more in ([], ["--resume", "auto"]):
        p = run("ddp_launch_train.py", *ARGS, "--out-dir", out, *more, check=False)
        assert_exit(p, 2)
        assert f"{convert} makes it a last.pt that --resume auto continues" in one_line(p)
    assert sorted(os.listdir(out)) == ["ckpt-4", "metrics.jsonl"]
    command([sys.executable, "-m", "train_extras.sharded", out / "ckpt-4", out / "last.pt"], check=True)
    p = run("ddp_launch_train.py", *ARGS, "--out-dir", out, "--resume", "auto", launcher="torchrun", nproc=2)
    assert "resuming at step 4" in p.stdout
