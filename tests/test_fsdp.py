"""fsdp_train.py end to end on CPU/gloo. It trains exactly like ddp_launch_train.py (same weights, same validation
numbers) at 1, 2 and 3 processes, BatchNorm included; each rank holds 1/N of the parameters, gradients and optimizer
state; last.pt moves between FSDP and DDP runs of other sizes; sharded checkpoints (ckpt-<step> folders) reshard
between process counts and HSDP, and reach DDP through `python -m train_extras.sharded`; bf16 learns as well as fp32;
bad input stops every rank with one line. The ranks are started by hand (env://): torchrun's part is
tests/test_scripts.py's and tests/test_signals.py's. Runs are shared: the proof runs of conftest.SHARED, and this
module's own (made once)."""
import argparse
import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

import common
from conftest import (PROOF, STEPS_PER_EPOCH, assert_exit, assert_same_training, checkpoint, max_diff, metrics,
                      per_process)
from processes import ROOT, run, start_ranks
from train_extras import models
from train_extras.sharded import to_file

FSDP, DDP = "fsdp_train.py", "ddp_launch_train.py"
# BatchNorm: resnet18 on the 28x28 synthetic data, 3 steps of global batch 16; 33 validation samples: padding again
RESNET = ["--model", "resnet18", "--train-size", 48, "--val-size", 33, "--epochs", 1]


def launch(script, nproc, args, check=True):
    """One process: plain `python script`; more: ranks started by hand (ddp_spawn_train.py: its own --nprocs)."""
    if nproc == 1 or script == "ddp_spawn_train.py":
        return run(script, *args, check=check, nproc=nproc if script == "ddp_spawn_train.py" else None)
    return run(script, *args, launcher="ranks", nproc=nproc, check=check)


class Run:
    def __init__(self, out_dir, proc=None):
        self.dir, self.proc, self.last_pt = str(out_dir), proc, os.path.join(out_dir, "last.pt")
        self.rows, self.ckpt = metrics(out_dir), checkpoint(self.last_pt)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name, script, nproc, *args): that training run, made once per module."""
    base, done = tmp_path_factory.mktemp("fsdp"), {}

    def get(name, script, nproc, *args):
        if name not in done:
            out = str(base / name)
            done[name] = Run(out, launch(script, nproc, [*args, "--out-dir", out]))
        return done[name]
    return get


def proof(shared, script, nproc):
    """The shared proof run of `script` (fsdp_train.py, or ddp_launch_train.py) at `nproc` processes."""
    return Run(shared(f"{'fsdp' if script == FSDP else 'launch'}{nproc}"))


def resnet(runs, script, nproc):
    return runs(f"resnet_{script[:4]}{nproc}", script, nproc, *RESNET, "--batch-size", 16 // nproc)


# ---- 1. FSDP trains exactly like DDP: within rounding (conftest.TOL), another order of summation
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.floor), 3])
def test_matches_ddp(shared, nproc, measured):
    assert_trains_like_ddp(proof(shared, FSDP, nproc), proof(shared, DDP, nproc), nproc, measured)


@pytest.mark.full
def test_hsdp_matches_ddp_and_fsdp(runs, shared, measured):
    """--replicate 2 on 4 processes: 2 copies, each sharded over 2 ranks. The same training as DDP on 4 and FSDP on
    2 processes (global batch 24 in all three); each rank holds half the parameters, as under FSDP on 2."""
    hsdp = runs("hsdp4", FSDP, 4, *PROOF, *per_process(4), "--replicate", 2)
    assert_trains_like_ddp(hsdp, runs("ddp4", DDP, 4, *PROOF, *per_process(4)), 4, measured)
    fsdp2 = proof(shared, FSDP, 2)
    assert_same_training(hsdp.dir, fsdp2.dir, measured, "HSDP 2x2 vs FSDP 2")
    assert [r["param_bytes"] for r in hsdp.rows] == [r["param_bytes"] for r in fsdp2.rows]
    assert hsdp.rows[0]["replicate"] == 2 and "HSDP: 2 copies of 2 shards" in hsdp.proc.stdout


def assert_trains_like_ddp(fsdp, ddp, nproc, measured):
    """Runs of fsdp_train.py and ddp_launch_train.py on the same flags: the same weights, optimizer state, schedule,
    losses, accuracies and metrics rows (conftest.assert_same_training) and checkpoint format."""
    assert_same_training(fsdp.dir, ddp.dir, measured, f"fsdp_train.py vs ddp_launch_train.py, {nproc} processes")
    # a comparison that can fail: training moved the weights far from their initialization
    torch.manual_seed(0)
    init = models.make("smooth", 1, 10).state_dict()
    assert max_diff(fsdp.ckpt["model"], init) >= 1e-2
    assert [r["step"] for r in fsdp.rows] == [16, 32, 48]
    for f in fsdp.rows:
        assert f["val_count"] == 97  # every validation sample once, with padded forwards
        assert f["world_size"] == nproc and f["precision"] == "fp32" and f["reshard_after_forward"] is True
    # the same checkpoint format: the same keys, the same optimizer state names
    assert fsdp.ckpt.keys() == ddp.ckpt.keys()


def evaluate_alone(ckpt):
    """Loss and accuracy of a checkpoint over the whole validation set, in this one process."""
    args = argparse.Namespace(**ckpt["args"])
    _, val_set = common.load_data(args)
    model = common.make_model(args, val_set)
    model.load_state_dict(ckpt["model"])
    model.eval()
    with torch.no_grad():
        x, y = val_set.tensors
        out = model(x)
    return F.cross_entropy(out.double(), y, reduction="sum").item() / len(val_set), \
        (out.argmax(1) == y).double().mean().item()


def test_batchnorm_model_matches_ddp_and_its_checkpoint(runs, measured):
    """resnet18 (ReLU, max-pool: not the smooth model) on 2 processes, FSDP and DDP: the same summation order, so the
    same training (it compares within TOL); its BatchNorm statistics, evaluation and checkpoint."""
    fsdp, ddp = resnet(runs, FSDP, 2), resnet(runs, DDP, 2)
    state = fsdp.ckpt["model"]
    assert_same_training(fsdp.dir, ddp.dir, measured, "resnet18 (BatchNorm): fsdp vs ddp, 2 processes")
    assert state["bn1.running_var"].sub(1).abs().max() > 1e-2  # the BatchNorm statistics did move
    # the reported numbers are those of the saved model: rank 0's BatchNorm statistics went to every rank
    loss, acc = evaluate_alone(fsdp.ckpt)
    assert fsdp.rows[-1]["val_count"] == 33
    assert fsdp.rows[-1]["val_loss"] == pytest.approx(loss, rel=1e-6)
    assert fsdp.rows[-1]["val_acc"] == pytest.approx(acc, rel=1e-6)


# ---- 2. memory: each rank holds 1/N
def memory_run(runs, nproc):
    if nproc == 2:
        return resnet(runs, FSDP, 2)
    # 1 step only; with 3 processes also: --weights (from the 2-process run), --lr 0 (so the weights stay as loaded),
    # another seed (so a shard the weights missed would show) and 2 validation samples (rank 2 has none)
    extra = ["--weights", resnet(runs, FSDP, 2).last_pt, "--lr", 0, "--seed", 7, "--val-size", 2] if nproc == 3 else []
    return runs(f"memory{nproc}", FSDP, nproc, *RESNET, "--batch-size", 8, "--max-steps", 1, *extra)


@pytest.mark.full
def test_memory_per_rank_falls_as_one_over_world_size(runs):
    rows = {n: memory_run(runs, n).rows[-1] for n in (1, 2, 3)}
    torch.manual_seed(0)
    numel = sum(p.numel() for p in models.make("resnet18", 1, 10).parameters())
    assert rows[1]["param_bytes"] == rows[1]["grad_bytes"] == rows[1]["optim_bytes"] == 4 * numel  # fp32, SGD momentum
    for n in (2, 3):
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert rows[n][key] == pytest.approx(rows[1][key] / n, rel=0.1), (n, key, rows[n][key])
        total = sum(rows[n][k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        assert total == pytest.approx(3 * 4 * numel / n, rel=0.1)


@pytest.mark.full
def test_weights_reach_every_shard_and_a_rank_without_validation_samples_pads(runs):
    loaded, weights = memory_run(runs, 3), resnet(runs, FSDP, 2).ckpt["model"]
    torch.manual_seed(7)
    params = [k for k, _ in models.make("resnet18", 1, 10).named_parameters()]
    assert max_diff(loaded.ckpt["model"], weights, params) == 0.0  # --lr 0: exactly the loaded weights, every shard
    assert loaded.rows[-1]["val_count"] == 2 and loaded.rows[-1]["world_size"] == 3


# ---- 3. last.pt crosses between FSDP and DDP, and between process counts
@pytest.mark.parametrize("first,second", [((FSDP, 2), (DDP, 3)),
                                          pytest.param((DDP, 3), (FSDP, 2), marks=pytest.mark.full)])
def test_checkpoint_crosses_over(runs, shared, first, second, measured):
    (s1, n1), (s2, n2) = first, second
    half = runs(f"half_{s1[:4]}{n1}", s1, n1, *PROOF, *per_process(n1), "--max-steps", 16)
    assert (half.ckpt["epoch"], half.ckpt["step_in_epoch"], half.ckpt["world_size"]) == (1, 0, n1)
    resumed = runs(f"resumed_{s2[:4]}{n2}_from_{s1[:4]}{n1}", s2, n2, *PROOF, *per_process(n2),
                   "--resume", half.last_pt)
    straight = proof(shared, DDP, 2)
    assert [r["epoch"] for r in resumed.rows] == [2, 3]
    assert_same_training(resumed.dir, straight.dir, measured, f"{s1} {n1} -> {s2} {n2} vs DDP 2", last_rows=2)
    assert max_diff(resumed.ckpt["model"], half.ckpt["model"]) >= 1e-2  # the second epoch did train
    assert resumed.ckpt["world_size"] == n2


# ---- 3b. sharded checkpoints (--ckpt-format dcp) reshard on load: any script, any number of processes, HSDP too
def newest_folder(out_dir):
    """The ckpt-<step> folder of the highest step in out_dir (what the leg that just ended saved last)."""
    steps = [int(n[len("ckpt-"):]) for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n)]
    assert steps, os.listdir(out_dir)
    return os.path.join(out_dir, f"ckpt-{max(steps)}")


def newest_sharded(out_dir, tmp_path):
    """The newest ckpt-<step> folder in out_dir, converted to a last.pt (train_extras.sharded.to_file, what the
    command runs) and read with weights_only=True."""
    to_file(newest_folder(out_dir), str(tmp_path / "converted.pt"))
    return checkpoint(str(tmp_path / "converted.pt"))


def convert(src, dst):
    """The documented conversion, as a user runs it: `python -m train_extras.sharded SRC DST`, one process."""
    p = run("-m", "train_extras.sharded", src, dst, check=False)
    assert p.returncode == 0 and os.path.isfile(dst), (p.returncode, p.stdout[-2000:], p.stderr[-3000:])


FILE = "last.pt"  # a leg that resumes the newest sharded folder after converting it to one file, as docs/usage.md says


@pytest.mark.parametrize("legs", [
    # 2 -> 3 -> 1 processes, each resharding the previous leg's folder
    pytest.param([(FSDP, 2, []), (FSDP, 3, []), (FSDP, 1, [])], marks=pytest.mark.floor),
    # HSDP (2 copies of 2 shards, saving in the background) -> FSDP on 2 -> converted to one file -> DDP on 3
    # (mp.spawn's)
    pytest.param([(FSDP, 4, ["--replicate", 2, "--async-save", "--save-every", 4]), (FSDP, 2, []),
                  ("ddp_spawn_train.py", 3, FILE)], marks=pytest.mark.full),
    # the same script and process count throughout: bit for bit the straight run
    pytest.param([(FSDP, 2, []), (FSDP, 2, ["--async-save", "--save-every", 3]), (FSDP, 2, [])],
                 marks=pytest.mark.full),
], ids=["fsdp2-fsdp3-fsdp1", "hsdp4-fsdp2-file-spawn3", "fsdp2-fsdp2-fsdp2"])
def test_sharded_checkpoints_move_between_process_counts(shared, legs, tmp_path, measured):
    """Three epochs in three legs (to steps 13, 30 and 48), each resuming the previous leg's newest ckpt-<step>
    folder (fsdp_train.py --ckpt-format dcp, which writes them), or one converted to a last.pt for a DDP script:
    they end where three straight epochs of FSDP on 2 processes end (within TOL, every metrics row and the
    optimizer state included), and exactly there when every leg is FSDP on 2."""
    out = tmp_path / "out"
    for (script, nproc, extra), stop in zip(legs, [13, 30, None]):
        if extra == FILE:
            convert(newest_folder(out), out / "last.pt")
        dcp = [] if extra == FILE else ["--ckpt-format", "dcp", *extra]
        launch(script, nproc, [*PROOF, *per_process(nproc), *dcp, "--resume", "auto", "--out-dir", out,
                               *(["--max-steps", stop] if stop else [])])
        ckpt = newest_sharded(out, tmp_path) if dcp else checkpoint(str(out))
        assert (ckpt["epoch"] * STEPS_PER_EPOCH + ckpt["step_in_epoch"], ckpt["world_size"]) == (stop or 48, nproc)
    if dcp:
        assert sorted(os.listdir(out)) == ["ckpt-32", "ckpt-48", "metrics.jsonl"]  # the newest 2 kept, nothing .tmp
        torch.save(ckpt, out / "last.pt")  # (converted: to compare it as a last.pt)
    same = proof(shared, FSDP, 2)
    name = f"sharded {'-'.join(f'{s[:4]}{n}' for s, n, _ in legs)} vs FSDP 2"
    assert_same_training(str(out), same.dir, measured, name)
    if {(script, nproc) for script, nproc, _ in legs} == {(FSDP, 2)}:
        assert max_diff(ckpt["model"], same.ckpt["model"]) == 0
        assert max_diff(ckpt["optimizer"], same.ckpt["optimizer"]) == 0
        for k in ("train_loss", "val_loss", "val_acc"):
            assert [r[k] for r in metrics(str(out))] == [r[k] for r in same.rows], k


@pytest.mark.full
def test_a_sharded_resume_of_a_batchnorm_model_mid_epoch_is_bit_for_bit_the_straight_run(runs, tmp_path):
    """resnet18 on 2 processes, 2 epochs of 3 steps, a ckpt-<step> folder saved at step 4 (mid-epoch 2, when each
    rank's BatchNorm statistics are its own), the run's later folder removed, resumed from it to the end. Weights,
    BatchNorm statistics, optimizer state and validation numbers equal the straight run's exactly: the folder holds
    rank 0's statistics, what every rank gets at each epoch's end (DCP's default writes them from rank 1)."""
    args, out = [*RESNET, "--epochs", 2, "--batch-size", 8, "--ckpt-format", "dcp", "--resume", "auto"], tmp_path / "o"
    launch(FSDP, 2, [*args, "--out-dir", out, "--save-every", 4])
    shutil.rmtree(newest_folder(out))  # ckpt-6: the resume takes ckpt-4
    p = launch(FSDP, 2, [*args, "--out-dir", out])
    assert "resuming at step 4" in p.stdout, p.stdout[-2000:]
    resumed, straight = newest_sharded(out, tmp_path), runs("resnet_2_epochs", FSDP, 2, *args[:-4])
    assert straight.ckpt["model"]["layer1.0.bn1.running_mean"].abs().max() > 1e-3  # the statistics did move
    assert max_diff(resumed["model"], straight.ckpt["model"]) == 0
    assert max_diff(resumed["optimizer"], straight.ckpt["optimizer"]) == 0
    assert metrics(str(out))[-1]["val_loss"] == straight.rows[-1]["val_loss"]


# ---- 4. bf16 learns as well as fp32
@pytest.mark.full
def test_bf16_accuracy_close_to_fp32(runs):
    args = ["--train-size", 2000, "--val-size", 2000, "--epochs", 2, "--batch-size", 32, "--lr", 0.05,
            "--device", "cpu"]
    fp32 = runs("fp32", FSDP, 2, *args)
    bf16 = runs("bf16", FSDP, 2, *args, "--precision", "bf16")
    assert bf16.rows[-1]["precision"] == "bf16"
    assert fp32.rows[-1]["val_acc"] > 0.9  # high and stable: the comparison means something
    assert abs(bf16.rows[-1]["val_acc"] - fp32.rows[-1]["val_acc"]) <= 0.01
    assert max_diff(bf16.ckpt["model"], fp32.ckpt["model"]) > 1e-3  # bf16 was really in use
    assert all(v.dtype == torch.float32 for v in bf16.ckpt["model"].values())  # saved in fp32, like the fp32 run



SEE_DTYPES = """
import json, sys
sys.path.insert(0, sys.argv[1])  # the checkout
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import common, fsdp_train
from train_extras import models
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = models.make("resnet18", 1, 10)
fsdp_train.shard(model, init_device_mesh("cpu", (1,)), "bf16", True)
seen = set()
def before(m, args):  # runs after FSDP's own pre-forward: the gathered weights and the cast input
    m.seen = (type(m).__name__.replace("FSDP", ""), str(m.weight.dtype), str(args[0].dtype))
def after(m, args, out):  # after FSDP's post-forward: the output handed on
    seen.add((*m.seen, str(out.dtype)))
for m in model.modules():
    if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear)):
        m.register_forward_pre_hook(before)
        m.register_forward_hook(after)
model(torch.randn(4, 1, 28, 28)).float().sum().backward()
print(json.dumps(sorted(seen)))
"""


@pytest.mark.floor
def test_bf16_batchnorm_computes_in_fp32_and_convolutions_in_bf16(tmp_path):
    """What runs, not what is saved (saved weights are fp32 either way): during the forward each BatchNorm sees fp32
    weights and input and hands bf16 on; every convolution and the linear head compute in bf16."""
    (tmp_path / "see_dtypes.py").write_text(SEE_DTYPES)
    p = run(tmp_path / "see_dtypes.py", ROOT)
    seen = {tuple(row) for row in json.loads(p.stdout)}
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    assert seen == {("BatchNorm2d", fp32, fp32, bf16), ("Conv2d", bf16, bf16, bf16), ("Linear", bf16, bf16, bf16)}


@pytest.mark.floor
def test_bf16_trains_a_batchnorm_model(runs):
    bf16 = runs("resnet_bf16", FSDP, 2, *RESNET, "--batch-size", 8, "--precision", "bf16")
    fp32 = resnet(runs, FSDP, 2)
    assert bf16.rows[-1]["precision"] == "bf16" and bf16.rows[-1]["val_count"] == 33
    assert math.isfinite(bf16.rows[-1]["train_loss"]) and math.isfinite(bf16.rows[-1]["val_loss"])
    assert all(v.dtype == fp32.ckpt["model"][k].dtype for k, v in bf16.ckpt["model"].items())  # fp32 (and int) saved
    assert 1e-4 < max_diff(bf16.ckpt["model"], fp32.ckpt["model"]) < 0.5  # bf16 in use, and the same training


# ---- 5. bad input: every rank stops, with one line on stderr, printed by rank 0 alone
@pytest.mark.parametrize("nproc,args,words", [
    (2, ["--sync-bn"], "ddp_launch_train.py --sync-bn"),
    (2, ["--precision", "fp16"], "bf16"),
    (2, ["--replicate", 3], "--replicate 3 does not divide the 2 processes"),
    (1, ["--model", "nosuchnet"], "unknown --model"),  # the lone-process path: its whole stderr is the one line
])
@pytest.mark.floor
def test_bad_input_one_line(tmp_path, nproc, args, words):
    if nproc == 1:
        p = run(FSDP, *args, "--device", "cpu", "--out-dir", tmp_path / "out", check=False)
        stderr = {0: p.stderr}
    else:  # each rank's own stderr
        ranks = start_ranks(FSDP, [*args, "--device", "cpu", "--out-dir", tmp_path / "out"], nproc)
        for rank in range(nproc):
            ranks.wait(rank)
        p, stderr = ranks.result(), {rank: ranks.stderr(rank) for rank in range(nproc)}
    assert_exit(p, 2)  # bad input: status 2, from every process
    lines = stderr[0].splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], stderr[0]
    assert all(stderr[rank] == "" for rank in range(1, nproc)), stderr
    assert not os.path.exists(tmp_path / "out" / "last.pt")


# a model whose training reads a buffer that each rank updates from its own batches (a running centring of the
# inputs), and that FSDP leaves different on each rank
RANK_BUFFER = r'''
import torch
import torch.nn as nn
from torch.utils.data import Dataset


class Points(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.x = 1.5 * torch.randn(4, 16, generator=torch.Generator().manual_seed(1234))[self.y] + torch.randn(n, 16,
                                                                                                           generator=g)
    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def load_data(args):
    return Points(512, 1), Points(64, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.register_buffer("centre", torch.zeros(16))

    def forward(self, x):
        if self.training:
            self.centre.mul_(0.5).add_(0.5 * x.mean(0))
        return self.body(x - self.centre)
'''


@pytest.mark.full
def test_a_sharded_resume_restores_each_ranks_own_buffers(tmp_path):
    """A copier's model that trains on a buffer of its own rank's batches, 16 steps on 2 processes with a ckpt-12
    folder, resumed from it: ends bit for bit where the run did. Given rank 0's buffer instead (what the model's
    state holds), rank 1 trains on another centring, and the weights differ."""
    from test_core import copy_alone
    folder = copy_alone(tmp_path / "project", FSDP, RANK_BUFFER)
    shutil.copytree(os.path.join(ROOT, "train_extras"), folder / "train_extras")
    args = [FSDP, "--epochs", 1, "--batch-size", 16, "--ckpt-format", "dcp", "--save-every", 12, "--resume", "auto",
            "--out-dir", tmp_path / "out"]
    for leg in ("straight", "resumed"):
        p = run(*args, launcher="ranks", nproc=2, cwd=folder)
        assert p.returncode == 0, p.stderr[-3000:]
        assert leg == "straight" or "resuming at step 12" in p.stdout, p.stdout[-2000:]
        to_file(newest_folder(tmp_path / "out"), str(tmp_path / f"{leg}.pt"))
        shutil.rmtree(newest_folder(tmp_path / "out"))  # ckpt-16: the next leg resumes ckpt-12
    to_file(str(tmp_path / "out" / "ckpt-12"), str(tmp_path / "mid.pt"))
    mid = checkpoint(str(tmp_path / "mid.pt"))["buffers"]
    assert mid["1"]["centre"].sub(mid["0"]["centre"]).abs().max() > 1e-2  # the ranks' buffers did differ there
    straight, resumed = checkpoint(str(tmp_path / "straight.pt")), checkpoint(str(tmp_path / "resumed.pt"))
    assert max_diff(resumed["model"], straight["model"]) == 0
    assert max_diff(resumed["optimizer"], straight["optimizer"]) == 0
