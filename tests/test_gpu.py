"""Every script on ONE CUDA GPU: what the CPU suite cannot show. Skipped where there is no CUDA; run on a GPU machine by
`python benchmarks/gpu_report.py --part tests` (or `python -m pytest --full tests/test_gpu.py`), in under 6 minutes.

What runs here: each script's default run at world size 1 with NCCL (TF32 on) against the same run on the CPU;
ddp_amp_train.py in bf16 and fp16 (autocast seen running in 16 bits, fp16's GradScaler through a resume); two
processes sharing the GPU over gloo (NCCL refuses two ranks on one GPU): world-size invariance, exact evaluation,
FSDP's sharding (no fallback to one rank) and --sync-bn; dp_train.py scattering to two replicas on one GPU (--gpus
0,0); --compile in every script, --channels-last, checkpoints moving between CPU and GPU, --pretrained;
CUDA_VISIBLE_DEVICES and --gpus; no host sync in a training step (only at the checks).

Dry run: GPU_TESTS_DEVICE=cpu runs the same tests on the CPU (gloo, small data), so that a mistake in them shows up
in CI and not in a GPU machine's scarce minutes; the tests that need a GPU's own features (SyncBatchNorm, DataParallel
replicas, CUDA_VISIBLE_DEVICES) skip there, saying so. Tolerances: 1e-4 max-abs on the weights, 1 point of accuracy.
Runs shared by several tests are made once (the `runs` fixture). On the GPU every run starts real interpreters (under
torchrun for several processes); the dry run starts them as the CPU suite does (processes.run: forked, by hand)."""
import json
import os
import shutil
import sys

import pytest
import torch

from conftest import max_diff, metrics
from processes import command, run
from test_finetune import FINETUNE, cached_weights, fresh_model, images, torch_home  # noqa: F401 (fixtures)

CUDA = os.environ.get("GPU_TESTS_DEVICE", "cuda") == "cuda"
# on a GPU, NCCL for CUDA tensors and gloo beside it for the CPU objects (common.pick_backend)
DEVICE, BACKEND = ("cuda", "cuda:nccl,cpu:gloo") if CUDA else ("cpu", "gloo")
DRY = "dry run on the CPU (GPU_TESTS_DEVICE=cpu): "
pytestmark = [pytest.mark.gpu, pytest.mark.full,
              pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU; on a CPU GPU_TESTS_DEVICE=cpu (or benchmarks/gpu_report.py "
                                 "--dry-run) runs these tests on the CPU")]

TOL = 1e-4  # max-abs: a GPU's kernels are not the CPU's, whose rounding bound is the CPU suite's (conftest.TOL)
LAUNCH, SPAWN, AMP, DP, FSDP = "ddp_launch_train.py", "ddp_spawn_train.py", "ddp_amp_train.py", "dp_train.py", \
    "fsdp_train.py"
SCRIPTS = [DP, LAUNCH, SPAWN, AMP, FSDP]
# the default run: 10,000 synthetic samples, 2 epochs at batch 64 (seconds on a GPU); the dry run makes it smaller
DEFAULT = [] if CUDA else ["--train-size", 2048, "--val-size", 500, "--batch-size", 32]
# the proof runs of tests/test_proof.py: the smooth model, 384 samples, global batch 24, 3 epochs (48 steps), 101
# validation samples
PROOF = ["--model", "smooth", "--train-size", 384, "--val-size", 101, "--epochs", 3, "--log-every", 8,
         "--deterministic"]
# resnet18 (BatchNorm) on the 28x28 synthetic data: 3 steps of global batch 16; 33 validation samples
RESNET = ["--model", "resnet18", "--train-size", 48, "--val-size", 33, "--epochs", 1, "--deterministic"]
# the CPU reference runs: on a GPU machine's cores; in the dry run, 1 (gpu_report.py runs 2 pytest processes)
CPU_THREADS = min(8, len(os.sched_getaffinity(0))) if CUDA else 1


def visible():
    """The GPU the tests use: the first visible one (one GPU is what they are written for); none in the dry run."""
    if not CUDA:
        return {}
    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


# a module every Python process of a run imports first (PYTHONPATH): a forward hook on every module, which writes
# down what each process's convolutions returned and, for dp_train.py, each replica's loss sum
SEE = """
import atexit, json, os, threading
import torch
seen, lock = {"conv": {}, "replicas": []}, threading.Lock()
def hook(module, args, out):
    name = type(module).__name__
    with lock:
        if name == "Conv2d" and module.training:
            key = f"{out.dtype} {out.device.type}"
            seen["conv"][key] = seen["conv"].get(key, 0) + 1
        elif name == "ModelWithLoss" and module.training and len(seen["replicas"]) < 8:
            seen["replicas"].append({"n": len(args[0]), "loss_sum": out[0].item(), "device": str(out[0].device)})
torch.nn.modules.module.register_module_forward_hook(hook)
if os.environ.get("SEE_SYNCS"):  # every host sync after the second optimizer step, by the function it came from
    import traceback, warnings
    from torch.optim.optimizer import register_optimizer_step_post_hook
    seen["syncs"] = {}
    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f.name for f in traceback.extract_stack() if f.filename.endswith(("_train.py", "common.py"))]
            with lock:
                seen["syncs"][ours[-1] if ours else "?"] = seen["syncs"].get(ours[-1] if ours else "?", 0) + 1
    warnings.showwarning, _ = note, warnings.simplefilter("always")
    steps = [0]
    # watched from step 3: DDP rebuilds its buckets once, in step 2's forward, and that copies the bucket indices
    # to the host (Reducer::sync_bucket_indices, non_blocking=false)
    def after_step(*a):
        steps[0] += 1
        if steps[0] == 2:
            torch.cuda.set_sync_debug_mode("warn")
    register_optimizer_step_post_hook(after_step)
def dump():
    json.dump(seen, open(os.path.join(os.environ["SEE_DIR"], f"{os.getpid()}.json"), "w"))
atexit.register(dump)
_exit = os._exit
def dump_then_exit(code):  # the scripts leave by os._exit (failsafe.run_and_exit), which skips atexit
    dump()
    _exit(code)
os._exit = dump_then_exit
"""


class Run:
    """A finished run: its folder, output, metrics rows, last.pt (read on the CPU) and what SEE saw (if asked)."""

    def __init__(self, out_dir, proc, see_dir=None):
        self.dir, self.proc = str(out_dir), proc
        self.rows = metrics(self.dir) if os.path.exists(os.path.join(self.dir, "metrics.jsonl")) else []
        last = os.path.join(self.dir, "last.pt")
        self.ckpt = torch.load(last, map_location="cpu", weights_only=True) if os.path.exists(last) else None
        self.seen = [json.load(open(os.path.join(see_dir, f))) for f in sorted(os.listdir(see_dir))] if see_dir else []


def go(script, *args, out_dir, nproc=1, device=DEVICE, threads=1, env=None, see=False, check=True):
    """One run of `script` on `device` (None: the script's own choice) with the GPU visible (not in the dry run):
    plain python for one process (ddp_spawn_train.py: --nprocs), torchrun for more."""
    env = {**visible(), "OMP_NUM_THREADS": str(threads), **(env or {})}
    see_dir = None
    if see:  # SEE as sitecustomize, imported first by every Python process of the run; each writes to see_dir
        see_dir, hook_dir = str(out_dir) + ".seen", str(out_dir) + ".hook"
        os.makedirs(see_dir)
        os.makedirs(hook_dir)
        with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
            f.write(SEE)
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [hook_dir, os.environ.get("PYTHONPATH")])), SEE_DIR=see_dir)
    flags = [*args] + (["--device", device] if device else []) + ["--out-dir", out_dir]
    fork = None if not CUDA else False
    if script == SPAWN:
        p = run(script, *flags, nproc=nproc, env=env, check=check, fork=fork)
    elif nproc > 1:
        p = run(script, *flags, launcher="torchrun" if CUDA else "ranks", nproc=nproc, env=env, check=check)
    else:
        p = run(script, *flags, env=env, check=check, fork=fork)
    return Run(out_dir, p, see_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(name, script, *args, **go_kwargs): that run, made once for the module."""
    base, done = tmp_path_factory.mktemp("gpu"), {}

    def get(name, script, *args, **kw):
        if name not in done:
            done[name] = go(script, *args, out_dir=base / name, **kw)
        return done[name]
    return get


def default_run(runs, script, device=DEVICE):
    """The default run of `script` at world size 1 (on the CPU: as many threads as the GPU machine can spare)."""
    more = ["--nprocs", 1] if script == SPAWN and device == "cpu" else []  # (on a CPU it would start 2)
    return runs(f"default_{script}_{device}", script, *DEFAULT, *more, device=device,
                threads=CPU_THREADS if device == "cpu" else 1)


def proof_run(runs, name, script=LAUNCH, nproc=1, *more):
    """A run of tests/test_proof.py's size, --deterministic, at global batch 24 over `nproc` processes."""
    return runs(name, script, *PROOF, "--batch-size", 24 // nproc, *more, nproc=nproc)


def assert_loads_without_a_gpu(path, model_name="cnn", channels=1, classes=10):
    """`path` loads with torch.load(weights_only=True) and no map_location in a process that sees no GPU, every
    tensor in it is on the CPU, and its model state loads into a plain model."""
    code = ("import sys, torch\nfrom train_extras import models\n"
            "assert not torch.cuda.is_available()\n"
            "c = torch.load(sys.argv[1], weights_only=True)\n"
            "def walk(x):\n"
            "    if isinstance(x, torch.Tensor): yield x\n"
            "    elif isinstance(x, dict): yield from (t for v in x.values() for t in walk(v))\n"
            "    elif isinstance(x, (list, tuple)): yield from (t for v in x for t in walk(v))\n"
            "assert {t.device.type for t in walk(c)} == {'cpu'}, {t.device for t in walk(c)}\n"
            f"models.make({model_name!r}, {channels}, {classes}).load_state_dict(c['model'])\n"
            "print('loaded', len(c['model']))")
    p = command([sys.executable, "-c", code, path])
    assert p.returncode == 0 and p.stdout.startswith("loaded"), p.stderr[-3000:]


# ---- 1. every script's default run: on the GPU as on the CPU
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_default_run_on_the_gpu_matches_the_cpu(runs, script, record_property):
    """World size 1, the default backend (NCCL on a GPU, gloo beside it), TF32 on (ddp_amp_train.py: bf16): within 1
    point of the accuracy of the same run on the CPU, the same files and metrics, and a last.pt that loads without a
    GPU."""
    gpu, cpu = default_run(runs, script), default_run(runs, script, device="cpu")
    record_property("val_acc", gpu.rows[-1]["val_acc"])
    record_property("val_acc_cpu", cpu.rows[-1]["val_acc"])
    record_property("samples_per_s", gpu.rows[-1]["samples_per_s"])
    record_property("peak_mem_mb", gpu.rows[-1]["peak_mem_mb"])
    assert cpu.rows[-1]["val_acc"] > 0.9  # high and stable: a 1-point comparison means something
    assert abs(gpu.rows[-1]["val_acc"] - cpu.rows[-1]["val_acc"]) <= 0.01
    assert sorted(os.listdir(gpu.dir)) == sorted(os.listdir(cpu.dir)) == ["last.pt", "metrics.jsonl"]
    assert [r["step"] for r in gpu.rows] == [r["step"] for r in cpu.rows]
    assert [sorted(r) for r in gpu.rows] == [sorted(r) for r in cpu.rows]  # the same metrics, with ...
    assert gpu.rows[-1]["world_size"] == 1 and gpu.rows[-1]["val_count"] == cpu.rows[-1]["val_count"]
    peak = gpu.rows[-1]["peak_mem_mb"]  # ... GPU memory where it is on a GPU (dp_train.py: its first GPU's)
    assert cpu.rows[-1]["peak_mem_mb"] is None and (peak > 0 if CUDA else peak is None), (peak, cpu.rows[-1])
    if script == DP:
        assert ("dp: GPUs [0]" if CUDA else "dp: no GPU, training on the CPU") in gpu.proc.stdout
    else:
        assert f"backend {BACKEND}, device {DEVICE}" in gpu.proc.stdout
    assert gpu.ckpt["model"].keys() == cpu.ckpt["model"].keys()
    assert_loads_without_a_gpu(os.path.join(gpu.dir, "last.pt"))


# ---- 2. mixed precision on the GPU
def test_amp_bf16_and_fp16_learn_as_fp32_and_run_in_16_bits(runs, record_property):
    """Each precision's default run: every training convolution returned its dtype (seen by a forward hook in the
    script's own process: autocast really ran), and bf16 and fp16 end within 1 point of fp32's accuracy, with fp32
    weights. (The dry run leaves fp16 out: on a CPU it runs ~13x slower than fp32; the next test still runs it.)"""
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    r = {p: runs(f"amp_{p}", AMP, *DEFAULT, "--precision", p, see=True) for p in dtypes if CUDA or p != "fp16"}
    for p, run_ in r.items():
        record_property(f"val_acc_{p}", run_.rows[-1]["val_acc"])
        assert list(run_.seen[0]["conv"]) == [f"torch.{dtypes[p]} {DEVICE}"], run_.seen
        assert run_.seen[0]["conv"][f"torch.{dtypes[p]} {DEVICE}"] >= 2 * run_.rows[-1]["step"]  # 2 convs a step
    assert r["fp32"].rows[-1]["val_acc"] > 0.9
    for p in set(r) - {"fp32"}:
        assert abs(r[p].rows[-1]["val_acc"] - r["fp32"].rows[-1]["val_acc"]) <= 0.01
        assert max_diff(r[p].ckpt["model"], r["fp32"].ckpt["model"]) > 1e-3  # 16 bits were really in use
        assert all(v.dtype == torch.float32 for v in r[p].ckpt["model"].values())  # the weights stay fp32
        assert (r[p].ckpt["scaler"] != {}) == (p == "fp16")  # a disabled scaler's state is empty


def test_fp16_loss_scale_survives_a_resume(runs, tmp_path):
    """Stopped at step 8 and resumed to step 16: the GradScaler's scale and its count of steps since the last
    overflow go on from the checkpoint (a fresh scaler would count from 0), and the run ends where the uninterrupted
    one does, bit for bit."""
    args = [*PROOF, "--batch-size", 24, "--precision", "fp16", "--max-steps", 16]
    straight = runs("fp16_16_steps", AMP, *args)
    out = tmp_path / "fp16"
    go(AMP, *args[:-1], 8, out_dir=out)
    mid = torch.load(out / "last.pt", map_location="cpu", weights_only=True)["scaler"]
    assert mid["_growth_tracker"] > 0  # steps since the last overflow: a fresh scaler would restart this count
    resumed = go(AMP, *args, "--resume", "auto", out_dir=out)
    assert "resuming at step 8" in resumed.proc.stdout
    end, want = resumed.ckpt["scaler"], straight.ckpt["scaler"]
    assert (end["scale"], end["_growth_tracker"]) == (want["scale"], want["_growth_tracker"])
    assert max_diff(resumed.ckpt["model"], straight.ckpt["model"]) == 0


# ---- 3. two processes on the one GPU, over gloo
def test_two_processes_on_one_gpu_train_as_one(runs):
    """Two ranks sharing the GPU over gloo (which moves CUDA tensors; NCCL refuses two ranks on one GPU) against
    one process at the same global batch, --deterministic: the CPU suite's world-size invariance and exact
    evaluation, on CUDA tensors."""
    one = proof_run(runs, "proof1")
    two = proof_run(runs, "proof2_gloo", LAUNCH, 2, "--backend", "gloo")
    other_seed = proof_run(runs, "proof1_seed1", LAUNCH, 1, "--seed", 1)
    assert f"2 processes, backend gloo, device {DEVICE}" in two.proc.stdout
    assert max_diff(two.ckpt["model"], one.ckpt["model"]) <= TOL
    assert max_diff(one.ckpt["model"], other_seed.ckpt["model"]) >= 100 * TOL  # a real difference would show
    for a, b in zip(two.rows, one.rows, strict=True):
        assert a["val_count"] == b["val_count"] == 101  # every validation sample once, over both ranks
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=TOL) and a["val_acc"] == b["val_acc"]


# ---- 4. FSDP on the GPU
def test_fsdp_shards_on_the_gpu_and_trains_as_ddp(runs, tmp_path, record_property):
    """fsdp_train.py on two gloo ranks sharing the GPU (real sharding: gloo's all-gather and reduce-scatter of
    CUDA tensors), fp32 against DDP, each rank holding half the parameters; and at world size 1 with NCCL."""
    ddp1, fsdp1 = proof_run(runs, "proof1"), proof_run(runs, "proof_fsdp1", FSDP)
    two = go(FSDP, *PROOF, "--batch-size", 12, "--backend", "gloo", nproc=2, out_dir=tmp_path / "fsdp2", check=False)
    assert two.proc.returncode == 0, two.proc.stderr[-5000:]  # no fallback: FSDP's sharding proven on the GPU
    record_property("fsdp_world_size", 2)
    ddp2 = proof_run(runs, "proof2_gloo", LAUNCH, 2, "--backend", "gloo")
    assert max_diff(two.ckpt["model"], ddp2.ckpt["model"]) <= TOL
    assert [r["val_count"] for r in two.rows] == [101] * 3
    assert two.rows[-1]["val_loss"] == pytest.approx(ddp2.rows[-1]["val_loss"], rel=TOL)
    for key in ("param_bytes", "optim_bytes"):  # half of world size 1's (every parameter split in two)
        assert two.rows[-1][key] <= 0.51 * fsdp1.rows[-1][key], (key, two.rows[-1], fsdp1.rows[-1])
    for key in ("param_bytes", "grad_bytes", "optim_bytes", "peak_mem_mb"):
        record_property(f"{key}_rank0_of_2", two.rows[-1][key])
    assert max_diff(fsdp1.ckpt["model"], ddp1.ckpt["model"]) <= TOL
    for key in ("param_bytes", "grad_bytes", "optim_bytes", "peak_mem_mb"):
        record_property(f"{key}_world_size_1", fsdp1.rows[-1][key])
    assert fsdp1.rows[-1]["peak_mem_mb"] > 0 if CUDA else fsdp1.rows[-1]["peak_mem_mb"] is None


def test_fsdp_bf16_learns_as_ddp_fp32(runs, record_property):
    """bf16 parameters (BatchNorm and the reductions in fp32): within 1 point of DDP's fp32 accuracy (the CPU
    suite's test, on the GPU), on two gloo ranks."""
    args, nproc = ["--train-size", 2000, "--val-size", 2000, "--epochs", 2, "--lr", 0.05, "--batch-size", 32], 2
    bf16 = runs("fsdp_bf16", FSDP, *args, "--precision", "bf16", "--backend", "gloo", nproc=nproc, check=False)
    assert bf16.proc.returncode == 0, bf16.proc.stderr[-5000:]
    ddp = runs(f"ddp_fp32_{nproc}", LAUNCH, *args, "--backend", "gloo", nproc=nproc)
    record_property("fsdp_bf16_world_size", nproc)
    record_property("val_acc_bf16", bf16.rows[-1]["val_acc"])
    record_property("val_acc_ddp_fp32", ddp.rows[-1]["val_acc"])
    record_property("peak_mem_mb_bf16", bf16.rows[-1]["peak_mem_mb"])
    assert bf16.rows[-1]["precision"] == "bf16" and bf16.rows[-1]["world_size"] == nproc
    assert ddp.rows[-1]["val_acc"] > 0.9
    assert abs(bf16.rows[-1]["val_acc"] - ddp.rows[-1]["val_acc"]) <= 0.01
    assert max_diff(bf16.ckpt["model"], ddp.ckpt["model"]) > 1e-3  # bf16 was really in use
    assert all(v.dtype == torch.float32 for v in bf16.ckpt["model"].values())


# ---- 5. SyncBatchNorm over gloo on the GPU
def test_sync_bn_normalizes_over_the_global_batch(runs, record_property):
    """--sync-bn on two gloo ranks sharing the GPU: BatchNorm statistics over the global batch of 16, so the run
    ends where one process on the whole batch does (running statistics and weights); without it each rank
    normalizes its own 8 samples and the statistics differ."""
    full = runs("bn_full", LAUNCH, *RESNET, "--batch-size", 16)
    local = runs("bn_local", LAUNCH, *RESNET, "--batch-size", 8, "--backend", "gloo", nproc=2)
    stats = [k for k in full.ckpt["model"] if k.endswith(("running_mean", "running_var"))]
    assert max_diff(local.ckpt["model"], full.ckpt["model"], stats) >= 100 * TOL  # what --sync-bn is for
    if not CUDA:
        pytest.skip(DRY + "SyncBatchNorm takes GPU inputs only")
    synced = runs("bn_sync", LAUNCH, *RESNET, "--batch-size", 8, "--backend", "gloo", "--sync-bn", nproc=2)
    # the statistic furthest from one process's, and its size (the first GPU run: 2.9e-4 over the bound)
    worst = max(stats, key=lambda k: max_diff(synced.ckpt["model"], full.ckpt["model"], [k]))
    record_property("worst_statistic", f"{worst}: {max_diff(synced.ckpt['model'], full.ckpt['model'], [worst]):.2e}"
                    f" apart, largest {full.ckpt['model'][worst].abs().max().item():.2e}")
    assert max_diff(synced.ckpt["model"], full.ckpt["model"], stats) <= TOL
    assert max_diff(synced.ckpt["model"], full.ckpt["model"]) <= TOL
    assert [r["val_count"] for r in synced.rows] == [33]


# ---- 6. DataParallel: two replicas on one GPU
def test_dp_scatters_to_two_replicas_on_one_gpu(tmp_path):
    """--gpus 0,0: DataParallel scatters each batch to two replicas on the same GPU and gathers their loss sums,
    which add up to the one replica's of --gpus 0 at the same global batch; the runs end with the same weights."""
    if not CUDA:
        pytest.skip(DRY + "DataParallel scatters to GPUs only")
    one = go(DP, *PROOF, "--batch-size", 24, "--gpus", "0", out_dir=tmp_path / "one", see=True)
    two = go(DP, *PROOF, "--batch-size", 12, "--gpus", "0,0", out_dir=tmp_path / "two", see=True)
    assert "dp: GPUs [0, 0], global batch 24" in two.proc.stdout and two.rows[-1]["gpus"] == [0, 0]
    first, pair = one.seen[0]["replicas"][0], two.seen[0]["replicas"][:2]  # the first step's replicas
    assert first["n"] == 24 and [r["n"] for r in pair] == [12, 12]
    assert all(r["device"] == "cuda:0" for r in pair)
    assert pair[0]["loss_sum"] + pair[1]["loss_sum"] == pytest.approx(first["loss_sum"], rel=1e-5)
    assert two.rows[-1]["peak_mem_mb"] > 0  # GPU 0's
    assert max_diff(two.ckpt["model"], one.ckpt["model"]) <= TOL


# ---- 7. --compile, --channels-last, checkpoints between CPU and GPU, --pretrained
COMPILE_AS = {DP: (), LAUNCH: (), SPAWN: (), AMP: ("--precision", "fp32"), FSDP: ()}  # fp32: compared with eager


@pytest.mark.parametrize("script", SCRIPTS)
def test_compile_equals_eager(runs, script):
    """--compile in every script (dp_train.py on one GPU: on several it refuses), against the same run eager."""
    if not CUDA:
        pytest.skip(DRY + "tests/test_proof.py::test_compile_changes_only_speed compiles on the CPU")
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not compiler:
        pytest.skip("torch.compile's kernels (Triton on a GPU, C++ on a CPU) need a C compiler, and there is none")
    eager = proof_run(runs, "proof1" if script == LAUNCH else f"proof1_{script}", script, 1, *COMPILE_AS[script])
    compiled = proof_run(runs, f"proof1_compile_{script}", script, 1, *COMPILE_AS[script], "--compile")
    assert list(compiled.ckpt["model"]) == list(eager.ckpt["model"])  # no _orig_mod. prefix
    assert max_diff(compiled.ckpt["model"], eager.ckpt["model"]) <= TOL
    assert max_diff(eager.ckpt["model"], proof_run(runs, "proof1_seed1", LAUNCH, 1, "--seed", 1).ckpt["model"]) \
        >= 100 * TOL


# ---- 8. the training loop leaves the GPU alone between checks
@pytest.mark.parametrize("script", SCRIPTS)
def test_no_host_sync_in_the_training_loop_but_at_its_checks(script, tmp_path):
    """torch.cuda.set_sync_debug_mode("warn") from the end of the second step: every host sync comes from a check
    (failsafe.Agreement.check, and the log line), an epoch's end, the evaluation or a save, none from a training step,
    the loader or the bookkeeping of a step. ddp_amp_train.py in bf16: fp16's GradScaler reads its inf flag every step
    (docs/performance.md)."""
    if not CUDA:
        pytest.skip(DRY + "host syncs are a GPU's")
    more = ("--precision", "bf16") if script == AMP else ()
    done = go(script, *PROOF, "--batch-size", 24, *more, out_dir=tmp_path / "run", see=True, env={"SEE_SYNCS": "1"})
    syncs = {k: v for seen in done.seen for k, v in seen.get("syncs", {}).items()}
    assert syncs, "no host sync seen at all: the checks sync, so the hook saw nothing"
    assert not {"train_step", "train_one_epoch", "step_done", "to_device", "?"} & set(syncs), syncs


def test_channels_last_trains(runs):
    plain = default_run(runs, LAUNCH)
    cl = runs("default_channels_last", LAUNCH, *DEFAULT, "--channels-last")
    assert abs(cl.rows[-1]["val_acc"] - plain.rows[-1]["val_acc"]) <= 0.01


def test_checkpoints_move_between_cpu_and_gpu(runs, tmp_path, record_property):
    """A last.pt written on the CPU resumes on the GPU, and the GPU's on the CPU: steps 1-20 on the CPU, 21-36 on
    the GPU, 37-48 on the CPU end within 1e-4 of 48 steps on the GPU."""
    straight, out = proof_run(runs, "proof1"), tmp_path / "moved"
    go(LAUNCH, *PROOF, "--batch-size", 24, "--max-steps", 20, out_dir=out, device="cpu")
    on_gpu = go(LAUNCH, *PROOF, "--batch-size", 24, "--max-steps", 36, "--resume", "auto", out_dir=out)
    assert "resuming at step 20" in on_gpu.proc.stdout and f"device {DEVICE}" in on_gpu.proc.stdout
    assert_loads_without_a_gpu(str(out / "last.pt"), "smooth")
    back = go(LAUNCH, *PROOF, "--batch-size", 24, "--resume", "auto", out_dir=out, device="cpu")
    assert "resuming at step 36" in back.proc.stdout and [r["step"] for r in back.rows] == [16, 32, 48]
    diff = max_diff(back.ckpt["model"], straight.ckpt["model"])
    record_property("max_diff_cpu_gpu_cpu", diff)
    assert diff <= TOL


def test_pretrained_on_the_gpu(torch_home, images, tmp_path):  # noqa: F811 (fixtures)
    """--pretrained --freeze-backbone from a generated weights file in TORCH_HOME, images decoded in 2 workers into
    pinned memory and made float on the GPU: the backbone stays the cached one bit for bit, and the head learns
    what it learns on the CPU."""
    args = ["--dataset", "imagefolder", "--data-dir", images, *FINETUNE, "--workers", 2, "--deterministic"]
    env = {"TORCH_HOME": str(torch_home)}
    gpu = go(LAUNCH, *args, out_dir=tmp_path / "gpu", env=env)
    cpu = go(LAUNCH, *args, out_dir=tmp_path / "cpu", env=env, device="cpu")
    assert f"device {DEVICE}" in gpu.proc.stdout
    cached, head = cached_weights(torch_home), ["fc.weight", "fc.bias"]
    assert [k for k in cached if k not in head and not torch.equal(gpu.ckpt["model"][k], cached[k])] == []
    assert max_diff(gpu.ckpt["model"], fresh_model("resnet18", 3, 3), head) > 1e-3  # the head did train
    assert max_diff(gpu.ckpt["model"], cpu.ckpt["model"], head) <= TOL
    assert [r["val_count"] for r in gpu.rows] == [9, 9]
    assert_loads_without_a_gpu(os.path.join(gpu.dir, "last.pt"), "resnet18", 3, 3)


# ---- 8. which GPUs a script sees
def test_visible_devices_and_the_gpus_flag(tmp_path):
    """As the README says: CUDA_VISIBLE_DEVICES hides or shows GPUs (the scripts then pick the CPU or the GPU),
    ddp_spawn_train.py starts one process per visible GPU, and dp_train.py --gpus counts the visible GPUs."""
    if not CUDA:
        pytest.skip(DRY + "about GPUs")
    tiny = ["--train-size", 64, "--val-size", 16, "--epochs", 1, "--batch-size", 16]
    hidden = go(LAUNCH, *tiny, out_dir=tmp_path / "hidden", device=None, env={"CUDA_VISIBLE_DEVICES": ""})
    assert "backend gloo, device cpu" in hidden.proc.stdout
    shown = go(SPAWN, *tiny, out_dir=tmp_path / "shown", device=None)  # one visible GPU: one process
    assert "1 process, backend cuda:nccl,cpu:gloo, device cuda" in shown.proc.stdout  # gloo beside NCCL: the CPU's
    assert shown.rows[-1]["world_size"] == 1
    gpu = visible()["CUDA_VISIBLE_DEVICES"]
    p = go(DP, *tiny, "--gpus", "1", out_dir=tmp_path / "gpus1", device=None, check=False).proc
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --gpus 1: the visible GPUs (CUDA_VISIBLE_DEVICES={gpu}) are numbered 0 to 0"]
    p = go(DP, *tiny, "--gpus", "0", out_dir=tmp_path / "none", device=None, check=False,
           env={"CUDA_VISIBLE_DEVICES": ""}).proc
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: --gpus 0: no CUDA GPU is visible (CUDA_VISIBLE_DEVICES=), or --device cpu"]
