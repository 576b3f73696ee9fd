"""The tiny core: one script plus common.py is what a copier carries. Each script, copied with common.py alone into an
empty folder and edited the way a copier would (the model and data lines swapped for the copier's own map-style
Dataset and nn.Module, with dropout, in a mine.py beside it), keeps every guarantee under 2 processes (dp_train.py in
one): it learns, a resume lands bit for bit where an unbroken run does, a NaN stops every rank at one step, a SIGTERM
saves at a step every rank agrees on, and an extra that was not copied (--dataset mnist) is one line and exit 2. The
copies of the launcher-started scripts run as 2 ranks started by hand (env://), ddp_spawn_train.py's by its own
mp.spawn; under torchrun itself: an extra not copied, a DataLoader worker that never answers, the Transformer.

Also: every script's default CPU run on a Python without the Linux-only APIs (simulated by a sitecustomize.py), and a
non-image model (a Transformer encoder over int64 tokens) trained through copied ddp_launch_train.py and
fsdp_train.py with --channels-last given (ignored: no images).

The moments are made exact by mine.py itself, through environment variables it reads: the copier's model makes the
loss NaN (MINE_NAN_AT), or sends its own process SIGTERM (MINE_SIGTERM_AT), in the forward of that training step on
rank MINE_RANK, and counts the training steps each rank began (MINE_STEPS_DIR): where every rank stopped."""
import difflib
import os
import re
import shutil
import time

import pytest

from conftest import assert_exit, assert_same_training, checkpoint, max_diff, metrics, worker_exit_codes
from processes import ROOT, TIMEOUT, alive, run
from test_budget import CARRIED

SCRIPTS = {  # script: how it is started with 2 processes (dp_train.py: its one process); ranks: by hand, env://
    "ddp_launch_train.py": "ranks",
    "ddp_spawn_train.py": "spawn",
    "ddp_amp_train.py": "ranks",
    "fsdp_train.py": "ranks",
    "dp_train.py": "python",
}
PROCESSES = {"torchrun": 2, "ranks": 2, "spawn": 2, "python": 1}

# ---- the copier's own data and model: a map-style Dataset of (float tensor, int label), no `classes` attribute, and
# an MLP with dropout (which draws from each rank's generator: a resume must restore them to be exact)
MINE = r'''
"""My own data and model."""
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Dataset


class Points(Dataset):
    """n points in 16 dimensions around 4 class centres."""

    def __init__(self, n, seed):
        centres = 1.5 * torch.randn(4, 16, generator=torch.Generator().manual_seed(1234))
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = centres[self.y] + torch.randn(n, 16, generator=g)
        self.loader = open  # an attribute that torchvision's ImageFolder also holds: not our batch loader

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if os.environ.get("MINE_WORKER_HANGS") and torch.utils.data.get_worker_info():
            open(os.path.join(os.environ["MINE_WORKER_HANGS"], str(os.getpid())), "w").close()
            time.sleep(3600)  # the test's hook: a DataLoader worker that never answers (its pid in that folder)
        return self.x[i], int(self.y[i])


def load_data(args):
    return Points(512, 1), Points(200, 2)  # (--train-size is train_extras/datasets.py's)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
        self.calls = 0

    def forward(self, x):
        out = self.body(x)
        if self.training:  # the test's hooks: the loss NaN, or SIGTERM to this process, at a training step
            self.calls += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if os.environ.get("MINE_STEPS_DIR"):  # the training steps this rank began
                with open(os.path.join(os.environ["MINE_STEPS_DIR"], f"rank{rank}"), "w") as f:
                    f.write(str(self.calls))
            if rank == int(os.environ.get("MINE_RANK", "0")):
                if self.calls == int(os.environ.get("MINE_NAN_AT", "0")):
                    out = out * float("nan")
                if self.calls == int(os.environ.get("MINE_SIGTERM_AT", "0")):
                    os.kill(os.getpid(), signal.SIGTERM)
                if self.calls == int(os.environ.get("MINE_GROUP_SIGTERM_AT", "0")):  # as `timeout` and a
                    os.killpg(os.getpgid(0), signal.SIGTERM)  # terminal do: its DataLoader workers too
        return out
'''

# ---- a non-image model: a 2-layer Transformer encoder over int64 tokens (with a `classes` attribute this time)
MINE_TEXT = r'''
"""My own data and model: sequences of int64 tokens; the class is the token sprinkled among random ones."""
import torch
import torch.nn as nn
from torch.utils.data import Dataset

LENGTH, VOCAB = 12, 32


class Tokens(Dataset):
    classes = ["zero", "one", "two"]

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
        marks = torch.rand(n, LENGTH, generator=g) < 0.3
        marks[torch.arange(n), torch.randint(0, LENGTH, (n,), generator=g)] = True
        self.x[marks] = self.y[:, None].expand(n, LENGTH)[marks]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def load_data(args):
    return Tokens(1024, 1), Tokens(256, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.position = nn.Parameter(0.02 * torch.randn(LENGTH, 32))
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, tokens):
        assert tokens.dtype == torch.int64 and tokens.ndim == 2, (tokens.dtype, tokens.shape)
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(1))
'''


# ---- a language model's tie: the head's weight is the embedding's (one parameter in two modules), and the model is
# smooth (tanh, no dropout), so that FSDP's and DDP's training differ by rounding only
MINE_TIED = MINE_TEXT.replace("class Net(nn.Module):", "class Encoder(nn.Module):") + '''

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)  # logits over the vocabulary: the classes are tokens 0-2
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens).mean(1))))
'''


# ---- uint8 inputs that are not images, from a Dataset with attributes of its own named as the built-in datasets'
# steps could be (`normalize`, `loader`): none is taken for one of them
MINE_UINT8 = MINE_TEXT.replace("        self.x[marks] = self.y[:, None].expand(n, LENGTH)[marks]\n",
                               "        self.x[marks] = self.y[:, None].expand(n, LENGTH)[marks]\n"
                               "        self.x, self.normalize, self.loader = self.x.to(torch.uint8), str.lower, open\n"
                               "        self.normalize_uint8 = None\n"
                               ).replace("tokens.dtype == torch.int64", "tokens.dtype == torch.uint8"
                                         ).replace("self.embed(tokens)", "self.embed(tokens.long())")


# ---- no validation set (an empty one: a run without one), from a Dataset whose attributes are named as the built-in
# datasets' steps are (batch_loader, set_epoch, normalize_uint8) but hold plain data: none is called
MINE_NO_VAL = MINE.replace("    return Points(512, 1), Points(200, 2)", "    return Points(512, 1), Points(0, 2)")
MINE_NO_VAL = MINE_NO_VAL.replace("        self.loader = open  #", "        self.batch_loader = None\n"
                                  "        self.set_epoch = self.normalize_uint8 = None\n        self.loader = open  #")
assert MINE_NO_VAL.count("Points(0, 2)") == 1 and MINE_NO_VAL.count("self.batch_loader = ") == 1


# ---- a tokenizer's batches: each sample's input a dict of input_ids and attention_mask, with a tuple of two more
# inputs inside (a namedtuple of float64 features, as numpy gives them, and the length; then the mask's width); the
# model takes the batch whole
MINE_DICT = r'''
"""My own data and model: dict inputs, as a tokenizer gives them, with tuples nested inside."""
import collections

import torch
import torch.nn as nn
from torch.utils.data import Dataset

LENGTH, VOCAB = 12, 32
Extra = collections.namedtuple("Extra", "features length")


class Tokenized(Dataset):
    classes = ["zero", "one", "two"]

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
        self.ids[torch.arange(n), torch.randint(0, LENGTH // 2, (n,), generator=g)] = self.y
        self.lengths = torch.randint(LENGTH // 2, LENGTH + 1, (n,), generator=g)
        self.features = torch.randn(n, 4, generator=g, dtype=torch.float64) + 2 * (torch.arange(4) == self.y[:, None])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        mask = (torch.arange(LENGTH) < self.lengths[i]).long()
        inputs = {"input_ids": self.ids[i] * mask, "attention_mask": mask,
                  "extra": (Extra(self.features[i].numpy(), self.lengths[i]), LENGTH)}
        return inputs, int(self.y[i])


def load_data(args):
    return Tokenized(512, 1), Tokenized(97, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.features = nn.Linear(4, 32)
        self.head = nn.Sequential(nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))

    def forward(self, batch):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        extra, width = batch["extra"]
        features, lengths = extra.features, extra.length  # (a namedtuple, still)
        assert ids.dtype == torch.int64 and features.dtype != torch.float64, (ids.dtype, features.dtype)
        assert mask.shape[1] == width[0], (mask.shape, width)
        pooled = (self.embed(ids) * mask[..., None]).sum(1) / lengths[:, None]
        return self.head(pooled + self.features(features))
'''

def swap_calls(source, name, replacement):
    """`source` with every call `name(...)` (its parentheses balanced) replaced by `replacement`, and how many."""
    count = 0
    while (start := source.find(name + "(")) >= 0:
        depth = 0
        for end in range(start + len(name), len(source)):
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            if depth == 0:
                break
        source, count = source[:start] + replacement + source[end + 1:], count + 1
    return source, count


def copy_alone(folder, script, mine=None):
    """`script`, common.py and failsafe.py alone in `folder` (made here, empty): what a copier carries; with `mine`, a
    copier's edit: mine.py beside them and the script's model and data lines swapped for its Net() and
    load_data(args). The edit must stay small."""
    folder.mkdir()
    for name in CARRIED:
        shutil.copy(os.path.join(ROOT, name), folder)
    source = open(os.path.join(ROOT, script)).read()
    if mine is not None:
        (folder / "mine.py").write_text(mine)
        edited, models = swap_calls(source, "common.make_model", "mine.Net()")
        edited, datas = swap_calls(edited, "common.load_data_rank0_first", "mine.load_data(args)")
        edited, alone = swap_calls(edited, "common.load_data", "mine.load_data(args)")  # dp_train.py's
        edited, imports = re.subn(r"^import common$", "import common\nimport mine", edited, flags=re.M)
        datas += alone
        assert (models, imports, datas) == (1, 1, 1), \
            f"{script}: {models} make_model calls, {datas} load_data calls, {imports} `import common` lines"
        changed = [line for line in difflib.unified_diff(source.splitlines(), edited.splitlines(), lineterm="", n=0)
                   if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        assert len(changed) <= 7, f"{script}: swapping the model and data is not a small edit:\n" + "\n".join(changed)
        source = edited
    (folder / script).write_text(source)
    assert sorted(os.listdir(folder)) == sorted([*CARRIED, script] + (["mine.py"] if mine else []))
    return folder


def launch(folder, script, *args, how="python", env=None, unset=(), timeout=TIMEOUT):
    """`script` in `folder` (its working directory, and the only place its imports come from): plain python,
    `--nprocs 2` (spawn), 2 ranks started by hand, or torchrun with 2 processes. The environment is clean_env's plus
    `env`, less the variables `unset`."""
    launcher = {"spawn": "python", "python": "python", "ranks": "ranks", "torchrun": "torchrun"}[how]
    nproc = {"spawn": 2, "python": None, "ranks": 2, "torchrun": 2}[how]
    env = {**(env or {}), **{name: None for name in unset}}
    return run(script, *args, launcher=launcher, nproc=nproc, env=env, cwd=folder, check=False, timeout=timeout)


def ok(p):
    assert p.returncode == 0, f"{' '.join(p.args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def tracebacks(p):
    """A Python traceback of the script's own processes (torchrun's own ChildFailedError report is not one)."""
    output = p.stdout + p.stderr
    if "torch.distributed.run" in p.args:
        return re.findall(r"^\[rank\d+\]:? ?Traceback", output, re.M)
    return re.findall(r"^Traceback", output, re.M)


def error_lines(p):
    return [line for line in (p.stdout + p.stderr).splitlines() if re.match(r"(\[rank\d+\]:? ?)?error: ", line)]


# ---- 1. copied alone, with the copier's own Dataset and model
# 512 samples; global batch 32 (16 per process, 32 in dp's one): 16 steps an epoch, 2 epochs. The data is read in
# each process (--workers 0), but for the run of test_..._it_learns_..., which reads it with the default 2 workers
# per process: ddp_spawn_train.py's children start theirs with the `spawn` method, anew for each loader and epoch,
# which takes minutes on a busy 2-core machine
TINY = ["--epochs", 2, "--lr", 0.05]
STEPS_PER_EPOCH, STEPS = 16, 32


def flags(script, workers=0):
    return [*TINY, "--batch-size", 32 // PROCESSES[SCRIPTS[script]]] + (["--workers", workers] if workers != 2 else [])


def steps_taken(folder):
    """{rank: training steps it began}, as mine.py counted them (MINE_STEPS_DIR)."""
    return {int(f.name[4:]): int(f.read_text()) for f in folder.glob("rank*")}


def position(ckpt):
    return ckpt["epoch"] * STEPS_PER_EPOCH + ckpt["step_in_epoch"]


@pytest.fixture(scope="module")
def mine_copy(tmp_path_factory):
    """get(script): a folder holding the script (edited to use mine.py), common.py and mine.py; made once."""
    made = {}

    def get(script):
        if script not in made:
            made[script] = copy_alone(tmp_path_factory.mktemp("copy") / "project", script, MINE)
        return made[script]
    return get


# DataLoader workers where the processes start another way: the default 2 in one process and in ranks started by hand;
# 1 in mp.spawn's children, whose workers start by `spawn` and import mine.py anew (seconds each, every loader); the
# scripts started alike (ddp_amp, fsdp) read the data in the process. Forked workers on this Python (3.11.7,
# without train_extras/workers.py) may rarely deadlock (python/cpython#112275): 24 forked starts in all here
WORKERS = {"dp_train.py": 2, "ddp_launch_train.py": 2, "ddp_spawn_train.py": 1, "ddp_amp_train.py": 0,
           "fsdp_train.py": 0}


@pytest.fixture(scope="module")
def unbroken(mine_copy, tmp_path_factory):
    """get(script): (its process, its out dir): one unbroken 2-epoch run of the copy, with WORKERS; made once. The
    runs compared with it read the data in the process (--workers 0): bit for bit the same training."""
    made = {}

    def get(script):
        if script not in made:
            out = tmp_path_factory.mktemp("unbroken")
            p = ok(launch(mine_copy(script), script, *flags(script, WORKERS[script]), "--out-dir", out,
                          how=SCRIPTS[script]))
            made[script] = p, out
        return made[script]
    return get


@pytest.mark.parametrize("script", [*(s for s in SCRIPTS if s != "ddp_spawn_train.py"),
                                    pytest.param("ddp_spawn_train.py", marks=pytest.mark.full)])
def test_copied_alone_with_my_dataset_and_model_it_learns_and_rank_0_logs_once(script, unbroken):
    """My Dataset read by DataLoader workers (WORKERS), my model learns; rank 0 alone writes and prints."""
    p, out = unbroken(script)
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2], rows  # one row per epoch: written by rank 0 alone
    assert [r["step"] for r in rows] == [STEPS_PER_EPOCH, STEPS]
    assert all(r["val_count"] == 200 for r in rows), rows  # every validation sample once
    assert rows[-1]["val_acc"] > 0.6, rows  # chance is 0.25
    assert rows[-1]["train_loss"] < rows[0]["train_loss"], rows
    assert len(re.findall(r"^epoch 2 ", p.stdout, re.M)) == 1, p.stdout  # printed once, not once per process
    assert not tracebacks(p), p.stderr[-3000:]
    assert position(checkpoint(str(out))) == STEPS


@pytest.mark.parametrize("script", ["ddp_launch_train.py", "fsdp_train.py",
                                    *(pytest.param(s, marks=pytest.mark.full) for s in SCRIPTS
                                      if s not in ("ddp_launch_train.py", "fsdp_train.py"))])
def test_copied_alone_without_a_validation_set_it_trains_and_logs_no_validation_figures(script, tmp_path):
    """An empty validation set (Points(0)), and Dataset attributes named batch_loader, set_epoch and normalize_uint8
    that are None: every script trains both epochs, each row has no validation figures (val_count 0), the epoch's
    line shows none, and no process fails (FSDP on 2 ranks runs no forward for it)."""
    out = tmp_path / "out"
    folder = copy_alone(tmp_path / "project", script, MINE_NO_VAL)
    p = ok(launch(folder, script, *flags(script), "--out-dir", out, how=SCRIPTS[script]))
    assert [(r["val_loss"], r["val_acc"], r["val_count"]) for r in metrics(out)] == [(None, None, 0)] * 2
    lines = re.findall(r"^epoch \d .*$", p.stdout, re.M)
    assert len(lines) == 2 and not any("val_" in line for line in lines), p.stdout[-2000:]
    assert not tracebacks(p) and not error_lines(p), p.stderr[-3000:]


@pytest.mark.parametrize("script", [pytest.param("ddp_launch_train.py", marks=pytest.mark.floor),
                                    *(pytest.param(s, marks=pytest.mark.full) for s in SCRIPTS
                                      if s != "ddp_launch_train.py")])
def test_copied_alone_a_resume_mid_epoch_ends_bit_for_bit_where_an_unbroken_run_does(script, mine_copy, unbroken,
                                                                                      tmp_path):
    """--max-steps 21 (mid-epoch 2), then --resume auto to the end: the weights, the optimizer state (momentum) and
    the validation numbers equal the unbroken run's exactly. Dropout draws differ unless every rank's generator is
    restored."""
    folder, how, out = mine_copy(script), SCRIPTS[script], tmp_path / "run"
    ok(launch(folder, script, *flags(script), "--out-dir", out, "--max-steps", 21, how=how))
    assert position(checkpoint(str(out))) == 21
    p = ok(launch(folder, script, *flags(script), "--out-dir", out, "--resume", "auto", how=how))
    assert "resuming at step 21" in p.stdout, p.stdout[-3000:]
    resumed, reference = checkpoint(str(out)), checkpoint(str(unbroken(script)[1]))
    assert position(resumed) == STEPS
    assert max_diff(resumed["model"], reference["model"]) == 0
    assert max_diff(resumed["optimizer"], reference["optimizer"]) == 0
    last, expected = metrics(out)[-1], metrics(unbroken(script)[1])[-1]
    assert (last["epoch"], last["val_loss"], last["val_acc"]) == (expected["epoch"], expected["val_loss"],
                                                                  expected["val_acc"])


@pytest.mark.parametrize("script", ["ddp_launch_train.py", pytest.param("ddp_spawn_train.py", marks=pytest.mark.full),
                                    pytest.param("dp_train.py", marks=pytest.mark.full)])
def test_copied_alone_a_nan_loss_on_one_rank_stops_every_rank_at_one_step_with_one_line(script, mine_copy, tmp_path):
    """The loss NaN at step 3 on the last rank only: every process exits 1, one `error:` line names step 3, and no
    checkpoint was written after it (the first save is at step 16). Under torchrun, mp.spawn and one process;
    ddp_amp_train.py and fsdp_train.py stop in the same lines (tests/test_drift.py)."""
    how, out = SCRIPTS[script], tmp_path / "run"
    p = launch(mine_copy(script), script, *flags(script), "--out-dir", out, how=how,
               env={"MINE_NAN_AT": "3", "MINE_RANK": str(PROCESSES[how] - 1), "MINE_STEPS_DIR": str(tmp_path)})
    assert_exit(p, 1, nproc=2 if how == "torchrun" else None)
    taken = steps_taken(tmp_path)
    assert len(taken) == PROCESSES[how] and len(set(taken.values())) == 1 and 3 <= taken[0] <= STEPS_PER_EPOCH, taken
    lines = error_lines(p)
    assert len(lines) == 1 and "NaN" in lines[0] and "step 3" in lines[0], p.stdout[-2000:] + p.stderr[-4000:]
    assert not tracebacks(p), p.stderr[-4000:]
    assert not (out / "last.pt").exists()
    assert not os.path.exists(out / "metrics.jsonl") or metrics(out) == []


@pytest.mark.parametrize("script", ["ddp_launch_train.py", *(pytest.param(s, marks=pytest.mark.full) for s in SCRIPTS
                                                              if s != "ddp_launch_train.py")])
def test_copied_alone_sigterm_to_one_rank_saves_at_an_agreed_step_exits_143_and_the_resume_is_exact(
        script, mine_copy, unbroken, tmp_path):
    """SIGTERM to the last rank in its 7th training step (to the one process of dp_train.py): every rank stops at
    one step N >= 7, whose checkpoint was saved (`stopped by SIGTERM at step N`, last.pt at N); the exit status is
    143 (under torchrun: each worker's); --resume auto from it ends exactly where the unbroken run does."""
    folder, how, out = mine_copy(script), SCRIPTS[script], tmp_path / "run"
    p = launch(folder, script, *flags(script), "--out-dir", out, how=how,
               env={"MINE_SIGTERM_AT": "7", "MINE_RANK": str(PROCESSES[how] - 1), "MINE_STEPS_DIR": str(tmp_path)})
    assert_exit(p, 143, nproc=2 if how == "torchrun" else None)
    output = p.stdout + p.stderr
    steps = [int(s) for s in re.findall(r"stopped by SIGTERM at step (\d+)", output)]
    assert len(steps) == 1 and 7 <= steps[0] < STEPS, output[-4000:]  # said once, by rank 0
    assert steps_taken(tmp_path) == {rank: steps[0] for rank in range(PROCESSES[how])}  # where every rank stopped
    assert not tracebacks(p) and not error_lines(p), output[-4000:]
    assert position(checkpoint(str(out))) == steps[0]  # saved there, after the signal
    p = ok(launch(folder, script, *flags(script), "--out-dir", out, "--resume", "auto", how=how))
    assert f"resuming at step {steps[0]}" in p.stdout, p.stdout[-3000:]
    resumed, reference = checkpoint(str(out)), checkpoint(str(unbroken(script)[1]))
    assert max_diff(resumed["model"], reference["model"]) == 0
    assert max_diff(resumed["optimizer"], reference["optimizer"]) == 0


def test_a_copy_without_failsafe_py_stops_at_its_first_line_naming_it(tmp_path):
    """What a copier carries is common.py and failsafe.py: without failsafe.py, the script stops at its start, the
    error naming the file; nothing is written."""
    folder = copy_alone(tmp_path / "project", "ddp_launch_train.py")
    os.remove(folder / "failsafe.py")
    p = launch(folder, "ddp_launch_train.py", "--out-dir", tmp_path / "run")
    assert p.returncode == 1 and "No module named 'failsafe'" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run").exists()


LAUNCHED = {  # another launcher's variables, as it sets them: train_extras/launchers.py's to read
    "mpirun": {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"},
    "srun": {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "node1", "SLURM_JOB_ID": "7"},
    "a Kubernetes pod": {"RANK": "0", "WORLD_SIZE": "1"},  # no LOCAL_RANK
}


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_a_copy_without_train_extras_launchers_py_refuses_another_launcher_in_one_line(launcher, tmp_path):
    """A script and its core copied without train_extras/: a process that srun, mpirun or a Kubernetes pod started
    stops at once with one line naming train_extras/launchers.py, exit 2, nothing written; so does the old
    launcher's --local-rank flag. With launchers.py (the checkout), the same process trains."""
    folder = copy_alone(tmp_path / "project", "ddp_launch_train.py")
    p = launch(folder, "ddp_launch_train.py", *TINY, "--out-dir", tmp_path / "run", env=LAUNCHED[launcher])
    assert_exit(p, 2)
    assert error_lines(p) == ["error: a launch by srun, mpirun, mpiexec or a Kubernetes pod (RANK without LOCAL_RANK) "
                              "needs train_extras/launchers.py (and its __init__.py): copy them"], p.stderr[-3000:]
    p = launch(folder, "ddp_launch_train.py", "--local-rank=0", "--out-dir", tmp_path / "run")
    assert_exit(p, 2)
    assert error_lines(p)[0].startswith("error: unrecognized arguments: --local-rank=0 (a flag of "
                                        "train_extras/launchers.py: copy it and its __init__.py)"), p.stderr
    assert not (tmp_path / "run").exists()
    p = run("ddp_launch_train.py", *TINY, "--max-steps", 2, "--out-dir", tmp_path / "run", env=LAUNCHED[launcher])
    assert f"started by {'env:// (no LOCAL_RANK' if launcher.startswith('a K') else launcher}" in p.stdout, p.stdout


@pytest.mark.workers
@pytest.mark.full
@pytest.mark.parametrize("script", ["dp_train.py", "ddp_launch_train.py"])
def test_copied_alone_sigterm_to_a_ranks_process_group_with_forked_workers_saves_and_the_resume_is_exact(
        script, mine_copy, unbroken, tmp_path):
    """SIGTERM to the process group of the last rank (its DataLoader workers, forked as torch starts them where
    train_extras/workers.py is not copied, included) in its 7th training step: the workers ignore it, every rank
    saves at one agreed step, exits 143 without a traceback, and the resume ends where the unbroken run does."""
    folder, how, out = mine_copy(script), SCRIPTS[script], tmp_path / "run"
    p = launch(folder, script, *flags(script, WORKERS[script]), "--out-dir", out, how=how,
               env={"MINE_GROUP_SIGTERM_AT": "7", "MINE_RANK": str(PROCESSES[how] - 1)})
    assert_exit(p, 143)
    output = p.stdout + p.stderr
    steps = [int(s) for s in re.findall(r"stopped by SIGTERM at step (\d+)", output)]
    assert len(steps) == 1 and 7 <= steps[0] < STEPS and not tracebacks(p), output[-4000:]
    assert position(checkpoint(str(out))) == steps[0]
    ok(launch(folder, script, *flags(script, WORKERS[script]), "--out-dir", out, "--resume", "auto", how=how))
    resumed, reference = checkpoint(str(out)), checkpoint(str(unbroken(script)[1]))
    assert max_diff(resumed["model"], reference["model"]) == 0
    assert max_diff(resumed["optimizer"], reference["optimizer"]) == 0


@pytest.mark.parametrize("script", [pytest.param("ddp_launch_train.py", marks=pytest.mark.full), "dp_train.py"])
def test_copied_alone_an_extra_not_copied_is_one_line_and_exit_2(script, tmp_path):
    """No train_extras/ beside the script (nor the copier's data: the default is the built-in synthetic set): one
    line naming train_extras/datasets.py, exit 2 (under torchrun: every worker's), no traceback; its flags are not
    the script's (--dataset: argparse's one line), and --help does not list them. (Every script calls
    common.load_data alike: tests/test_drift.py.)"""
    folder, how = copy_alone(tmp_path / "project", script), {"ddp_launch_train.py": "torchrun"}.get(script, "python")
    p = launch(folder, script, "--out-dir", tmp_path / "run", how=how)
    assert_exit(p, 2, nproc=2 if how == "torchrun" else None)
    lines = error_lines(p)
    assert len(lines) == 1 and "the built-in data needs train_extras/datasets.py" in lines[0], \
        p.stdout[-2000:] + p.stderr[-4000:]
    assert not tracebacks(p), p.stderr[-4000:]
    p = launch(folder, script, "--dataset", "mnist", "--out-dir", tmp_path / "run")
    assert_exit(p, 2)
    assert error_lines(p)[0].startswith("error: unrecognized arguments: --dataset mnist (a flag of "
                                        "train_extras/datasets.py: copy it and its __init__.py)"), p.stderr
    help_text = launch(folder, script, "--help").stdout
    assert "--epochs" in help_text and "--dataset" not in help_text and "--tensorboard" not in help_text, help_text
    assert not (tmp_path / "run").exists()


@pytest.mark.workers
@pytest.mark.full
@pytest.mark.parametrize("script", ["dp_train.py", "ddp_launch_train.py"])
def test_copied_alone_a_dataloader_worker_that_never_answers_ends_the_run_in_one_line_exit_3(script, mine_copy,
                                                                                            tmp_path):
    """Every DataLoader worker of the copier's Dataset sleeps forever in its first sample (a deadlock, a stuck network
    read): at the first batch of the run, in one process (dp_train.py) and under torchrun (every worker), the run ends
    after --step-timeout seconds with one `error:` line and exit 3, and no process is left. Under torchrun with
    train_extras/hangs.py copied too, which must leave a DataLoader's timeout alone (not "rank N never arrived")."""
    how, out, folder = {"ddp_launch_train.py": "torchrun"}.get(script, "python"), tmp_path / "run", mine_copy(script)
    if how == "torchrun":
        folder = shutil.copytree(folder, tmp_path / "project")
        (folder / "train_extras").mkdir()
        for name in ("__init__.py", "hangs.py"):
            shutil.copy(os.path.join(ROOT, "train_extras", name), folder / "train_extras")
    t, hung = time.monotonic(), tmp_path / "hung"
    hung.mkdir()
    p = launch(folder, script, *flags(script, workers=2), "--step-timeout", 5, "--out-dir", out, how=how,
               env={"MINE_WORKER_HANGS": str(hung)}, timeout=120)
    if how == "torchrun":  # the rank whose wait runs out first exits 3; the other too, or stops on torchrun's SIGTERM
        codes = worker_exit_codes(p.stderr)
        assert p.returncode == 1 and 3 in codes.values() and set(codes.values()) <= {3, 143}, p.stderr[-3000:]
    else:
        assert_exit(p, 3)
    lines = error_lines(p)  # each rank that timed out says so, once
    assert 1 <= len(lines) <= PROCESSES[how] and not tracebacks(p), p.stderr[-3000:]
    assert all("DataLoader timed out after 5.0 seconds (--step-timeout)" in line for line in lines), p.stderr[-3000:]
    assert time.monotonic() - t < 60 and not (out / "last.pt").exists()
    # the stuck workers ignore SIGTERM, as every worker does (a job's stop is the trainer's): the trainer kills them
    pids = [int(f.name) for f in hung.iterdir()]
    while any(alive(pid) for pid in pids) and time.monotonic() - t < 65:
        time.sleep(0.1)
    assert pids and not any(alive(pid) for pid in pids), f"DataLoader workers outlived their trainer: {pids}"


# ---- 2. a Python without the Linux-only APIs
NOT_LINUX = r'''
"""A Python without Linux's os.sched_getaffinity, fcntl, resource, SIGUSR1/SIGUSR2/SIGHUP/SIGQUIT and
faulthandler.register. torchrun itself is left whole: the simulation is of the scripts' processes."""
import faulthandler
import os
import signal
import sys

if "torch.distributed.run" not in sys.orig_argv:
    del os.sched_getaffinity
    sys.modules["fcntl"] = sys.modules["resource"] = None  # `import fcntl` raises ImportError
    for _name in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"):
        delattr(signal, _name)
    del faulthandler.register
'''

SIMULATION_CHECK = r'''
import faulthandler, os, signal
for name in ("fcntl", "resource"):
    try:
        __import__(name)
        raise SystemExit(f"{name} imported")
    except ImportError:
        pass
assert not hasattr(os, "sched_getaffinity")
assert not any(hasattr(signal, s) for s in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"))
assert not hasattr(faulthandler, "register")
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
ds = TensorDataset(torch.arange(40.0), torch.arange(40))
assert sum(int(y.sum()) for _, y in DataLoader(ds, batch_size=4, num_workers=2)) == 780
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.destroy_process_group()
print("simulated", t.tolist())
'''


@pytest.fixture
def not_linux(tmp_path):
    """The environment variables of the simulation: its sitecustomize.py first on PYTHONPATH."""
    site = tmp_path / "not_linux"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOT_LINUX)
    return {"PYTHONPATH": str(site)}


@pytest.mark.full
def test_the_simulation_removes_the_linux_apis_and_torch_still_runs(not_linux, tmp_path):
    (tmp_path / "check.py").write_text(SIMULATION_CHECK)
    p = launch(tmp_path, "check.py", env=not_linux, unset=["OMP_NUM_THREADS"])
    assert p.returncode == 0 and "simulated [1.0, 1.0, 1.0]" in p.stdout, p.stdout + p.stderr[-3000:]
    plain = launch(tmp_path, "check.py")  # and without it, the check fails: it tests something
    assert plain.returncode != 0 and "imported" in plain.stderr, plain.stdout + plain.stderr[-3000:]


DEFAULT_CPU = ["--train-size", 256, "--val-size", 64, "--epochs", 1]  # small, the other flags their defaults


@pytest.mark.full
@pytest.mark.parametrize("script, how", [("dp_train.py", "python"), ("ddp_spawn_train.py", "spawn"),
                                         ("fsdp_train.py", "python"), ("ddp_launch_train.py", "torchrun")])
def test_a_default_cpu_run_works_without_the_linux_only_apis_nor_omp_num_threads(script, how, not_linux, tmp_path):
    """Each way the processes start: dp_train.py and fsdp_train.py alone (plain python), spawn's default processes (no
    --nprocs), a 2-process torchrun. The Linux-only calls are common.py's, which every script shares (the DDP
    scripts' lines alike: tests/test_drift.py)."""
    out = tmp_path / "run"
    p = launch(ROOT, script, *DEFAULT_CPU, "--out-dir", out, how="torchrun" if how == "torchrun" else "python",
               env=not_linux, unset=["OMP_NUM_THREADS"])
    ok(p)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr[-4000:]
    assert [r["epoch"] for r in metrics(out)] == [1]
    assert checkpoint(str(out))["epoch"] == 1


# ---- 3. a non-image model, trained unchanged
@pytest.mark.full
@pytest.mark.parametrize("script", ["ddp_launch_train.py", "fsdp_train.py"])
def test_a_transformer_over_int64_tokens_trains_through_a_copied_script_with_channels_last_ignored(script,
                                                                                                   tmp_path):
    folder = copy_alone(tmp_path / "project", script, MINE_TEXT)
    out = tmp_path / "run"
    p = ok(launch(folder, script, "--epochs", 2, "--batch-size", 16,
                  "--optimizer", "adamw", "--lr", 0.003, "--channels-last", "--workers", 0, "--out-dir", out,
                  how="torchrun"))
    assert not tracebacks(p), p.stderr[-3000:]
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["val_count"] == 256, rows
    assert rows[-1]["val_acc"] > 0.6, rows  # chance is 1/3
    assert checkpoint(str(out))["model"]["embed.weight"].shape == (32, 32)



@pytest.mark.full
def test_a_model_with_tied_weights_trains_under_fsdp_to_ddps_weights_and_resumes_bit_for_bit_in_both_formats(
        tmp_path, measured):
    """A language model's tie (mine.py's Net: its head's weight is its embedding's): fsdp_train.py keeps the shared
    parameter in the root's group (in two groups fully_shard refuses it), trains to DDP's weights within TOL, and
    --max-steps 40 then --resume auto ends bit for bit where its unbroken run does, with last.pt and with
    ckpt-<step> folders (train_extras/sharded.py)."""
    ddp = copy_alone(tmp_path / "ddp", "ddp_launch_train.py", MINE_TIED)
    fsdp = copy_alone(tmp_path / "fsdp", "fsdp_train.py", MINE_TIED)
    (fsdp / "train_extras").mkdir()
    for name in ("__init__.py", "sharded.py"):
        shutil.copy(os.path.join(ROOT, "train_extras", name), fsdp / "train_extras")
    args = ["--epochs", 2, "--batch-size", 16, "--lr", 0.1, "--workers", 0]  # 32 steps an epoch
    ok(launch(ddp, "ddp_launch_train.py", *args, "--out-dir", tmp_path / "ddp_run", how="ranks"))
    ok(launch(fsdp, "fsdp_train.py", *args, "--out-dir", tmp_path / "fsdp_run", how="ranks"))
    assert checkpoint(str(tmp_path / "fsdp_run"))["model"].keys() >= {"embed.weight", "head.weight"}
    assert_same_training(tmp_path / "fsdp_run", tmp_path / "ddp_run", measured, "tied weights, FSDP against DDP")
    assert metrics(tmp_path / "fsdp_run")[-1]["val_acc"] > 0.6  # chance is 1/3
    unbroken = checkpoint(str(tmp_path / "fsdp_run"))
    for formats in ([], ["--ckpt-format", "dcp"]):
        out = tmp_path / f"resumed{len(formats)}"
        ok(launch(fsdp, "fsdp_train.py", *args, *formats, "--max-steps", 40, "--out-dir", out, how="ranks"))
        p = ok(launch(fsdp, "fsdp_train.py", *args, *formats, "--resume", "auto", "--out-dir", out, how="ranks"))
        assert "resuming at step 40" in p.stdout, p.stdout[-3000:]
        final = checkpoint(str(out)) if not formats else sharded_final(out, tmp_path)
        assert max_diff(final["model"], unbroken["model"]) == 0
        assert max_diff(final["optimizer"], unbroken["optimizer"]) == 0


# ---- a child that ends in nn.Flatten (a view of its input): FSDP2 warns of in-place ops on its output
MINE_FLATTEN = MINE.replace(
    "        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))",
    "        self.features = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(),\n"
    "                                      nn.Flatten())\n"
    "        self.body = nn.Linear(128, 4)").replace("        out = self.body(x)",
                                                 "        out = self.body(self.features(x))")
assert MINE_FLATTEN.count("nn.Flatten()") == MINE_FLATTEN.count("self.body(self.features(x))") == 1
VIEW_WARNING = "returned a view tensor"


@pytest.mark.full
def test_fsdp_trains_a_child_that_ends_in_flatten_as_ddp_does_and_torch_warns_once_a_rank(tmp_path, measured):
    """docs/fsdp.md: torch's FSDP2 warns, once on each rank, that the child returned a view tensor (an in-place op
    on it would skip the all-gather); the run trains as DDP does all the same. With the flatten moved to the
    parent's forward (torch.flatten(x, 1)), nothing is said."""
    args = ["--epochs", 1, "--batch-size", 16, "--lr", 0.05, "--workers", 0]
    runs = {}
    for script in ("ddp_launch_train.py", "fsdp_train.py"):
        folder = copy_alone(tmp_path / script[:4], script, MINE_FLATTEN)
        runs[script] = ok(launch(folder, script, *args, "--out-dir", tmp_path / f"{script[:4]}_run", how="ranks"))
    assert_same_training(tmp_path / "fsdp_run", tmp_path / "ddp__run", measured, "a child ending in Flatten, FSDP "
                         "against DDP")
    assert runs["fsdp_train.py"].stderr.count(VIEW_WARNING) == 2, runs["fsdp_train.py"].stderr[-3000:]
    moved = MINE_FLATTEN.replace("nn.Tanh(),\n                                      nn.Flatten())", "nn.Tanh())")
    moved = moved.replace("self.body(self.features(x))", "self.body(torch.flatten(self.features(x), 1))")
    assert moved.count("nn.Flatten") == 0 and moved.count("torch.flatten") == 1
    folder = copy_alone(tmp_path / "moved", "fsdp_train.py", moved)
    p = ok(launch(folder, "fsdp_train.py", *args, "--out-dir", tmp_path / "moved_run", how="ranks"))
    assert VIEW_WARNING not in p.stderr, p.stderr[-3000:]


def sharded_final(out, tmp_path):
    """The highest ckpt-<step> folder in `out`, made one file and read."""
    from train_extras.sharded import to_file
    step = max(int(p.name[5:]) for p in out.glob("ckpt-*") if p.name[5:].isdigit())
    to_file(str(out / f"ckpt-{step}"), str(tmp_path / "final.pt"))
    return checkpoint(str(tmp_path / "final.pt"))


@pytest.mark.full
def test_a_datasets_own_normalize_attribute_is_not_taken_for_the_built_in_datasets_step(tmp_path):
    """uint8 tokens from a Dataset that holds a `normalize` of its own (a callable for its text, str.lower) and
    `loader = open`: trained as they are, neither called."""
    folder, out = copy_alone(tmp_path / "project", "ddp_launch_train.py", MINE_UINT8), tmp_path / "run"
    assert "self.normalize" in (folder / "mine.py").read_text()
    p = ok(launch(folder, "ddp_launch_train.py", "--epochs", 2, "--batch-size", 16, "--optimizer", "adamw", "--lr",
                  0.003, "--workers", 0, "--out-dir", out))
    assert not tracebacks(p) and metrics(out)[-1]["val_acc"] > 0.6, p.stderr[-3000:]


@pytest.mark.full
def test_a_sample_that_is_a_dict_with_its_label_inside_is_one_line_saying_what_a_sample_must_be(tmp_path):
    """A Hugging Face-style row, {"input_ids": ..., "label": ...}, not (x, label): one `error:` line, exit 2."""
    mine = MINE_TEXT.replace("        return self.x[i], int(self.y[i])",
                             '        return {"input_ids": self.x[i], "label": int(self.y[i])}')
    folder = copy_alone(tmp_path / "project", "ddp_launch_train.py", mine)
    p = launch(folder, "ddp_launch_train.py", "--epochs", 1, "--workers", 0, "--out-dir", tmp_path / "run")
    assert_exit(p, 2)
    assert error_lines(p) == ["error: a batch unpacked to (str, str): a sample must be a pair (x, label), x a tensor "
                              "or a dict, list or tuple of them"] and not tracebacks(p), p.stderr[-3000:]


# ---- 4. batches of any structure
@pytest.mark.parametrize("script, more", [
    ("ddp_launch_train.py", []),
    pytest.param("dp_train.py", [], marks=pytest.mark.full),
    pytest.param("ddp_amp_train.py", [], marks=pytest.mark.full),  # bf16 autocast
    pytest.param("fsdp_train.py", ["--precision", "bf16"], marks=pytest.mark.full)])  # its inputs cast to bf16
def test_a_tokenizers_dict_batches_train_through_a_copied_script_and_resume_bit_for_bit(script, more, tmp_path):
    """A Dataset whose inputs are dicts with a tuple inside (mine.py's Tokenized), read by 2 DataLoader workers, with
    --grad-accum 2 (the micro-batches split each tensor inside) and 97 validation samples (FSDP's rank 1 pads its
    evaluation with a batch of one sample): it learns, and --max-steps 21 then --resume auto ends bit for bit where
    the unbroken run does."""
    folder, how = copy_alone(tmp_path / "project", script, MINE_DICT), SCRIPTS[script]
    args = [*TINY, "--batch-size", 16 // PROCESSES[how], "--grad-accum", 2, "--workers", 2, *more]
    unbroken, resumed = tmp_path / "unbroken", tmp_path / "resumed"
    p = ok(launch(folder, script, *args, "--out-dir", unbroken, how=how))
    assert not tracebacks(p), p.stderr[-3000:]
    rows = metrics(unbroken)
    assert [r["step"] for r in rows] == [STEPS_PER_EPOCH, STEPS] and rows[-1]["val_count"] == 97, rows
    assert rows[-1]["val_acc"] > 0.6, rows  # chance is 1/3
    ok(launch(folder, script, *args, "--out-dir", resumed, "--max-steps", 21, how=how))
    p = ok(launch(folder, script, *args, "--out-dir", resumed, "--resume", "auto", how=how))
    assert "resuming at step 21" in p.stdout, p.stdout[-3000:]
    assert max_diff(checkpoint(str(resumed))["model"], checkpoint(str(unbroken))["model"]) == 0
    assert max_diff(checkpoint(str(resumed))["optimizer"], checkpoint(str(unbroken))["optimizer"]) == 0
