"""What a copier does: one script and common.py in an empty folder, their own plain Dataset and nn.Module swapped in
with the lines the README's "Adapting" section shows, trained under torchrun with 2 processes."""
import os
import re
import shutil

import pytest

from conftest import ROOT, checkpoint, metrics, run

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
    def __init__(self, channels, classes):
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


SLEEPY = MY_PROJECT.replace("    def __getitem__(self, i):\n", """    def __getitem__(self, i):
        __import__("time").sleep(0.05 / 8)  # 0.05 s per batch of 8
""").replace("self.augment = ", "self.classes = 3  # no pass over the labels\n        self.augment = ")


@pytest.mark.slow
def test_data_wait_is_the_time_spent_waiting_for_batches(tmp_path):
    out = tmp_path / "out"
    run(adapted_copy(tmp_path, SLEEPY), "--epochs", 1, "--batch-size", 8, "--workers", 0, "--max-steps", 30,
        "--out-dir", out)
    row = metrics(str(out))[0]
    assert row["step"] == 30 and 0.8 * 30 * 0.05 <= row["data_wait_s"] <= 1.2 * 30 * 0.05, row
