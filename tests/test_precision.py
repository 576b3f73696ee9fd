"""bf16 seen running, on the CPU, on every torch the suite runs on: inside each rank's own process, a forward hook
(tests/hooks.py's, TEST_SEE_DIR) writes down the dtype that the model's training
convolutions and linear layers returned. Under `ddp_amp_train.py` (bf16 by default: torch.autocast) and
`fsdp_train.py --precision bf16` (MixedPrecisionPolicy's param_dtype) every one of them returned torch.bfloat16 on
every rank; under --precision fp32, the control, torch.float32. A run that silently trains in fp32 (autocast off, a
policy of fp32 parameters) fails here, where every other CPU test would pass: losses and checkpoints look alike."""
import json
import os

import pytest

from hooks import Hooks
from processes import run

def see_env(tmp_path):
    """The environment additions that make every Python process of a run write down what it saw while it trained
    (tests/hooks.py, TEST_SEE_DIR); and the folder it writes to."""
    see_dir = tmp_path / "seen"
    see_dir.mkdir()
    return Hooks(tmp_path, see_dir=see_dir).env, see_dir


def seen(see_dir):
    """What each process that trained saw: one dict per process, sorted by rank."""
    found = [json.loads((see_dir / f).read_text()) for f in os.listdir(see_dir) if f.endswith(".json")]
    return sorted(found, key=lambda s: (s["rank"] is None, s["rank"]))


AMP, FSDP = "ddp_amp_train.py", "fsdp_train.py"
# two processes (started by hand), two optimizer steps of global batch 16, then an evaluation (not recorded: eval mode)
TINY = ["--train-size", 64, "--val-size", 20, "--batch-size", 8, "--epochs", 1, "--max-steps", 2]


@pytest.mark.floor
@pytest.mark.parametrize("script,args,dtype", [
    pytest.param(AMP, [], "torch.bfloat16", id="ddp_amp-default-bf16"),  # its default: no --precision given
    pytest.param(AMP, ["--precision", "fp32"], "torch.float32", id="ddp_amp-fp32"),
    pytest.param(FSDP, ["--precision", "bf16"], "torch.bfloat16", id="fsdp-bf16"),
    pytest.param(FSDP, ["--precision", "fp32"], "torch.float32", id="fsdp-fp32"),
])
def test_training_convolutions_and_linear_layers_compute_in(tmp_path, script, args, dtype):
    env, see_dir = see_env(tmp_path)
    p = run(script, *TINY, *args, "--out-dir", tmp_path / "out", launcher="ranks", nproc=2, env=env)
    if script == AMP:  # the run says what it runs in, too
        assert f"ddp {'fp32' if args else 'bf16'}: 2 processes" in p.stdout, p.stdout
    ranks = seen(see_dir)
    assert [s["rank"] for s in ranks] == [0, 1], ranks  # each rank's own process trained, and was seen
    for s in ranks:
        assert s["dtypes"] == {"Conv2d": [dtype], "Linear": [dtype]}, s
