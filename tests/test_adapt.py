"""What a copier does: one script and common.py in an empty folder, their own plain Dataset and nn.Module swapped in
with the lines the README's "Adapting" section shows, trained under torchrun with 2 processes."""
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time

import pytest

from conftest import assert_exit, checkpoint, metrics
from hooks import Hooks
from processes import ROOT, Proc, run, started_with

# the copier's own code: a map-style Dataset of (image, label) pairs with its own random augmentation, and a model
MY_PROJECT = '''
import torch
import torch.nn as nn

class MyDataset(torch.utils.data.Dataset):
    """Images of 3 classes told apart by which third of the image is bright, plus noise; no `classes` attribute."""

    def __init__(self, split):
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        self.y = torch.randint(0, 3, (600 if split == "train" else 90,), generator=g)
        self.x = torch.randn(len(self.y), 1, 12, 12, generator=g) * 0.5
        for i, label in enumerate(self.y):
            self.x[i, :, 4 * label:4 * label + 4] += 1.0
        self.augment = split == "train"

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        if self.augment and torch.rand(()) < 0.5:  # its own random flip, from the worker's RNG
            x = x.flip(-1)
        return x, int(self.y[i])


class MyModel(nn.Module):
    def __init__(self, channels=1, classes=3):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d((3, 1)), nn.Flatten(), nn.Linear(24, classes))

    def forward(self, x):
        return self.net(x)
'''


def readme_edits():
    """The (old, new) line pairs of the README's adapting section: its python block, in `# was:` / `# now:` pairs."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## Adapting a script to your model and data"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return re.findall(r"# was:\n(.*?)\n\s*# now:\n(.*?)\n(?=\s*# was:|\Z)", block, re.S)


def adapted_copy(folder, my_project, extras=()):
    """ddp_launch_train.py, common.py and failsafe.py in `folder`, the script changed as the README says, with
    `my_project` beside them; and the train_extras/ modules named in `extras`, copied as the README says (with its
    __init__.py)."""
    edits = readme_edits()
    assert 3 <= len(edits) <= 4, edits
    for name in ("common.py", "failsafe.py"):
        shutil.copy(os.path.join(ROOT, name), folder)
    script = open(os.path.join(ROOT, "ddp_launch_train.py")).read()
    for old, new in edits:
        old, new = old.rstrip(), new.rstrip()
        assert script.count(old) == 1, f"the README's line is not in the script: {old}"
        script = script.replace(old, new)
    assert "common.make_model" not in script and "common.load_data" not in script
    (folder / "train.py").write_text(script)
    (folder / "my_project.py").write_text(my_project)
    for name in extras:
        os.makedirs(folder / "train_extras", exist_ok=True)
        for module in ("__init__", name):
            shutil.copy(os.path.join(ROOT, "train_extras", f"{module}.py"), folder / "train_extras")
    return str(folder / "train.py")


@pytest.mark.floor
def test_a_copy_trains_your_own_dataset_and_model(tmp_path):
    out = tmp_path / "out"
    p = run(adapted_copy(tmp_path, MY_PROJECT), "--epochs", 3, "--batch-size", 16, "--lr", 0.05, "--workers", 0,
            "--out-dir", out, launcher="torchrun", nproc=2)
    rows = metrics(str(out))
    assert [r["val_count"] for r in rows] == [90] * 3, rows  # every validation sample once, over both ranks
    assert rows[-1]["val_acc"] > 0.9 and rows[-1]["train_loss"] < rows[0]["train_loss"], rows  # chance is 1/3
    model = checkpoint(str(out))["model"]
    assert model["net.5.weight"].shape == (3, 24) and "net.1.running_mean" in model  # 3 classes, from one pass
    assert "Traceback" not in p.stderr


# data as numpy gives it (float64 samples, int32 labels of shape (1,))
AS_THEY_COME = MY_PROJECT.replace("return x, int(self.y[i])",
                                  "return x.double().numpy(), self.y[i:i + 1].int().numpy()")


def test_numpy_samples_and_labels_of_shape_1_train(tmp_path):
    """What a copier's Dataset often returns: float64 numpy samples (made float32), labels as int32 arrays of one
    element (made one int64 each)."""
    out = tmp_path / "out"
    p = run(adapted_copy(tmp_path, AS_THEY_COME), "--epochs", 3, "--batch-size", 32, "--lr", 0.05, "--workers", 0,
            "--out-dir", out)
    rows = metrics(str(out))
    assert rows[-1]["val_acc"] > 0.9 and rows[-1]["val_count"] == 90, rows
    assert "Traceback" not in p.stderr


# a model with a layer that no step uses (a branch taken only sometimes, a head trained elsewhere)
UNUSED = MY_PROJECT.replace("nn.Linear(24, classes))", "nn.Linear(24, classes))\n        self.spare = nn.Linear(4, 4)")


@pytest.mark.full
def test_a_model_that_leaves_parameters_unused_trains_with_find_unused_parameters(tmp_path):
    """DDP waits for every parameter's gradient: without the flag such a model fails at its second step with DDP's
    own error (which names its keyword argument, find_unused_parameters=True), and every rank ends."""
    script = adapted_copy(tmp_path, UNUSED)
    args = ["--epochs", 1, "--batch-size", 16, "--max-steps", 3, "--workers", 0, "--out-dir", tmp_path / "out"]
    p = run(script, *args, launcher="ranks", nproc=2, check=False)
    assert "find_unused_parameters=True" in p.stderr, p.stderr[-3000:]
    assert_exit(p, 1)  # every rank's own status
    run(script, *args, "--find-unused-parameters", "--overwrite", launcher="ranks", nproc=2)
    assert checkpoint(str(tmp_path / "out"))["step_in_epoch"] == 3


# a slow Dataset (0.05 s per batch of 8) and a slow model (0.05 s per step); the Dataset writes down the time its
# training samples really took, oversleeping included, for the test to compare with the script's clock
NO_PASS = "self.classes = 3  # no pass over the labels\n        self.augment = "
SLEEPY = MY_PROJECT.replace("self.augment = ", NO_PASS) + '''
import os, time

spent, _getitem, _forward = 0.0, MyDataset.__getitem__, MyModel.forward

def slow_getitem(self, i):
    global spent
    t = time.perf_counter()
    time.sleep(0.05 / 8)
    item = _getitem(self, i)
    if self.augment:  # the training set
        spent += time.perf_counter() - t
        with open(os.environ["SPENT_FILE"], "w") as f:
            f.write(str(spent))
    return item

def slow_forward(self, x):
    time.sleep(0.05)
    return _forward(self, x)

MyDataset.__getitem__, MyModel.forward = slow_getitem, slow_forward
'''


@pytest.mark.full
def test_the_epoch_time_holds_the_waits_for_data_and_the_steps(tmp_path):
    """epoch_time_s (and samples_per_s) time the steady state from the end of step 1, the waits for a slow Dataset
    (1.5 s asleep) and the steps (another 1.5 s) alike. (metrics.jsonl no longer splits out data_wait_s.)"""
    out, spent = tmp_path / "out", tmp_path / "spent"
    run(adapted_copy(tmp_path, SLEEPY), "--epochs", 1, "--batch-size", 8, "--workers", 0, "--max-steps", 30,
        "--out-dir", out, env={"SPENT_FILE": str(spent)})
    row, dataset_s = metrics(str(out))[0], float(spent.read_text())
    assert row["step"] == 30 and dataset_s >= 30 * 0.05, (row, dataset_s)
    # from the end of step 1 (common.Progress): 29 batches and 29 steps of at least 0.05 s each
    assert row["epoch_time_s"] >= 29 * (0.05 + 0.05), row
    assert row["samples_per_s"] == pytest.approx(29 * 8 / row["epoch_time_s"], rel=1e-6), row


# the copier's Dataset writes down, in each worker, whether the process that started that worker is the trainer
PARENTS = ("import os\n" + MY_PROJECT).replace(
    "self.augment = split", "self.trainer = os.getpid()\n        self.augment = split").replace(
    "        x = self.x[i]\n", "        x = self.x[i]\n        with open(os.environ['PARENTS_FILE'], 'a') as f:\n"
                             "            f.write(f'{os.getppid() == self.trainer}\\n')\n")


@pytest.mark.workers
@pytest.mark.parametrize("copied", [True, False], ids=["workers.py copied", "alone"])
def test_dataloader_workers_start_from_a_fork_server_where_train_extras_workers_is(tmp_path, copied):
    """A worker forked from a process that runs other threads (gloo's) can deadlock at its start, and the run with it
    (python/cpython#112275, Python 3.11.7 here): with train_extras/workers.py copied, the workers start from a fork
    server, none is the trainer's child; without it, as torch starts them: by the default start method, forked from
    the trainer on Linux up to Python 3.13, from multiprocessing's own fork server from 3.14."""
    parents = tmp_path / "parents"
    run(adapted_copy(tmp_path, PARENTS, extras=["workers"] if copied else []), "--epochs", 1, "--batch-size", 16,
        "--max-steps", 4, "--workers", 2, "--out-dir", tmp_path / "out", env={"PARENTS_FILE": str(parents)})
    seen = parents.read_text().split()
    from train_extras import workers
    server = copied and workers.AFFECTED or multiprocessing.get_start_method() == "forkserver"
    assert len(seen) >= 4 * 16 and set(seen) == {str(not server)}, seen[:8]


@pytest.mark.workers
@pytest.mark.full
def test_a_trainer_killed_outright_leaves_no_worker_behind(tmp_path):
    """SIGKILL (the OOM killer's) to a process paused at step 3 with its 2 DataLoader workers alive, started from a fork
    server (train_extras/workers.py's on Python 3.11.9 and older; multiprocessing's own, the default, on 3.14): the
    server ends with it, and the workers with the server, within seconds; nothing of the run is left holding memory or
    its output. (Without failsafe.init_worker letting go of the server's pipe in each worker, they would all wait for
    each other forever.) A real interpreter: its processes are found by the environment they were started with."""
    hooks = Hooks(tmp_path, pause_at=3)
    cmd = [sys.executable, adapted_copy(tmp_path, MY_PROJECT, extras=["workers"]), "--epochs", 1, "--batch-size", 16,
           "--workers", 2, "--out-dir", tmp_path / "out"]
    proc = Proc(cmd, tmp_path / "log", env=hooks.env, cwd=tmp_path)

    def left():  # the processes of this run, the trainer's zombie aside
        return [pid for pid in started_with(proc.token) if pid != proc.pid]
    try:
        proc.until(lambda: hooks.paused(), "the pause at step 3")
        assert len(left()) >= 3, left()  # the server and its 2 workers
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left() == [], f"still running 20 s after the trainer was killed: {left()}"
    finally:
        proc.kill()
        for pid in left():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.full
def test_an_error_of_the_copiers_model_on_one_rank_is_the_runs_one_report(tmp_path):
    """The copier's model raises on rank 1 alone, at its third training forward; the ranks started by hand, rank 0
    holding the store, hangs.py copied too: rank 1's traceback is the run's one report, and rank 0, which loses its
    peer, ends without naming it (rank 1 marked in the store that it ended with its own line). Both exit 1; nothing
    is saved."""
    mistake = ("    def forward(self, x):\n"
               "        self.calls = getattr(self, 'calls', 0) + self.training\n"
               "        if self.calls == 3 and os.environ['RANK'] == '1':\n"
               "            raise ValueError('my model: its own mistake')\n")
    project = "import os\n" + MY_PROJECT.replace("    def forward(self, x):\n", mistake)
    script = adapted_copy(tmp_path, project, extras=("hangs",))
    p = run(script, "--epochs", 1, "--batch-size", 16, "--workers", 0, "--out-dir", tmp_path / "out",
            launcher="ranks", nproc=2, check=False, timeout=120)
    assert_exit(p, 1)
    assert p.stderr.count("Traceback") == 1 and "ValueError: my model: its own mistake" in p.stderr, p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [], p.stderr
    assert not os.path.exists(tmp_path / "out" / "last.pt")


@pytest.mark.full
def test_a_sample_that_cannot_train_ends_every_rank_with_torchs_own_error(tmp_path):
    """A mistake in the copier's own Dataset (three values where the script unpacks two) surfaces as PyTorch's or
    Python's own error: every rank ends, none hangs, nothing is saved."""
    script = adapted_copy(tmp_path, MY_PROJECT.replace("return x, int(self.y[i])", "return x, int(self.y[i]), i"))
    p = run(script, "--epochs", 1, "--batch-size", 16, "--workers", 0, "--out-dir", tmp_path / "out",
            launcher="ranks", nproc=2, check=False, timeout=120)
    assert "too many values to unpack" in p.stderr, p.stderr[-3000:]
    assert_exit(p, 1)  # each rank's: the one that raised it, and the one that lost its peer
    assert not os.path.exists(tmp_path / "out" / "last.pt")
