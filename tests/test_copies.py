"""What a copy line names is all a copy needs: a script, common.py, train_extras/__init__.py and the modules the
line names, alone in an empty folder, run to exit 0 (finetune.py alone, with your own data and model; and beside
models.py and datasets.py, with the built-in ones)."""
import os
import shutil

import torch

from conftest import checkpoint
from processes import ROOT, run
from test_adapt import AS_THEY_COME, MY_PROJECT, adapted_copy

TRAIN = ["--epochs", 1, "--max-steps", 2, "--batch-size", 16, "--lr", 0.5, "--workers", 0]


def saved_weights(path, project=MY_PROJECT):
    """A state_dict of the copier's MyModel, saved to `path`: what --weights starts from."""
    namespace = {}
    exec(project, namespace)
    torch.manual_seed(1)
    state = namespace["MyModel"]().state_dict()
    torch.save(state, path)
    return state


def assert_only_the_head_trained(out, start, head):
    """Every tensor but the head's (BatchNorm statistics included) as --weights gave it; the head's not."""
    state = checkpoint(str(out))["model"]
    assert state.keys() == start.keys()
    assert sorted(k for k in state if not torch.equal(state[k], start[k])) == sorted(head)


def test_finetune_py_alone_fine_tunes_your_own_model(tmp_path):
    """train_extras/finetune.py and its __init__.py, as the one-line message says, beside a script adapted to the
    copier's own Dataset and model: --weights and --freeze-backbone train its last layer. --pretrained, which needs
    a torchvision model's name (models.py's --model), is one line naming that file, exit 2."""
    script, out = adapted_copy(tmp_path, MY_PROJECT, extras=["finetune"]), tmp_path / "out"
    assert sorted(os.listdir(tmp_path / "train_extras")) == ["__init__.py", "finetune.py"]
    start = saved_weights(tmp_path / "w.pt")
    run(script, *TRAIN, "--weights", tmp_path / "w.pt", "--freeze-backbone", "--out-dir", out)
    assert_only_the_head_trained(out, start, ["net.5.weight", "net.5.bias"])
    p = run(script, *TRAIN, "--pretrained", "--out-dir", tmp_path / "other", check=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --pretrained needs train_extras/models.py (and its __init__.py): copy them"], p.stderr


def test_finetune_py_with_models_py_and_datasets_py_fine_tunes_the_built_in_model(tmp_path):
    """dp_train.py unchanged, with the three modules: the built-in data and cnn, from a saved cnn state_dict."""
    os.makedirs(tmp_path / "train_extras")
    for name in ("dp_train.py", "common.py", "failsafe.py", *(f"train_extras/{m}.py" for m in
                                               ("__init__", "finetune", "models", "datasets"))):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    from train_extras import models
    torch.manual_seed(1)
    start = models.make("cnn", 1, 10).state_dict()
    torch.save(start, tmp_path / "w.pt")
    out = tmp_path / "out"
    run(str(tmp_path / "dp_train.py"), *TRAIN, "--train-size", 64, "--val-size", 16, "--weights", tmp_path / "w.pt",
        "--freeze-backbone", "--out-dir", out)
    assert_only_the_head_trained(out, start, ["fc2.weight", "fc2.bias"])


# the copier's Dataset as numpy gives it (labels: int32 arrays of one element), writing down how often its training
# samples are read
COUNTED = AS_THEY_COME.replace("    def __getitem__(self, i):\n", """    def __getitem__(self, i):
        if self.augment:  # the training set
            with open(os.environ["READS_FILE"], "a") as f:
                f.write("read\\n")
""").replace("import torch\n", "import os\nimport torch\n", 1)


def test_weights_and_a_frozen_backbone_read_none_of_your_own_samples_to_count_classes(tmp_path):
    """Your own model knows its classes: with models.py copied too (so --model is there, cnn by default), --weights
    and --freeze-backbone neither count the classes of your own Dataset (a pass over its 600 samples on every rank)
    nor stumble on its labels of one element. The training set is read for the 2 steps' 32 samples only."""
    script, out, reads = adapted_copy(tmp_path, COUNTED, extras=["finetune", "models"]), tmp_path / "out", \
        tmp_path / "reads"
    start = saved_weights(tmp_path / "w.pt", COUNTED)
    run(script, *TRAIN, "--weights", tmp_path / "w.pt", "--freeze-backbone", "--out-dir", out,
        env={"READS_FILE": str(reads)})
    assert len(reads.read_text().split()) == 2 * 16
    assert_only_the_head_trained(out, start, ["net.5.weight", "net.5.bias"])
