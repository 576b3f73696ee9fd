"""Fine-tuning on your own images, without a network: --pretrained, --weights of another head or channel count, and
--freeze-backbone. The "pretrained" weights are a generated resnet18 state_dict, saved where torchvision's cache
looks for the real file ($TORCH_HOME/hub/checkpoints/<name from the weights' URL>): torchvision then loads it
through its weights API with no download, which is the code path a user with the real file takes."""
import shutil
import types

import pytest
import torch

import common
import failsafe
from conftest import checkpoint, metrics
from processes import run
from train_extras import finetune
from train_extras import models
from train_extras.datasets import ImageFiles

CACHED_FILE = "resnet18-f37072fd.pth"  # ResNet18_Weights.DEFAULT.url ends with it


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory):
    import torchvision
    assert torchvision.models.get_model_weights("resnet18").DEFAULT.url.endswith(CACHED_FILE)
    home = tmp_path_factory.mktemp("torch_home")
    (home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(1234)
    model = torchvision.models.resnet18()
    for m in model.modules():  # running statistics unlike a fresh model's, so that any update to them shows
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.8, 1.2)
    torch.save(model.state_dict(), home / "hub" / "checkpoints" / CACHED_FILE)
    return home


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A tiny ImageFolder: 3 classes told apart by colour, 8 training and 3 validation images each, one of each
    class grayscale (read as RGB, like every file)."""
    from PIL import Image
    root = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("val", 3)):
        for c, name in enumerate(["cat", "dog", "fox"]):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                x = (torch.rand(40, 48, 3, generator=g) * 120).to(torch.uint8)
                x[..., c] += 120
                image = Image.fromarray(x.numpy())
                (image.convert("L") if i == 0 else image).save(root / split / name / f"{i}.png")
    return root


def cached_weights(torch_home):
    return torch.load(torch_home / "hub" / "checkpoints" / CACHED_FILE, map_location="cpu", weights_only=True)


def fresh_model(name, channels, classes, seed=0):
    """The model a script builds before loading anything into it (it seeds, then builds)."""
    torch.manual_seed(seed)
    return models.make(name, channels, classes).state_dict()


def one_line_with(output, words):
    lines = [line for line in output.splitlines() if words in line]
    assert len(lines) == 1, output  # printed once, by rank 0 only
    return lines[0]


# 24 training images, global batch 8: 3 steps an epoch, 6 in all
FINETUNE = ["--model", "resnet18", "--pretrained", "--freeze-backbone", "--image-size", 64, "--batch-size", 4,
            "--epochs", 2, "--lr", 0.05, "--workers", 0]


@pytest.mark.floor
def test_finetune_a_frozen_pretrained_resnet18_on_an_image_folder_in_two_processes(torch_home, images, tmp_path):
    env = {"TORCH_HOME": str(torch_home)}
    data = ["--dataset", "imagefolder", "--data-dir", images]
    full = tmp_path / "full"
    p = run("ddp_launch_train.py", *data, *FINETUNE, "--out-dir", full, launcher="ranks", nproc=2, env=env)
    one_line_with(p.stdout, "ResNet18_Weights.IMAGENET1K_V1: every tensor loaded but the new head for 3 classes "
                            "(fc.bias, fc.weight)")

    ckpt, cached = checkpoint(str(full)), cached_weights(torch_home)
    head = {"fc.weight", "fc.bias"}
    # only the head learned: every other tensor, BatchNorm running statistics included, is the cached one bit for bit
    assert ckpt["model"].keys() == cached.keys()
    assert [k for k in cached if k not in head and not torch.equal(ckpt["model"][k], cached[k])] == []
    # the folder's classes
    assert ckpt["model"]["fc.weight"].shape == (3, 512) and ckpt["model"]["fc.bias"].shape == (3,)
    init = fresh_model("resnet18", 3, 3)
    assert (ckpt["model"]["fc.weight"] - init["fc.weight"]).abs().max() > 1e-3  # the head did train
    assert sorted(ckpt["optimizer"]["param_groups"][0]["params"]) == sorted(head)  # the optimizer holds the head only
    assert [r["epoch"] for r in metrics(str(full))] == [1, 2] and metrics(str(full))[0]["val_count"] == 9

    # stopped mid-epoch 2 and resumed, by fsdp_train.py (the same flags), with DataLoader workers this time:
    # the same run, bit for bit
    part = tmp_path / "part"
    more = ["--out-dir", part, "--workers", 2]
    run("ddp_launch_train.py", *data, *FINETUNE, *more, "--max-steps", 4, launcher="ranks", nproc=2, env=env)
    assert checkpoint(str(part))["step_in_epoch"] == 1
    p = run("fsdp_train.py", *data, *FINETUNE, *more, "--resume", "auto", launcher="ranks", nproc=2, env=env)
    assert "resuming at step 4" in p.stdout
    resumed = checkpoint(str(part))
    assert [k for k in ckpt["model"] if not torch.equal(resumed["model"][k], ckpt["model"][k])] == []
    assert [r["epoch"] for r in metrics(str(part))] == [1, 2]

    # resuming a frozen run without --freeze-backbone would load an optimizer state of other parameters: refused,
    # by that check alone (the same model, classes, channels and global batch: one process of 8)
    p = run("ddp_launch_train.py", *data, *[a for a in FINETUNE if a != "--freeze-backbone"], "--batch-size", 8,
            "--resume", full / "last.pt", "--out-dir", tmp_path / "other", env=env, check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: {full / 'last.pt'} is not a training state of this model and flags (--model, classes, channels, "
        "--freeze-backbone?): --weights takes weights"]


def test_pretrained_on_grayscale_data_keeps_the_first_layer(torch_home, tmp_path):
    """1-channel images are fed as 3 equal channels: the pretrained first convolution is kept, not replaced."""
    out = tmp_path / "out"
    p = run("dp_train.py", "--model", "resnet18", "--pretrained", "--synthetic-shape", "1x32x32", "--train-size", 64,
            "--val-size", 16, "--batch-size", 32, "--epochs", 1, "--lr", 0, "--out-dir", out,
            env={"TORCH_HOME": str(torch_home)})
    one_line_with(p.stdout, "every tensor loaded but the new head for 10 classes")
    state, cached = checkpoint(str(out))["model"], cached_weights(torch_home)
    assert state["conv1.weight"].shape == (64, 3, 7, 7)
    params = [k for k, _ in models.make("resnet18", 3, 10).named_parameters()]  # BatchNorm statistics trained on
    assert [k for k in params if not k.startswith("fc.") and not torch.equal(state[k], cached[k])] == []


@pytest.mark.floor
def test_weights_of_another_head_and_channel_count_load_where_they_fit(images, tmp_path):
    """A DDP-saved (module.) state_dict of a 1-channel, 10-class cnn, into a 3-channel, 3-class one (--lr 0: what is
    saved is what was loaded)."""
    torch.manual_seed(7)
    theirs = models.make("cnn", 1, 10).state_dict()
    torch.save({f"module.{k}": v for k, v in theirs.items()}, tmp_path / "theirs.pt")
    out = tmp_path / "out"
    p = run("dp_train.py", "--dataset", "imagefolder", "--data-dir", images, "--image-size", 16, "--workers", 0,
            "--batch-size", 8, "--epochs", 1, "--lr", 0, "--weights", tmp_path / "theirs.pt", "--out-dir", out)
    note = one_line_with(p.stdout, "theirs.pt: loaded")
    assert ("loaded 5 of the model's 8 tensors; kept fresh (another shape, or not in the file): conv1.weight, "
            "fc2.weight, fc2.bias") in note
    state, fresh = checkpoint(str(out))["model"], fresh_model("cnn", 3, 3)
    for k in state:
        expected = fresh[k] if k in ("conv1.weight", "fc2.weight", "fc2.bias") else theirs[k]
        assert torch.equal(state[k], expected), k


def test_fine_tuning_flags_that_cannot_work_together_are_one_line_errors():
    """--pretrained and --weights: refused by the parser; --freeze-backbone alone: by finetune.prepare, on every rank
    alike, before anything is trained. One line (failsafe.run_and_exit prints it once as `error:`), exit 2."""
    with pytest.raises(failsafe.UsageError, match="argument --weights: not allowed with argument --pretrained") as e:
        common.get_parser("").parse_args(["--model", "resnet18", "--pretrained", "--weights", "x.pt"])
    assert e.value.code == 2 and len(str(e.value).splitlines()) == 1, e.value
    args = common.get_parser("").parse_args(["--freeze-backbone"])
    with pytest.raises(failsafe.UsageError, match="^--freeze-backbone needs --pretrained or --weights: a random"):
        finetune.prepare(models.make("cnn", 1, 10), types.SimpleNamespace(args=args))
    args = common.get_parser("").parse_args([])
    model = models.make("cnn", 1, 10)
    assert finetune.prepare(model, types.SimpleNamespace(args=args)) is model  # no flag: untouched


def test_pretrained_without_a_torchvision_model_is_a_one_line_error(tmp_path):
    """cnn has no pretrained weights: the run stops with one line, exit 2, before it trains or writes a checkpoint."""
    with pytest.raises(failsafe.UsageError, match="--pretrained needs a torchvision model .*: cnn has no pretrained"):
        finetune.pretrained_weights("cnn")
    out = tmp_path / "out"
    p = run("dp_train.py", "--pretrained", "--train-size", 64, "--val-size", 16, "--batch-size", 32, "--epochs", 1,
            "--out-dir", out, check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --pretrained needs a torchvision model (e.g. --model resnet50): cnn has no pretrained weights"], \
        p.stderr
    assert not (out / "last.pt").exists()


def test_freezing_what_weights_did_not_load_is_an_error(tmp_path):
    """A 1-channel cnn's file leaves a 3-channel cnn's conv1.weight fresh: fine to train, not to freeze."""
    torch.manual_seed(0)
    theirs = models.make("cnn", 1, 10).state_dict()
    torch.save(theirs, tmp_path / "w.pt")
    model = models.make("cnn", 3, 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    head = finetune.head_names(model, "cnn")
    assert head == {"fc2.weight", "fc2.bias"}
    args = types.SimpleNamespace(weights=str(tmp_path / "w.pt"), model="cnn", freeze_backbone=True)
    with pytest.raises(failsafe.UsageError, match="--freeze-backbone would freeze tensors that .* does not hold: "
                                                "conv1.weight$"):
        finetune.load_weights(model, args, head)
    assert [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])] == []  # refused: none loaded
    args.freeze_backbone = False
    finetune.load_weights(model, args, head)
    state = model.state_dict()
    assert torch.equal(state["conv1.weight"], before["conv1.weight"])  # kept fresh
    assert [k for k in state if k != "conv1.weight" and not torch.equal(state[k], theirs[k])] == []


def test_the_head_of_your_own_model_is_its_last_layer_whatever_its_names():
    """--freeze-backbone with the copier's model (README "Adapting"): its last layer with parameters is the head,
    not the built-in --model's (cnn: fc2), which would freeze all of theirs, or a hidden layer of theirs that happens
    to be called fc2. The built-in model itself keeps the shape rule."""
    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.fc2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU()), torch.nn.Linear(32, 32)
            self.classifier = torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(32, 4))
    assert finetune.head_names(Mine(), "cnn") == {"classifier.1.weight", "classifier.1.bias"}
    assert finetune.head_names(Mine()) == {"classifier.1.weight", "classifier.1.bias"}  # no models.py
    assert finetune.head_names(models.make("cnn", 1, 4), "cnn") == {"fc2.weight", "fc2.bias"}


def test_the_built_in_model_counts_labels_of_one_element():
    """Your own Dataset with models.py's model, which counts its classes (no `classes` attribute): labels as numpy
    gives them, int32 arrays of one element, count as the loop takes them (common.to_device)."""
    import numpy as np
    mine = [(np.zeros((1, 8, 8)), np.array([label], dtype=np.int32)) for label in (0, 2, 1)]
    assert models.channels_and_classes(mine) == (1, 3)

def test_a_frozen_backbone_trains_only_its_head_and_its_batchnorm_stays_in_eval_mode():
    """After freezing, only the head's parameters want gradients, and model.train() (which every epoch calls)
    leaves the backbone's BatchNorm layers in eval mode: they keep the loaded running statistics."""
    torch.manual_seed(0)
    model = models.make("resnet18", 3, 3)
    head = finetune.head_names(model, "resnet18")
    assert head == {"fc.weight", "fc.bias"}
    finetune.freeze_backbone(model, head)
    model.train()
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(head)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 20 and not any(m.training for m in norms)
    assert model.training and model.fc.training  # the rest trains as asked
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    model(torch.randn(4, 3, 32, 32))
    assert [k for k in stats if not torch.equal(model.state_dict()[k], stats[k])] == []  # a forward changed none


def test_pretrained_preprocessing_is_the_weights_own(images):
    import torchvision
    from PIL import Image
    weights = torchvision.models.get_model_weights("resnet18").DEFAULT
    val = ImageFiles(images / "val", None, False, 0, weights)
    x, label = val[4]
    path, expected_label = val.samples[4]
    assert label == expected_label and x.shape == (3, 224, 224)  # resize to 256, center crop 224
    assert torch.equal(x, weights.transforms()(Image.open(path).convert("RGB")))  # exactly the weights' own
    assert ImageFiles(images / "val", 64, False, 0, weights).transform.resize_size == [73]  # 256/224 kept
    train = ImageFiles(images / "train", 64, True, 0, weights)
    rng = torch.get_rng_state()
    a, b = train[5][0], train[5][0]
    train.set_epoch(1)
    c = train[5][0]
    train.set_epoch(0)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is left as it was
    # a function of (seed, epoch, index): the same twice, another in another epoch, the same again in epoch 0
    assert a.shape == (3, 64, 64) and torch.equal(a, b) and not torch.equal(a, c) and torch.equal(train[5][0], a)
    assert not torch.equal(ImageFiles(images / "train", 64, True, 1, weights)[5][0], a)  # and of the seed
    # training images leave the workers as uint8; a random crop of a one-colour image is that colour, and
    # normalize_uint8, on the batch, gives it the weights' mean and std
    flat = train.transform(Image.new("RGB", (40, 48), (255, 0, 128)))
    assert flat.dtype == torch.uint8 and flat.shape == (3, 64, 64) and flat[:, 5, 7].tolist() == [255, 0, 128]
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    colour = (torch.tensor([255, 0, 128]) / 255 - mean) / std
    batch = train.normalize_uint8(torch.stack([flat, flat]))
    assert batch.dtype == torch.float32 and torch.allclose(batch, colour[:, None, None].expand(2, 3, 64, 64), atol=1e-5)
    assert val.normalize_uint8(x) is x  # validation is float already: left as it is


def test_an_image_folder_copied_from_a_mac_trains_on_its_images_alone(images, tmp_path):
    """A Mac's copy holds a ._<name> AppleDouble file (a few bytes, no image) beside each image, and a notebook
    leaves a .ipynb_checkpoints folder: hidden files and folders (names that start with ".") are left out, as `ls`
    leaves them, so none stops the run nor becomes a class."""
    data = tmp_path / "data"
    shutil.copytree(images, data)
    for image in list(data.glob("*/*/*.png")):
        (image.parent / f"._{image.name}").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    (data / "train" / ".ipynb_checkpoints").mkdir()
    shutil.copy(data / "train" / "cat" / "0.png", data / "train" / ".ipynb_checkpoints" / "0-checkpoint.png")
    (data / "train" / "dog" / ".thumbnails").mkdir()
    shutil.copy(data / "train" / "dog" / "0.png", data / "train" / "dog" / ".thumbnails" / "0.png")
    train = ImageFiles(data / "train", 16, True, 0)
    assert train.classes == ["cat", "dog", "fox"] and len(train) == 24
    out = tmp_path / "out"
    run("dp_train.py", "--dataset", "imagefolder", "--data-dir", data, "--image-size", 16, "--workers", 0,
        "--batch-size", 8, "--epochs", 1, "--out-dir", out)
    assert metrics(str(out))[0]["val_count"] == 9 and checkpoint(str(out))["model"]["fc2.bias"].shape == (3,)
