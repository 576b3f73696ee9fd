"""Disks that fail a run: a full one (a real tmpfs too small for a second checkpoint, where torch's writer says only
"unexpected pos": failsafe.save_failed infers it from the space left), one made read-only before the run or in the
middle of it (a real read-only bind mount: root writes into a chmod 555 folder, so chmod cannot test
it), an --out-dir removed mid-run, a quota or a full disk reached by the metrics row (injected: EDQUOT, a half
write), a sharded save on a full disk. Every case: one line
naming the file and the cause, every rank exits 2, the previous checkpoint whole, no temporary file, no metrics row
for a step no checkpoint holds. The mounts need root (CI runs as root; REQUIRE_MOUNTS=1 there: green means they
ran)."""
import os
import shutil

import pytest

from conftest import checkpoint, metrics
from hooks import Hooks
from processes import Ranks, command, run
from test_failures import one_error_line

# 96 samples of batch 12 (6 a process on 2 ranks, started by hand): 8 steps an epoch; the default cnn's last.pt is
# 9.2 MiB
TINY = ["--train-size", 96, "--val-size", 20, "--epochs", 2]


def batch(nproc):
    return ["--batch-size", 12 // (nproc or 1)]


@pytest.fixture
def mount(tmp_path):
    """mount(path, *options): a tmpfs at `path` (made), e.g. mount(p, "-t", "tmpfs", "-o", "size=16m"), or a bind
    mount; unmounted at the end. Root only."""
    if os.geteuid() != 0:
        reason = "mounts a tmpfs or a read-only bind mount: root only"
        pytest.fail(f"REQUIRE_MOUNTS=1, but {reason}") if os.environ.get("REQUIRE_MOUNTS") == "1" else \
            pytest.skip(reason)
    done = []

    def mount(path, *options):
        os.makedirs(path, exist_ok=True)
        command(["mount", *options, *([path] if "tmpfs" not in options else ["tmpfs"]), path], check=True)
        done.append(path)
    yield mount
    for path in reversed(done):
        command(["umount", "-l", path])


@pytest.mark.parametrize("launcher", ["python", "ranks"])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays_whole(tmp_path, mount, launcher):
    """16 MiB: room for epoch 1's last.pt (9.2 MiB), not for epoch 2's beside it (written aside, then renamed)."""
    out, nproc = tmp_path / "disk", 2 if launcher == "ranks" else None
    mount(out, "-t", "tmpfs", "-o", "size=16m")
    p = run("ddp_launch_train.py", *TINY, *batch(nproc), "--out-dir", out, launcher=launcher, nproc=nproc, check=False)
    line = one_error_line(p, 2)
    assert line == f"error: could not save {out / 'last.pt'}: No space left on device. The previous checkpoint is " \
        "whole", line
    assert checkpoint(str(out))["epoch"] == 1 and [r["epoch"] for r in metrics(str(out))] == [1]
    assert sorted(os.listdir(out)) == ["last.pt", "metrics.jsonl"]


def test_a_read_only_out_dir_is_one_line_before_training(tmp_path, mount):
    """Found before the data and the model are built (the data folder does not exist), not at the first save after
    an epoch of training."""
    out = tmp_path / "ro"
    mount(out, "--bind")
    mount(out, "-o", "remount,bind,ro")
    p = run("ddp_launch_train.py", *TINY, *batch(2), "--dataset", "imagefolder", "--data-dir", tmp_path / "none",
            "--out-dir", out, launcher="ranks", nproc=2, check=False)
    assert one_error_line(p, 2) == f"error: --out-dir {out}: Read-only file system"
    assert os.listdir(out) == []


@pytest.mark.full
@pytest.mark.parametrize("change", ["read_only", "removed"])
def test_an_out_dir_made_read_only_or_removed_mid_run_is_one_line(tmp_path, request, change):
    """At step 12 (in epoch 2, 2 ranks) --out-dir is remounted read-only, or removed: epoch 2's save fails on rank 0,
    every rank exits 2 with one line naming the cause. Read-only: epoch 1's checkpoint and row stay; removed:
    nothing makes the folder again."""
    out, hooks = tmp_path / "out", Hooks(tmp_path, pause_at=12)
    mount = request.getfixturevalue("mount") if change == "read_only" else None  # (root only)
    if mount:
        mount(out, "--bind")
    ranks = Ranks("ddp_launch_train.py", [*TINY, *batch(2), "--out-dir", out], 2, env=hooks.env, timeout=120)
    try:
        ranks.procs[0].until(lambda: len(hooks.paused()) == 2, "both ranks at step 12")
        mount(out, "-o", "remount,bind,ro") if mount else shutil.rmtree(out)
        hooks.go("pause")
        for rank in (0, 1):
            ranks.wait(rank)
    finally:
        ranks.kill()
    p = ranks.result()
    cause = "Read-only file system. " if mount else "No such file or directory. "
    assert one_error_line(p, 2).startswith(f"error: could not save {out / 'last.pt'}: {cause}")
    if mount:
        assert checkpoint(str(out))["epoch"] == 1 and [r["epoch"] for r in metrics(str(out))] == [1]
        assert sorted(os.listdir(out)) == ["last.pt", "metrics.jsonl"]
    else:
        assert not out.exists()


@pytest.mark.parametrize("launcher, how", [("python", "quota"), ("ranks", "quota"), ("ranks", "short")])
def test_a_metrics_row_that_cannot_be_written_is_one_line_after_its_checkpoint(tmp_path, launcher, how):
    """Epoch 2's row fails after its checkpoint was saved (injected, tests/hooks.py TEST_FAIL_METRICS): over the
    quota (EDQUOT), or the disk full mid-row (half of it written). One line saying so, every rank exits 2, and no
    half row: metrics.jsonl reads as epoch 1's row alone."""
    out, nproc = tmp_path / "out", 2 if launcher == "ranks" else None
    hooks = Hooks(tmp_path, fail_metrics="2" if how == "quota" else "2:short")
    p = run("ddp_launch_train.py", *TINY, *batch(nproc), "--out-dir", out, launcher=launcher, nproc=nproc,
            env=hooks.env, check=False)
    cause = "Disk quota exceeded" if how == "quota" else "No space left on device"
    assert one_error_line(p, 2) == f"error: could not write {out / 'metrics.jsonl'}: {cause}; step 16 was saved"
    assert checkpoint(str(out))["epoch"] == 2 and [r["epoch"] for r in metrics(str(out))] == [1]


@pytest.mark.parametrize("extra", [[], ["--async-save"]], ids=["dcp", "dcp_async"])
def test_a_sharded_save_on_a_full_disk_is_one_line_and_leaves_no_partial_folder(tmp_path, mount, extra):
    """fsdp_train.py --ckpt-format dcp on 2 processes, 16 MiB: epoch 1's ckpt-8 folder (9.3 MiB) fits, epoch 2's
    does not. Every rank learns of it (DCP gathers the failures): one line, every rank exits 2, ckpt-8 whole and
    the only folder, no ckpt-16.tmp, epoch 1's row only."""
    out = tmp_path / "disk"
    mount(out, "-t", "tmpfs", "-o", "size=16m")
    p = run("fsdp_train.py", *TINY, *batch(2), "--ckpt-format", "dcp", *extra, "--out-dir", out, launcher="ranks",
            nproc=2, check=False)
    line = one_error_line(p, 2)
    assert line == f"error: could not save {out / 'ckpt-16'}: No space left on device. The previous checkpoint is " \
        "whole", line
    assert sorted(os.listdir(out)) == ["ckpt-8", "metrics.jsonl"] and [r["epoch"] for r in metrics(str(out))] == [1]
    assert os.path.isfile(out / "ckpt-8" / ".metadata")
