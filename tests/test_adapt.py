"""What a copier does: one script and common.py in an empty folder, their own plain Dataset and nn.Module swapped in
with the lines the README's "Adapting" section shows, trained under torchrun with 2 processes."""
import os
import re
import shutil
import signal
import sys
import time

import pytest

from conftest import ROOT, checkpoint, metrics, run, started_by, worker_exit_codes
from test_failures import one_error_line

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


def adapted_copy(folder, my_project):
    """ddp_launch_train.py and common.py in `folder`, changed as the README says, with `my_project` beside them."""
    edits = readme_edits()
    assert 3 <= len(edits) <= 4, edits
    shutil.copy(os.path.join(ROOT, "common.py"), folder)
    script = open(os.path.join(ROOT, "ddp_launch_train.py")).read()
    for old, new in edits:
        old, new = old.rstrip(), new.rstrip()
        assert script.count(old) == 1, f"the README's line is not in the script: {old}"
        script = script.replace(old, new)
    assert "common.make_model" not in script and "common.load_data" not in script
    (folder / "train.py").write_text(script)
    (folder / "my_project.py").write_text(my_project)
    return str(folder / "train.py")


@pytest.mark.slow
@pytest.mark.floor
def test_a_copy_trains_your_own_dataset_and_model(tmp_path):
    out = tmp_path / "out"
    p = run(adapted_copy(tmp_path, MY_PROJECT), "--epochs", 3, "--batch-size", 16, "--lr", 0.05, "--out-dir", out,
            launcher="torchrun", nproc=2)
    rows = metrics(str(out))
    assert [r["val_count"] for r in rows] == [90] * 3, rows  # every validation sample once, over both ranks
    assert rows[-1]["val_acc"] > 0.9 and rows[-1]["train_loss"] < rows[0]["train_loss"], rows  # chance is 1/3
    model = checkpoint(str(out))["model"]
    assert model["net.5.weight"].shape == (3, 24) and "net.1.running_mean" in model  # 3 classes, from one pass
    assert "Traceback" not in p.stderr


# data as numpy gives it (float64 samples, int32 labels of shape (1,)) and a model that returns a dict of outputs
AS_THEY_COME = MY_PROJECT.replace("return x, int(self.y[i])", "return x.double().numpy(), self.y[i:i + 1].int().numpy()"
                                  ).replace("return self.net(x)", "return {'logits': self.net(x), 'features': x}")


def test_numpy_samples_labels_of_shape_1_and_a_dict_of_outputs_train(tmp_path):
    """What a copier's Dataset and model often look like: float64 numpy samples (made float32), labels as int32
    arrays of one element (made one int64 each), and outputs in a dict (its "logits"; a tuple: its first)."""
    out = tmp_path / "out"
    p = run(adapted_copy(tmp_path, AS_THEY_COME), "--epochs", 3, "--batch-size", 32, "--lr", 0.05, "--workers", 0,
            "--out-dir", out)
    rows = metrics(str(out))
    assert rows[-1]["val_acc"] > 0.9 and rows[-1]["val_count"] == 90, rows
    assert "Traceback" not in p.stderr


# a model with a layer that no step uses (a branch taken only sometimes, a head trained elsewhere)
UNUSED = MY_PROJECT.replace("nn.Linear(24, classes))", "nn.Linear(24, classes))\n        self.spare = nn.Linear(4, 4)")


@pytest.mark.slow
def test_a_model_that_leaves_parameters_unused_trains_with_find_unused_parameters(tmp_path):
    """DDP waits for every parameter's gradient: without the flag such a model fails at its second step, in one line
    that names the flag (DDP's own error names its keyword argument), exit 2 on every rank."""
    script = adapted_copy(tmp_path, UNUSED)
    args = ["--epochs", 1, "--batch-size", 16, "--max-steps", 3, "--out-dir", tmp_path / "out"]
    p = run(script, *args, launcher="torchrun", nproc=2, check=False)
    assert one_error_line(p, 2, 2).endswith("give --find-unused-parameters")
    run(script, *args, "--find-unused-parameters", "--overwrite", launcher="torchrun", nproc=2)
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


@pytest.mark.slow
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


def test_dataloader_workers_are_not_forked_from_the_training_process(tmp_path):
    """A worker forked from a process that runs other threads (gloo's, tqdm's) can deadlock at its start, and the
    run with it (python/cpython#112275). The workers start from a fork server instead: none is the trainer's child."""
    parents = tmp_path / "parents"
    run(adapted_copy(tmp_path, PARENTS), "--epochs", 1, "--batch-size", 16, "--max-steps", 4, "--workers", 2,
        "--out-dir", tmp_path / "out", env={"PARENTS_FILE": str(parents)})
    seen = parents.read_text().split()
    assert len(seen) >= 4 * 16 and set(seen) == {"False"}, seen[:8]


@pytest.mark.slow
def test_a_trainer_killed_outright_leaves_no_worker_behind(tmp_path):
    """SIGKILL (the OOM killer's) to a process paused at step 3 with its 2 DataLoader workers alive: the fork server
    they started from ends with it, and the workers with the server, within seconds; nothing of the run is left
    holding memory or its output. (Without leave_server they would all wait for each other forever.)"""
    from hooks import Hooks, Proc, clean_env
    hooks, token = Hooks(tmp_path, pause_at=3), f"killed-{os.getpid()}-{time.monotonic_ns()}"
    cmd = [sys.executable, adapted_copy(tmp_path, MY_PROJECT), "--epochs", 1, "--batch-size", 16, "--workers", 2,
           "--out-dir", tmp_path / "out"]
    proc = Proc(cmd, tmp_path / "log", env=clean_env(**hooks.env, TEST_RUN=token), cwd=tmp_path)

    def left():  # the processes of this run, the trainer's zombie aside
        return [pid for pid in started_by(token) if pid != proc.p.pid]
    try:
        proc.until(lambda: hooks.paused(), "the pause at step 3")
        assert len(left()) >= 3, left()  # the server and its 2 workers
        os.kill(proc.p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left() == [], f"still running 20 s after the trainer was killed: {left()}"
    finally:
        proc.kill()
        for pid in left():
            os.kill(pid, signal.SIGKILL)


# a Dataset holding a lambda: fine in this process, but not picklable, so not something a worker can be sent
A_LAMBDA = MY_PROJECT.replace("self.augment = split", "self.flip = lambda x: x.flip(-1)\n        self.augment = split"
                              ).replace("x = x.flip(-1)", "x = self.flip(x)")


@pytest.mark.slow
def test_a_dataset_the_workers_cannot_be_sent_is_one_line_printed_once(tmp_path):
    """--workers 2 under torchrun: one `error:` line naming what would not pickle and the way out, exit 2 on every
    rank; with --workers 0 the same Dataset trains."""
    script = adapted_copy(tmp_path, A_LAMBDA)
    args = ["--epochs", 1, "--batch-size", 16, "--max-steps", 2, "--out-dir", tmp_path / "out"]
    p = run(script, *args, launcher="torchrun", nproc=2, check=False)
    line = one_error_line(p, 2, nproc=2)
    assert "your Dataset cannot be sent to its --workers processes" in line and "lambda" in line, line
    assert line.endswith("or give --workers 0") and "Warning" not in p.stderr, p.stderr
    run(script, *args, "--workers", 0, launcher="torchrun", nproc=2)


# samples a Dataset should not return: a dict, three values, and one input of another size among 600
NOT_SAMPLES = {
    "a_dict": ("return x, int(self.y[i])", "return {'image': x, 'label': int(self.y[i])}",
               "your Dataset's __getitem__ returns a dict of ['image', 'label']: return two, (input, label)"),
    "three_values": ("return x, int(self.y[i])", "return x, int(self.y[i]), i",
                     "your Dataset's __getitem__ returns 3 values: return two, (input, label)"),
    "one_of_another_size": ("x = self.x[i]", "x = self.x[i] if i != 5 else self.x[i, :, :10, :10]",
                            "inputs of different sizes in one batch ((1, 10, 10), (1, 12, 12)): resize them"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case, how", [("a_dict", "torchrun"), ("three_values", "python"),
                                       ("one_of_another_size", "torchrun")])
def test_samples_that_cannot_train_are_one_line_printed_once(tmp_path, case, how):
    """Read by DataLoader workers (under torchrun, the default 2 per process) or in the process (--workers 0): one
    `error:` line saying what to return, exit 2. The dict and the three values: every rank finds them, rank 0 says
    so; the one odd input: the rank whose batch holds it."""
    old, new, line = NOT_SAMPLES[case]
    script = adapted_copy(tmp_path, MY_PROJECT.replace(old, new))
    args = ["--epochs", 1, "--batch-size", 16, "--out-dir", tmp_path / "out"] + ["--workers", 0] * (how == "python")
    p = run(script, *args, launcher=how, nproc=2 if how == "torchrun" else None, check=False)
    if case != "one_of_another_size":
        assert line in one_error_line(p, 2, nproc=2 if how == "torchrun" else None)
    else:  # the rank that found it exits 2, torchrun's root cause; the other is stopped by torchrun, or loses its peer
        errors = [e for e in p.stderr.splitlines() if e.startswith("error:")]
        assert len(errors) == 1 and line in errors[0], p.stderr[-3000:]
        assert p.returncode == 1 and list(worker_exit_codes(p.stderr.split("Root Cause")[-1]).values()) == [2]
    assert not os.path.exists(tmp_path / "out" / "last.pt")
    assert "Warning" not in p.stderr, p.stderr[-3000:]  # e.g. the resource tracker's, of the workers' queues
