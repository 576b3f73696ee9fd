"""The suite's set-up: its two tiers, the runs shared by every test that only needs a finished run, the checks that
compare runs, and the guards that keep a test from seeing the GPUs or leaving files behind. Processes are started by
processes.py, the one module that does.

Tiers: `python -m pytest` is the everyday one, every script under its own launch style end to end; `python -m pytest
--full` adds the tests marked `full` (CI's newest leg). `-m floor`: what CI also runs on the oldest supported torch."""
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from processes import ROOT, SETTINGS, CpuEnv, Forker, run

sys.path.insert(0, str(ROOT))


# ---- the tiers
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="the full tier: also the tests marked full (CI runs it)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    everyday = [item for item in items if item.get_closest_marker("full") is None]
    if len(everyday) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in everyday])
        items[:] = everyday


# ---- numbers the tests measured, and the tests that ran on the SLURM cluster: reported at the end of the run
MEASURED = []  # (test, what, value, tolerance or None): printed at the end of the run, and to MEASURED_JSON
SLURM_RAN = []  # the tests that ran on the one-node SLURM cluster (slurm_cluster.py)


@pytest.fixture
def measured(request):
    """measured(what, value, tolerance=None): a number a test measured (a difference between runs, a time), reported
    at the end of the run ("measured" section) and, if MEASURED_JSON names a file, written there as JSON."""
    def record(what, value, tolerance=None):
        MEASURED.append((request.node.nodeid, what, float(value), tolerance))
        return value
    return record


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for test, what, value, tolerance in MEASURED:
            bound = f"  (tolerance {tolerance:.3g}, {value / tolerance:.2g} of it)" if tolerance else ""
            terminalreporter.write_line(f"{what}: {value:.3g}{bound}  [{test}]")
        if os.environ.get("MEASURED_JSON"):
            with open(os.environ["MEASURED_JSON"], "w") as f:
                json.dump([dict(zip(("test", "what", "value", "tolerance"), m)) for m in MEASURED], f, indent=1)
    if SLURM_RAN:
        terminalreporter.section("SLURM")
        terminalreporter.write_line(f"{len(SLURM_RAN)} tests ran on a one-node SLURM cluster: {', '.join(SLURM_RAN)}")
    if LEFT_BEHIND:
        terminalreporter.section("left behind")
        terminalreporter.write_line("the tests left these behind, which fails the run: " + ", ".join(LEFT_BEHIND))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's run, as each worker ends: the numbers it measured, the tests it ran on the SLURM cluster."""
    output = getattr(node, "workeroutput", {})
    MEASURED.extend(tuple(m) for m in json.loads(output.get("measured", "[]")))
    SLURM_RAN.extend(json.loads(output.get("slurm_ran", "[]")))


# ---- no GPU for the processes a test starts
GUARD = {"on": True, "installed": False}


def refuse_unless_clean(program, env):
    if GUARD["on"] and not isinstance(env, CpuEnv):
        raise AssertionError(f"{program} started without processes.clean_env(): on a GPU machine it would see the "
                             "GPUs")


def install_cpu_pin_guard():
    """Every process a test or fixture starts (Python, torchrun, srun, a shell, `env python`: any program, by any
    of subprocess's or os's ways of starting one) gets its environment from clean_env (no GPU visible), except in
    tests marked gpu. A test that forgets fails here, on any machine, instead of only on a GPU machine. Installed at
    the first test's set-up, not before: pytest-xdist starts its workers before that, with environments of its own."""
    real = subprocess.Popen

    class Guarded(real):
        def __init__(self, args, *a, **kw):
            refuse_unless_clean(args[0] if isinstance(args, (list, tuple)) else args, kw.get("env"))
            super().__init__(args, *a, **kw)
    subprocess.Popen = Guarded
    for name in ("system", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe"):
        if hasattr(os, name):  # none of these takes an environment made by clean_env, but posix_spawn's (its third
            real_call = getattr(os, name)  # argument: subprocess's own way since Python 3.13, given Popen's env)

            def guarded(*a, _name=name, _real=real_call, **kw):
                env = (a[2] if len(a) > 2 else kw.get("env")) if _name.startswith("posix_spawn") else None
                refuse_unless_clean(f"os.{_name}", env)
                return _real(*a, **kw)
            setattr(os, name, guarded)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture of the test is set up (module- and session-scoped ones included): the guard is off only
    for tests marked gpu."""
    if not GUARD["installed"]:
        install_cpu_pin_guard()
        GUARD["installed"] = True
    GUARD["on"] = item.get_closest_marker("gpu") is None


# ---- nothing left behind, of what the tests make. Every started process's TMPDIR is inside pytest's own folder, which
# pytest cleans up; what else they make is told apart by its name: in /tmp, short_tmp's folders;
# in /dev/shm, the named semaphores of the suite's processes (multiprocessing's, which the resource tracker unlinks
# unless it was killed: named by the hooks' TEST_SEMAPHORES); in the checkout, anything new. Those names hold a tag of
# the session's own, which pytest-xdist's workers take from the run that starts them: another program's files, made
# meanwhile (a browser's, another build's, a training run's sem.mp-*, another session's of this suite), are not the
# tests'
TAG = os.environ.get("TEST_SESSION_TAG") or secrets.token_hex(4)  # (a test's run of its own may name its tag)
LEFT_BEHIND = []
IGNORED = re.compile(r"pytest-of-.*|__pycache__|\.pytest_cache|\.ruff_cache|\.venv.*|\.git")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist, in the run that starts a worker
    node.workerinput["tag"] = TAG


def name_what_tests_make(config):
    """This session's names: short_tmp's folders, and the semaphores (processes.clean_env's TEST_SEMAPHORES)."""
    tag = config.workerinput["tag"] if hasattr(config, "workerinput") else TAG
    SETTINGS["short_tmp"], SETTINGS["semaphores"] = f"ddp-tests-{tag}-", f"/mp-tests-{tag}"


def snapshot():
    found = set()
    watched = {"tmp": ("/tmp", SETTINGS["short_tmp"]), "shm": ("/dev/shm", f"sem.{SETTINGS['semaphores'][1:]}-"),
               "checkout": (str(ROOT), "")}
    for where, (folder, prefix) in watched.items():
        with contextlib.suppress(OSError):
            found |= {f"{where}:{name}" for name in os.listdir(folder)
                      if name.startswith(prefix) and not IGNORED.fullmatch(name)}
    for sub in ("tests", "train_extras", "benchmarks", "docs"):
        found |= {f"checkout:{sub}/{n}" for n in os.listdir(ROOT / sub) if not IGNORED.fullmatch(n)}
    return found


def controller(config):
    return not hasattr(config, "workerinput")  # pytest-xdist's workers have one; the run that starts them does not


def pytest_sessionstart(session):
    name_what_tests_make(session.config)
    if controller(session.config):
        session.config.before = snapshot()
    SETTINGS["tmp"] = str(session.config._tmp_path_factory.getbasetemp() / "tmp")
    os.makedirs(SETTINGS["tmp"], exist_ok=True)
    # the tests' own process too (what they do in-process: torch's caches, torchvision's decoders)
    os.environ["TMPDIR"] = tempfile.tempdir = SETTINGS["tmp"]


def pytest_sessionfinish(session):
    Forker.close()
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its numbers go to the run that started it
        session.config.workeroutput["measured"] = json.dumps(MEASURED)
        session.config.workeroutput["slurm_ran"] = json.dumps(SLURM_RAN)
    if controller(session.config) and hasattr(session.config, "before"):
        LEFT_BEHIND[:] = sorted(snapshot() - session.config.before)
        if LEFT_BEHIND and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---- runs shared by every test that only needs a finished run of one of them: made once per session, by whichever
# test (or pytest-xdist worker) asks first
# The proof runs: the smooth model (train_extras/models.py: no ReLU or max-pool decision that another order of
# summation could flip), 384 samples at a global batch of 24, 16 steps an epoch, 3 epochs. 97 validation samples: on 2
# and 3 processes a rank has a batch fewer than rank 0, which FSDP's evaluation must pad (or hang)
PROOF = ["--model", "smooth", "--train-size", 384, "--val-size", 97, "--epochs", 3, "--log-every", 8]
GLOBAL_BATCH, STEPS_PER_EPOCH = 24, 16


def per_process(n, accum=1):
    return ["--batch-size", GLOBAL_BATCH // n // accum] + (["--grad-accum", accum] if accum > 1 else [])


CLIP = 0.1  # --clip-grad: below the gradient norm of every step of the proof runs (about 0.2)
SHARED = {  # name: (script, launcher, processes, flags): launchers as processes.run takes them ("ranks": by hand)
    **{f"launch{n}": ("ddp_launch_train.py", "ranks", n, [*PROOF, *per_process(n)]) for n in (1, 2, 3)},
    "launch2_torchrun": ("ddp_launch_train.py", "torchrun", 2, [*PROOF, *per_process(2)]),
    "spawn2": ("ddp_spawn_train.py", "python", 2, [*PROOF, *per_process(2)]),
    "dp": ("dp_train.py", "python", None, [*PROOF, *per_process(1)]),
    "amp_fp32": ("ddp_amp_train.py", "ranks", 2, [*PROOF, *per_process(2), "--precision", "fp32"]),
    **{f"fsdp{n}": ("fsdp_train.py", "ranks", n, [*PROOF, *per_process(n)]) for n in (1, 2, 3)},
    "accum1": ("ddp_launch_train.py", "ranks", 1, [*PROOF, *per_process(1, accum=2)]),
    "accum2": ("ddp_launch_train.py", "ranks", 2, [*PROOF, *per_process(2, accum=2)]),
    "seed1": ("ddp_launch_train.py", "ranks", 1, [*PROOF, *per_process(1), "--seed", 1]),
    "lost3": ("ddp_launch_train.py", "ranks", 2, [*PROOF, *per_process(2), "--max-steps", 45]),  # a defect's size
    **{f"clip{n}": ("ddp_launch_train.py", "ranks", n, [*PROOF, *per_process(n), "--clip-grad", CLIP])
       for n in (1, 2, 3)},
    "clip_fsdp2": ("fsdp_train.py", "ranks", 2, [*PROOF, *per_process(2), "--clip-grad", CLIP]),
}


class Shared:
    """shared(name): the output folder of the run SHARED[name], made on first use. Under pytest-xdist the folder is
    common to the workers, and a lock file makes the first worker that asks make it while the others wait."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, name):
        script, launcher, nproc, args = SHARED[name]
        out = self.folder / name
        with open(self.folder / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "done").exists():
                if out.exists():
                    shutil.rmtree(out)  # a run that failed half-way
                run(script, *args, "--out-dir", out, launcher=launcher, nproc=nproc)
                (out / "done").touch()
        return str(out)


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    folder.mkdir(exist_ok=True)
    return Shared(folder)


@pytest.fixture(scope="session")
def images(tmp_path_factory):
    """An ImageFolder of 3 classes: 144 training images (9 steps an epoch at 8 a process on 2), 21 for validation."""
    from test_scripts import write_imagefolder
    root = tmp_path_factory.mktemp("images")
    write_imagefolder(root, per_class_train=48)
    return root


@pytest.fixture
def short_tmp():
    """A short folder of its own under /tmp, for a TMPDIR: multiprocessing puts its sockets in folders of its own
    there, and a socket's path ends at 107 bytes (a DataLoader worker sending a batch from under a deep TMPDIR fails
    with "AF_UNIX path too long"); removed after the test."""
    folder = Path(tempfile.mkdtemp(prefix=SETTINGS["short_tmp"], dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


# ---- reading and comparing what runs wrote
def worker_exit_codes(output):
    """{rank: exit code} of the failed workers in torchrun's failure report ("rank : 1 (local_rank: 1)" then
    "exitcode : 2 (pid: ...)"): torchrun itself exits 1 for any failure, whatever its workers' codes."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output)}


def assert_exit(p, code, nproc=None):
    """The documented exit status `code` (docs/failures.md) for what `p` ran: the script's own status where it is
    the process (python, mp.spawn's parent, every hand-started rank); under torchrun, every failed worker's in
    torchrun's report (torchrun itself exits 1), all `nproc` of them if given."""
    output = p.stdout + p.stderr
    if "torch.distributed.run" not in p.args and "torch.distributed.launch" not in p.args:
        codes = getattr(p, "returncodes", [p.returncode])
        assert set(codes) == {code}, f"exit status {codes}, not {code}\n{output[-4000:]}"
        return
    if code == 0:
        assert p.returncode == 0 and not worker_exit_codes(output), output[-4000:]
        return
    codes = worker_exit_codes(output)
    assert p.returncode == 1 and codes and set(codes.values()) == {code}, f"{codes}, not {code}\n{output[-4000:]}"
    if nproc is not None:
        assert sorted(codes) == list(range(nproc)), f"failed ranks {sorted(codes)}\n{output[-4000:]}"


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint(out_dir_or_file):
    path = str(out_dir_or_file)
    path = path if path.endswith(".pt") else os.path.join(path, "last.pt")
    return torch.load(path, map_location="cpu", weights_only=True)


def flat(state, prefix=""):
    """A state dict, nested ones (an optimizer's state) included, as {"a.b": leaf}."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def max_diff(a, b, keys=None):
    """Max absolute difference between two state dicts (nested ones too: an optimizer's state), over all their
    entries (the same keys required) or over `keys`. Every value is looked at: a NaN or inf in any tensor of either
    side fails, and so does any other entry that differs (an integer tensor such as BatchNorm's num_batches_tracked,
    a shape, a number)."""
    a, b = flat(a), flat(b)
    if keys is None:
        assert a.keys() == b.keys(), f"keys differ: {sorted(set(a) ^ set(b))[:10]}"
        keys = list(a)
    assert set(keys) <= a.keys() and set(keys) <= b.keys(), sorted(set(keys) - (a.keys() & b.keys()))[:10]
    largest = 0.0
    for k in keys:
        x, y = a[k], b[k]
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            assert x == y, (k, x, y)
            continue
        assert x.shape == y.shape, (k, x.shape, y.shape)
        if not (x.is_floating_point() or x.is_complex()):
            assert torch.equal(x, y), k
            continue
        assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"{k}: NaN or inf"
        if x.numel():
            largest = max(largest, (x.double() - y.double()).abs().max().item())
    return largest


def summary_lines(output, prefix="epoch "):
    """The per-epoch summary lines (the progress bar is drawn on the same terminal line before them)."""
    return [line[line.index(prefix):] for line in output.replace("\r", "\n").splitlines()
            if prefix in line and "train_loss" in line]


# ---- comparing two trainings
# One tolerance for every comparison of two runs that should train alike (weights and momentum: max-abs; losses:
# relative): 8 units of float32's rounding at 1. The runs compared train the smooth model (PROOF), which has no ReLU or
# max-pool decision that another order of summation could flip: what differs between them stays a rounding
# difference, on any CPU and any kernels. Measured (docs/correctness.md): at most 3.0e-8 on the weights, 6.0e-8 on
# the momentum and the losses, between 1, 2 and 3 processes, every launch style, --grad-accum, --clip-grad, FSDP and
# --compile, with oneDNN held to AVX2 too, on torch 2.11 and 2.14: 16 to 32 times below TOL. The smallest defect,
# three optimizer steps lost at the end of the run (where the LR is almost 0), moves the weights by 4.0e-5: 42 times
# TOL (test_proof.test_the_comparisons_catch_the_smallest_defects)
TOL = 8 * torch.finfo(torch.float32).eps


def assert_same_training(a, b, measured=None, what="", tol=TOL, last_rows=None):
    """Two runs (output folders) trained alike: weights and optimizer state (momentum) within `tol`, with no NaN/inf
    anywhere (max_diff); the same param groups, scheduler state and position; and the same metrics rows: the step,
    epoch, val_count and learning rate of every row exactly, losses within `tol` (relative) and accuracies within
    one validation sample (the last `last_rows` of each, if given: a run resumed into another folder has only its
    own). Returns the weights' difference; `measured` records it and the others."""
    ca, cb = checkpoint(a), checkpoint(b)
    weights, momentum = max_diff(ca["model"], cb["model"]), max_diff(ca["optimizer"]["state"], cb["optimizer"]["state"])
    ra, rb = metrics(a)[-(last_rows or 0):], metrics(b)[-(last_rows or 0):]
    assert len(ra) == len(rb), (what, ra, rb)
    losses = max([abs(x[k] - y[k]) / abs(y[k]) for x, y in zip(ra, rb) for k in ("train_loss", "val_loss")],
                 default=0.0)
    if measured:
        measured(f"{what}: weights", weights, tol)
        measured(f"{what}: momentum", momentum, tol)
        measured(f"{what}: losses (relative)", losses, tol)
    assert weights <= tol, f"{what}: weights differ by {weights:.3g} > {tol:.3g}"
    assert momentum <= tol, f"{what}: momentum differs by {momentum:.3g} > {tol:.3g}"
    assert ca["optimizer"]["param_groups"] == cb["optimizer"]["param_groups"], what
    assert ca["scheduler"] == cb["scheduler"], what  # last_epoch: the number of optimizer steps taken
    for k in ("epoch", "step_in_epoch", "samples_in_epoch", "global_batch"):
        assert ca[k] == cb[k], (what, k, ca[k], cb[k])
    for x, y in zip(ra, rb):
        for k in ("epoch", "step", "val_count", "lr"):
            assert x[k] == y[k], (what, k, x, y)
        assert abs(x["val_acc"] - y["val_acc"]) <= 1 / x["val_count"], (what, x, y)
    assert losses <= tol, f"{what}: losses differ by {losses:.3g} (relative) > {tol:.3g}"
    return weights
