"""Each script end to end on CPU/gloo, under its own launcher: it learns, prints from rank 0 only, writes
metrics.jsonl and last.pt in the collection's formats, and stops on a signal with a save from which the resume ends
bit for bit where the run does; the mnist and imagefolder loaders on tiny files written here."""
import os
import re
import signal
import struct
import subprocess
import sys

import pytest
import torch

from conftest import assert_exit, checkpoint, max_diff, metrics, summary_lines
from hooks import Hooks
from processes import ROOT, Proc, clean_env, run, script_cmd

SMALL = ["--train-size", 3072, "--val-size", 500, "--epochs", 2, "--log-every", 10]
SCRIPTS = {  # name: (script, its own launcher, processes, extra args); the global batch is 64 everywhere
    "dp": ("dp_train.py", "python", None, ["--batch-size", 64]),
    "launch": ("ddp_launch_train.py", "torchrun", 2, ["--batch-size", 32]),
    "spawn": ("ddp_spawn_train.py", "python", None, ["--batch-size", 32]),  # its default: 2 CPU processes
    "amp": ("ddp_amp_train.py", "torchrun", 2, ["--batch-size", 32, "--precision", "bf16"]),
    "fsdp": ("fsdp_train.py", "torchrun", 2, ["--batch-size", 32]),
}
HEADER = {"dp": "dp: ", "launch": "ddp: ", "spawn": "ddp: ", "amp": "ddp bf16: ", "fsdp": "fsdp: "}


@pytest.fixture(scope="session")
def script_run(session_dir):
    """One small run of each script under its own launcher, made on first use and shared by the tests below."""
    done = {}

    def get(name):
        if name not in done:
            script, launcher, nproc, extra = SCRIPTS[name]
            out = str(session_dir / f"small_{name}")
            done[name] = run(script, *SMALL, *extra, "--out-dir", out, launcher=launcher, nproc=nproc), out
        return done[name]
    return get


@pytest.mark.floor
@pytest.mark.parametrize("name", SCRIPTS)
def test_learns_and_logs_once(script_run, name):
    proc, out = script_run(name)
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["val_acc"] > 0.85, rows  # chance is 0.1
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] < 2.3
    assert all(r["val_count"] == 500 for r in rows)  # every validation sample counted exactly once
    # only rank 0 printed: one header and one summary line per epoch, no matter how many processes
    assert sum(line.startswith(HEADER[name]) for line in proc.stdout.splitlines()) == 1, proc.stdout
    assert len(summary_lines(proc.stdout)) == 2, proc.stdout
    assert "Traceback" not in proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]  # e.g. the resource tracker's, of leaked semaphores
    # output to a file (as here, and in a SLURM log): whole lines, no progress bar refreshes
    assert "\r" not in proc.stdout
    assert all(line.startswith("epoch ") for line in proc.stdout.splitlines() if "train_loss" in line), proc.stdout


@pytest.mark.floor
@pytest.mark.parametrize("name", SCRIPTS)
def test_metrics_format(script_run, name):
    _, out = script_run(name)
    for row in metrics(out):
        for key in ("epoch", "train_loss", "val_loss", "val_acc", "lr", "samples_per_s", "epoch_time_s",
                    "world_size", "peak_mem_mb"):
            assert key in row, key
        assert row["world_size"] == (1 if name == "dp" else 2)
        # the throughput of the timed part of the epoch: from the end of its first step (3072 / 64 = 48 steps)
        assert row["samples_per_s"] == pytest.approx(47 * 64 / row["epoch_time_s"], rel=1e-6), row
        assert row["peak_mem_mb"] is None, row  # GPU memory, and there is none on the CPU
    assert metrics(out)[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine schedule ends at 0


@pytest.mark.floor
@pytest.mark.parametrize("name", SCRIPTS)
def test_checkpoint_format(script_run, name):
    from train_extras import models
    _, out = script_run(name)
    ckpt = checkpoint(out)  # weights_only=True: plain tensors and plain types only
    assert {"model", "optimizer", "scheduler", "epoch", "step_in_epoch", "args"} <= ckpt.keys()
    assert ckpt["epoch"] == 2 and ckpt["step_in_epoch"] == 0
    names = list(models.make("cnn", 1, 10).state_dict())
    assert list(ckpt["model"]) == names  # no module. or _orig_mod. prefixes
    assert set(ckpt["optimizer"]["state"]) == set(names)  # optimizer state keyed by parameter name
    assert all("momentum_buffer" in s for s in ckpt["optimizer"]["state"].values())
    assert ckpt["optimizer"]["param_groups"][0]["params"] == names
    assert ckpt["args"]["batch_size"] == SCRIPTS[name][3][1] and isinstance(ckpt["args"], dict)
    assert ("scaler" in ckpt) == (name == "amp")
    model = models.make("cnn", 1, 10)
    model.load_state_dict(ckpt["model"])  # loads into a plain model, strict


# how each script's launcher is stopped: (signal, sent to, the status each rank exits with). torchrun passes SIGTERM on
# to its workers, the spawn parent every stop signal to its children; SIGUSR1, which torchrun does not handle, goes to
# its workers, as a scheduler signals every process
STOP = {"dp": (signal.SIGTERM, "process", 143), "launch": (signal.SIGTERM, "launcher", 143),
        "spawn": (signal.SIGUSR1, "launcher", 0), "amp": (signal.SIGUSR1, "ranks", 0),
        "fsdp": (signal.SIGTERM, "launcher", 143)}
PAUSE = 6  # every rank waits after this step until the signal is taken


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_signal_stops_it_with_a_save_and_the_resume_ends_bit_for_bit(script_run, name, tmp_path):
    """The signal its launcher or a scheduler sends, while every rank waits at step 6 (tests/hooks.py): every rank
    saves at the one step they agreed on (the next check, by step 10: --log-every) and exits with the signal's
    status, rank 0 saying so once; `--resume auto` under the same launcher then ends with the weights and optimizer
    state of the uninterrupted run, bit for bit."""
    script, launcher, nproc, extra = SCRIPTS[name]
    sig, to, code = STOP[name]
    out, hooks = tmp_path / "out", Hooks(tmp_path, pause_at=PAUSE)
    cmd = script_cmd(script, [*SMALL, *extra, "--out-dir", out], launcher, nproc)
    proc = Proc(cmd, tmp_path / "log", env=hooks.env, merge=True)
    ranks = [0] if name == "dp" else [0, 1]
    try:
        proc.until(lambda: sorted(hooks.paused()) == ranks, f"every rank at step {PAUSE}")
        for pid in (hooks.paused().values() if to == "ranks" else [proc.pid]):
            os.kill(pid, sig)
        proc.until(lambda: all(hooks.handled(pid, sig) for pid in hooks.paused().values()), f"{sig.name} taken")
        hooks.go()
        proc.wait(expect=None)
    finally:
        proc.kill()
    log = proc.output()
    stops = [int(s) for s in re.findall(rf"stopped by {sig.name} at step (\d+), where last.pt was saved", log)]
    assert len(stops) == 1 and PAUSE <= stops[0] <= 10, log[-3000:]
    assert hooks.exits() == {r: code for r in ranks} and hooks.steps() == {r: stops[0] for r in ranks}, log[-3000:]
    saved = checkpoint(out)
    assert saved["epoch"] * 48 + saved["step_in_epoch"] == stops[0]  # 48 steps an epoch
    p = run(script, *SMALL, *extra, "--resume", "auto", "--out-dir", out, launcher=launcher, nproc=nproc)
    assert f"resuming at step {stops[0]}" in p.stdout
    resumed, straight = checkpoint(out), checkpoint(script_run(name)[1])
    assert max_diff(resumed["model"], straight["model"]) == 0
    assert max_diff(resumed["optimizer"], straight["optimizer"]) == 0


@pytest.mark.full
def test_default_run_reaches_95_percent(tmp_path):
    """The README's first command, as is: 2 CPU processes, synthetic data, 2 epochs."""
    proc = run("ddp_spawn_train.py", "--out-dir", tmp_path, env={"OMP_NUM_THREADS": "1"})
    rows = metrics(str(tmp_path))
    assert len(rows) == 2 and rows[-1]["val_acc"] >= 0.95, rows
    assert rows[-1]["world_size"] == 2 and rows[-1]["val_count"] == 2000
    assert len(summary_lines(proc.stdout)) == 2


def _synthetic_uint8(n, seed):
    from train_extras import datasets
    x, y = datasets.synthetic(n, seed, (1, 28, 28))
    x = ((x.clamp(-2.5, 2.5) + 2.5) / 5 * 255).to(torch.uint8)[:, 0]
    return x, y


def _write_idx(path, tensor, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in tensor.shape))
        f.write(tensor.numpy().tobytes())


def test_mnist_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n, seed in (("train", 1024, 1), ("t10k", 200, 1 + 10**6)):  # seeds of the same class templates
        x, y = _synthetic_uint8(n, seed)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", x, 2051)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", y.to(torch.uint8), 2049)
    out = tmp_path / "out"
    run("dp_train.py", "--dataset", "mnist", "--data-dir", tmp_path, "--epochs", 2, "--val-size", 150,
        "--batch-size", 16,
        "--out-dir", out)
    rows = metrics(str(out))
    assert rows[-1]["val_count"] == 150  # --val-size takes a subset of the real set
    assert rows[-1]["val_acc"] > 0.5, rows


def test_mnist_missing_says_how_to_fix(tmp_path):
    p = run("ddp_launch_train.py", "--dataset", "mnist", "--data-dir", tmp_path, "--out-dir", tmp_path / "out",
            launcher="ranks", nproc=2, check=False)
    assert_exit(p, 2)  # bad input (no data): each rank's own status
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--dataset synthetic" in errors[0] and "MNIST" in errors[0], p.stderr
    assert not (tmp_path / "out").exists()


def write_imagefolder(root, per_class_train=24, per_class_val=7, size=20):
    """Three classes that differ in colour and position of a square, with noise."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", per_class_train), ("val", per_class_val)):
        for c, name in enumerate(["circle", "square", "triangle"]):
            os.makedirs(os.path.join(root, split, name), exist_ok=True)
            for i in range(n):
                img = torch.rand(size, size, 3, generator=g) * 0.4
                img[4 + 3 * c:12 + 3 * c, 2:10, c] += 0.6
                Image.fromarray((img.clamp(0, 1) * 255).to(torch.uint8).numpy()).save(
                    os.path.join(root, split, name, f"{i}.png"))


@pytest.mark.floor
def test_imagefolder(tmp_path):
    write_imagefolder(tmp_path / "data")
    out = tmp_path / "out"
    run("ddp_launch_train.py", "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--image-size", 16,
        "--batch-size", 8, "--epochs", 6, "--lr", 0.05, "--workers", 2, "--out-dir", out)
    rows = metrics(str(out))
    assert rows[-1]["val_count"] == 21
    assert rows[-1]["val_acc"] > 0.6, rows  # chance is 1/3
    assert checkpoint(str(out))["model"]["conv1.weight"].shape[1] == 3  # RGB


# a sitecustomize.py on PYTHONPATH: every Python interpreter that starts writes down its command line
STARTS = ("import os, sys\nif os.environ.get('STARTS_FILE'):\n"
          "    with open(os.environ['STARTS_FILE'], 'a') as f:\n        f.write(' '.join(sys.orig_argv) + '\\n')\n")


def test_imagefolder_workers_start_from_a_fork_of_the_trainer(tmp_path):
    """Where train_extras/workers.py starts the DataLoader workers from a fork server (Python 3.11.7 here), that
    server is forked from the training process at its start, with torch and torchvision imported: no second
    interpreter imports them again before the first batch (3.4 s of a 12 s run, benchmarks/files.py). The
    interpreters that start are the trainer and multiprocessing's resource tracker; the augmentation, seeded in the
    workers, is the same with --workers 0."""
    from train_extras import workers
    if not (workers.AFFECTED and sys.platform == "linux"):
        pytest.skip("workers fork from the trainer as torch forks them: no fork server")
    write_imagefolder(tmp_path / "data", per_class_train=8, per_class_val=3)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STARTS)
    for n in (2, 0):
        run("ddp_launch_train.py", "--dataset", "imagefolder", "--data-dir", tmp_path / "data", "--image-size", 12,
            "--batch-size", 8, "--epochs", 2, "--workers", n, "--out-dir", tmp_path / f"out{n}",
            env={"PYTHONPATH": str(tmp_path / "site"), "STARTS_FILE": str(tmp_path / f"starts{n}")}, fork=False)
    started = (tmp_path / "starts2").read_text().splitlines()
    assert len(started) == 2 and "ddp_launch_train.py" in started[0], started
    assert "multiprocessing.resource_tracker" in started[1], started
    assert max_diff(checkpoint(str(tmp_path / "out2"))["model"], checkpoint(str(tmp_path / "out0"))["model"]) == 0


def test_every_usual_image_file_reads_as_8_bit_rgb_in_one_batch(tmp_path):
    """8- and 16-bit, grayscale, palette, RGBA/LA, CMYK; PNG, JPEG, TIFF, BMP, WebP: 3 channels of uint8, whatever
    batch they fall in, and 16-bit values scaled to 8 bits (a gradient over the 16-bit range keeps its mean), not
    clipped to white as PIL's convert("RGB") does."""
    import numpy as np
    from PIL import Image
    from train_extras.datasets import ImageFiles
    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    gradient = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)  # 0..65472, mean 127.4
    Image.fromarray(gradient).save(folder / "gray16.png")
    Image.fromarray(gradient).save(folder / "gray16.tif")
    rgb = Image.fromarray((np.arange(32 * 32 * 3) % 256).astype(np.uint8).reshape(32, 32, 3))
    for name, image in [("rgb.png", rgb), ("rgb.jpg", rgb), ("rgb.bmp", rgb), ("rgb.webp", rgb),
                        ("gray.png", rgb.convert("L")), ("palette.png", rgb.convert("P")),
                        ("rgba.png", rgb.convert("RGBA")), ("la.png", rgb.convert("LA")),
                        ("cmyk.jpg", rgb.convert("CMYK")), ("rgb.tif", rgb)]:
        image.save(folder / name)
    ds = ImageFiles(str(tmp_path / "train"), 16, augment=False, seed=0)
    batch = torch.stack([ds[i][0] for i in range(len(ds))])  # one batch of all of them
    assert batch.dtype == torch.uint8 and batch.shape == (12, 3, 16, 16)
    for i, (path, _) in enumerate(ds.samples):
        if "gray16" in path:
            image = ds.read(path)
            assert image.dtype == torch.uint8 and image.shape == (3, 32, 32), path
            assert abs(image.float().mean().item() - 127.4) < 1.5 and (image == 255).float().mean() < 0.01, path


def test_dp_model_with_loss_matches_plain_loss():
    """What dp_train.py's replicas return adds up to the usual mean loss over the whole batch."""
    import torch.nn.functional as F

    from train_extras import models
    import dp_train
    torch.manual_seed(0)
    model = models.make("cnn", 1, 10)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    # two replicas, each with its part of the batch, as DataParallel splits it over two GPUs
    parts = [dp_train.ModelWithLoss(model)(x[s], y[s]) for s in (slice(0, 6), slice(6, 10))]
    loss_sum = sum(p[0] for p in parts).squeeze()
    correct = sum(p[1] for p in parts).squeeze()
    out = model(x)
    torch.testing.assert_close(loss_sum / 10, F.cross_entropy(out, y))
    assert correct.item() == (out.argmax(1) == y).sum().item()


def test_dp_gpus_without_gpu_is_one_clear_line(tmp_path):
    p = run("dp_train.py", "--gpus", "0,1", "--out-dir", tmp_path, check=False)
    assert_exit(p, 2)
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: --gpus"), p.stderr


@pytest.mark.floor
def test_tests_start_scripts_with_no_gpu_visible():
    """The suite is the CPU/gloo one on every machine: conftest's guard fails any test that starts a process without
    processes.clean_env(), which hides the GPUs (on a GPU machine the scripts would pick CUDA and NCCL), whatever the
    program and however it is started."""
    ways = [lambda: subprocess.run([sys.executable, "dp_train.py", "--help"], cwd=ROOT, env=dict(os.environ)),
            lambda: subprocess.Popen(["srun", "--ntasks=2", "true"]),
            lambda: subprocess.run(["torchrun", "--nproc_per_node=2", "ddp_launch_train.py"], cwd=ROOT),
            lambda: subprocess.run("bash -c 'python dp_train.py'", shell=True, cwd=ROOT),
            lambda: subprocess.check_output(["env", "python", "dp_train.py"], cwd=ROOT),
            lambda: os.system("python dp_train.py --help"),
            lambda: os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ))]
    for start in ways:
        with pytest.raises(AssertionError, match="without processes.clean_env"):
            start()
    p = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))"],
                       env=clean_env(), capture_output=True, text=True)
    assert p.stdout.strip() == "''", p.stderr  # what clean_env gives every process: no GPU visible
