"""bf16 seen running, on the CPU, on every torch the suite runs on: inside each rank's own process, a forward hook
(SEE, imported by every Python process of the run as sitecustomize) writes down the dtype that the model's training
convolutions and linear layers returned. Under `ddp_amp_train.py` (bf16 by default: torch.autocast) and
`fsdp_train.py --precision bf16` (MixedPrecisionPolicy's param_dtype) every one of them returned torch.bfloat16 on
every rank; under --precision fp32, the control, torch.float32. A run that silently trains in fp32 (autocast off, a
policy of fp32 parameters) fails here, where every other CPU test would pass: losses and checkpoints look alike."""
import json
import os

import pytest

from conftest import run

# Imported first by every Python process of a run (PYTHONPATH, where SEE_DIR is set; not by mp.spawn's resource
# tracker, which would import torch for nothing): in training mode, the dtype each Conv2d and Linear returned, and
# the threads torch had at the first such call (for tests/test_claims.py). Written to SEE_DIR/<pid>.json whenever
# something new is seen, never at exit: every script leaves by os._exit (common.run), which skips atexit.
# Processes that train nothing (torchrun's agent, mp.spawn's parent) write no file.
SEE = '''
import json, os, sys, threading
if os.environ.get("SEE_DIR") and "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import torch
    import torch.distributed as dist
    _lock, _seen = threading.Lock(), {"pid": os.getpid(), "rank": None, "threads": None, "cpus": None, "dtypes": {}}

    def _write():
        path = os.path.join(os.environ["SEE_DIR"], f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(_seen, f)
        os.replace(path + ".tmp", path)

    def _hook(module, args, out):
        if not (module.training and isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) and torch.is_tensor(out)):
            return
        kind = "Conv2d" if isinstance(module, torch.nn.Conv2d) else "Linear"  # FSDP renames the class FSDPConv2d
        with _lock:
            new = _seen["threads"] is None or str(out.dtype) not in _seen["dtypes"].get(kind, [])
            if new:
                if _seen["threads"] is None:
                    _seen["threads"], _seen["cpus"] = torch.get_num_threads(), len(os.sched_getaffinity(0))
                    _seen["rank"] = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
                _seen["dtypes"][kind] = sorted({*_seen["dtypes"].get(kind, []), str(out.dtype)})
                _write()
    torch.nn.modules.module.register_module_forward_hook(_hook)
'''


def see_env(tmp_path):
    """The environment additions that make every Python process of a run import SEE; and the folder it writes to."""
    hook_dir, see_dir = tmp_path / "see_hook", tmp_path / "seen"
    hook_dir.mkdir()
    see_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SEE)
    path = os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "SEE_DIR": str(see_dir)}, see_dir


def seen(see_dir):
    """What each process that trained saw: one dict per process, sorted by rank."""
    found = [json.loads((see_dir / f).read_text()) for f in os.listdir(see_dir) if f.endswith(".json")]
    return sorted(found, key=lambda s: (s["rank"] is None, s["rank"]))


AMP, FSDP = "ddp_amp_train.py", "fsdp_train.py"
# two processes under torchrun, two optimizer steps of global batch 16, then an evaluation (not recorded: eval mode)
TINY = ["--train-size", 64, "--val-size", 20, "--batch-size", 8, "--epochs", 1, "--max-steps", 2]


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.parametrize("script,args,dtype", [
    pytest.param(AMP, [], "torch.bfloat16", id="ddp_amp-default-bf16"),  # its default: no --precision given
    pytest.param(AMP, ["--precision", "fp32"], "torch.float32", id="ddp_amp-fp32"),
    pytest.param(FSDP, ["--precision", "bf16"], "torch.bfloat16", id="fsdp-bf16"),
    pytest.param(FSDP, ["--precision", "fp32"], "torch.float32", id="fsdp-fp32"),
])
def test_training_convolutions_and_linear_layers_compute_in(tmp_path, script, args, dtype):
    env, see_dir = see_env(tmp_path)
    p = run(script, *TINY, *args, "--out-dir", tmp_path / "out", launcher="torchrun", nproc=2, env=env)
    if script == AMP:  # the run says what it runs in, too
        assert f"ddp {'fp32' if args else 'bf16'}: 2 processes" in p.stdout, p.stdout
    ranks = seen(see_dir)
    assert [s["rank"] for s in ranks] == [0, 1], ranks  # each rank's own process trained, and was seen
    for s in ranks:
        assert s["dtypes"] == {"Conv2d": [dtype], "Linear": [dtype]}, s
