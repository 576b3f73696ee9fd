"""What the scripts share that does not depend on how their processes are launched. The built-in data and models
(the defaults included), fine-tuning, sharded checkpoints and torchrun restarts are in train_extras/, imported only
where a flag or a default asks for them: with your own Dataset and nn.Module, a script and this file run alone."""
import argparse
import contextlib
import datetime
import errno
import gc
import importlib
import inspect
import json
import math
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset, default_collate
from tqdm import tqdm


class UsageError(Exception):
    """Ends the run (common.run): the message printed once, by rank `printer` (None: each rank that raised it), then
    exit status `code`: 2 bad input, 1 a NaN/inf loss, 3 a rank that stopped answering, 0/143 a stop signal."""

    def __init__(self, message, code=2, printer=0):
        super().__init__(message)
        self.code, self.printer = code, printer


class DataError(UsageError):
    """A sample that cannot train, found where it is read (a DataLoader worker, or this process): only that rank
    knows, so that rank prints it. From a worker it comes back with the worker's traceback as its message: the last
    line is the one."""

    def __init__(self, message, printer=None):
        super().__init__(message, printer=printer)

    def __str__(self):
        return super().__str__().strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1]


class NotASample(DataError):
    """What every sample is, and so every rank finds: rank 0 says it."""

    def __init__(self, message):
        super().__init__(message, printer=0)


# ---- the command line: the same flags, with the same meanings, in every script
def number(kind, low, high=math.inf, above=False):
    """An argparse type: an int or float at least `low` (above it, if `above`) and below `high` (NaN, inf: never)."""
    def parse(text):
        value = kind(text)  # a ValueError: argparse says "invalid int value"
        if not ((low < value) if above else (low <= value)) or not value < high:
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}"
                                             + (f" and below {high}" if high < math.inf else "") + f", got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


class Parser(argparse.ArgumentParser):
    one_process, sharded = None, False  # a one-process script: why a launcher is wrong; fsdp_train.py: sharded saves
    collectives = True  # its processes join a process group, even alone (dp_train.py: none)

    def error(self, message):  # one line, printed once by common.run (not once per process of a launcher), exit 2
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, *a, **kw):  # and the checks of flags together, of this machine and of this script
        if self.one_process and (launcher := one_of_several()):  # before the old launcher's --local-rank is unknown
            raise UsageError(f"{self.prog} {self.one_process}: start it with python, not {launcher}")
        args = super().parse_args(*a, **kw)
        for wrong, why in [
                ((args.ckpt_format == "dcp" or args.async_save) and not self.sharded, "--ckpt-format dcp and "
                 "--async-save are fsdp_train.py's: a whole copy of the model saves faster as one last.pt"),
                (args.freeze_backbone and not (args.pretrained or args.weights), "--freeze-backbone needs --pretrained "
                 "or --weights: a random backbone is not worth freezing"),
                (args.tensorboard and not importlib.util.find_spec("tensorboard"), "--tensorboard needs the "
                 "tensorboard package: pip install tensorboard"),
                (args.warmup_epochs > args.epochs, f"--warmup-epochs {args.warmup_epochs} is longer than --epochs "
                 f"{args.epochs}: the LR would never reach --lr")]:
            if wrong:
                raise UsageError(why)
        args.device = device_type(args.device, self.collectives)
        return args


class Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # the docstring as written, and each flag's default where it has one
        return action.help + ("" if action.default in (None, False, argparse.SUPPRESS) else " (default: %(default)s)")


def get_parser(doc):
    p = Parser(description=doc, formatter_class=Formatter)
    a, positive = p.add_argument, number(int, 1)
    a("--dataset", default="synthetic", choices=["synthetic", "mnist", "cifar10", "imagefolder"],
      help="synthetic (offline), mnist, cifar10, imagefolder: all train_extras/datasets.py's")
    a("--data-dir", default="./data", help="mnist/cifar10: downloaded here; imagefolder: the folder of train/, val/")
    a("--train-size", type=positive, help="training samples (synthetic: default 10000; real data: a random subset)")
    a("--val-size", type=positive, help="validation samples (synthetic: default 2000; real data: a random subset)")
    a("--image-size", type=number(int, 7), help="imagefolder: resize to this square (default 224)")
    a("--synthetic-shape", default="1x28x28", help="synthetic: CxHxW, e.g. 3x224x224 (H, W at least 7)")
    a("--model", default="cnn", help="train_extras/models.py's: cnn (a small 2-conv net) or a torchvision model")
    tune = p.add_mutually_exclusive_group().add_argument  # fine-tuning: train_extras/finetune.py
    tune("--pretrained", action="store_true", help="start from the torchvision model's ImageNet weights, a new head")
    tune("--weights", help="start from this state_dict or checkpoint: the tensors that match by name and shape")
    a("--freeze-backbone", action="store_true", help="train only the classifier head")
    a("--epochs", type=positive, default=2, help="passes over the training set")
    a("--batch-size", type=positive, default=64, help="per process; the global batch is this times the processes")
    a("--lr", type=number(float, 0), default=0.01, help="peak LR for the global batch, NOT rescaled with processes")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd (with --momentum) or adamw")
    a("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    a("--weight-decay", type=number(float, 0), default=5e-4, help="weight decay")
    a("--warmup-epochs", type=number(float, 0), default=0.0, help="linear warmup, then cosine decay to 0")
    a("--seed", type=number(int, 0, 2**32), default=0, help="model init, synthetic data, data order")
    a("--workers", type=number(int, 0), default=2, help="DataLoader worker processes for files")
    a("--max-steps", type=positive, help="stop after this many optimizer steps in all")
    a("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    a("--out-dir", help="where metrics.jsonl and last.pt go (default ./runs/<script name>)")
    fresh = p.add_mutually_exclusive_group().add_argument
    fresh("--resume", help="a checkpoint to continue from, or 'auto': the one in --out-dir, if any")
    fresh("--overwrite", action="store_true", help="start afresh, replacing --out-dir's checkpoint")
    a("--save-every", type=positive, help="also save every N optimizer steps, not only at epoch ends")
    a("--ckpt-format", choices=["file", "dcp"], default="file", help="dcp: sharded checkpoints (fsdp_train.py)")
    a("--async-save", action="store_true", help="dcp checkpoints written in the background (fsdp_train.py)")
    a("--clip-grad", type=number(float, 0, above=True), metavar="MAX_NORM", help="clip the gradients' global norm")
    a("--step-timeout", type=number(float, 0, above=True), default=300, help="after the first step, seconds a "
      "collective may wait; then every rank stops, and the ranks that did not arrive are named")
    a("--log-every", type=positive, default=20, help="a progress line and NaN/inf check every N steps (or sooner)")
    a("--tensorboard", action="store_true", help="also log to TensorBoard in --out-dir")
    a("--device", choices=["cpu", "cuda", "xpu", "mps"], help="default: the accelerator torch finds (cuda also on "
      "ROCm), else cpu")
    a("--channels-last", action="store_true", help="channels_last memory format for images (faster convs on GPU)")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--deterministic", action="store_true", help="no TF32, deterministic cuDNN: for comparing weights, not speed")
    return p


def optional(name, flag):
    """train_extras/<name>.py, which `flag` needs; if it was not copied, one line saying so."""
    try:
        return importlib.import_module(f"train_extras.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("train_extras", f"train_extras.{name}"):
            raise
        raise UsageError(f"{flag} needs train_extras/{name}.py: copy it (and train_extras/__init__.py) next to "
                         "this script") from None


# ---- who this process is, and on what device: the same for every launcher and machine
LAUNCHERS = {  # how a launcher names (rank, world size, local rank, local world size); srun's is read apart
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # also the old launcher, any env:// launch
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    "mpiexec": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}  # MPICH, Intel MPI


def launcher_env():
    """(rank, world_size, local_rank, local_world_size, launcher): as torchrun (or a hand launch, such as a Kubernetes
    PyTorchJob's: without LOCAL_RANK, one process per machine), mpirun or srun set them; else a lone process."""
    env = os.environ
    launcher, names = next(((k, v) for k, v in LAUNCHERS.items() if v[0] in env or v[1] in env), (None, None))
    if names is None:
        return srun_env(env) if "SLURM_STEP_NUM_TASKS" in env else (0, 1, 0, 1, None)  # (sbatch's script: no STEP)
    if not (names[0] in env and names[1] in env):
        raise UsageError(f"{names[0]} and {names[1]} go together, and only one is set: set both, or neither")
    if launcher == "torchrun" and "LOCAL_RANK" not in env:  # a hand launch, a Kubernetes PyTorchJob
        launcher = "env:// (no LOCAL_RANK: one process per machine)"
    world = int(env[names[1]])
    if world > 1 and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        raise UsageError(f"{launcher}: {world} processes, but no MASTER_ADDR and MASTER_PORT (where rank 0 meets the "
                         "others): set both, the same on every machine")
    return int(env[names[0]]), world, int(env.get(names[2], 0)), int(env.get(names[3], 1)), launcher


def srun_env(env):
    """launcher_env's, for a task of an srun step; rank 0 is met on the step's first node, at a port of the job's."""
    counts = re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_STEP_TASKS_PER_NODE"])  # e.g. "8(x2),4"
    local_world = [int(n) for count, times in counts for n in [count] * int(times or 1)][int(env["SLURM_NODEID"])]
    first_node = re.match(r"[^,\[]+(\[[^,\-\]]+)?", env["SLURM_STEP_NODELIST"]).group(0)  # e.g. "gpu[3-4]"
    env.setdefault("MASTER_ADDR", first_node.replace("[", ""))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))  # the same on every node, per job
    return (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"]), local_world,
            "srun")


def one_of_several():  # the launcher that started this process as one of several (torchrun: of any number), if any
    try:
        _, world, _, _, launcher = launcher_env()
    except UsageError:
        return "a launcher"
    return launcher if world > 1 or "TORCHELASTIC_RUN_ID" in os.environ else None


def device_type(asked, collectives=True):
    """--device, checked; by default the accelerator torch finds (cuda, also on ROCm; xpu; mps), else the CPU. With
    collectives, not MPS: no process group backend moves MPS tensors (pytorch/pytorch#160732), even at world size 1."""
    found = getattr(torch.accelerator.current_accelerator(check_available=True), "type", None)
    kind = asked or (found if found and not (collectives and found == "mps") else "cpu")
    if kind not in ("cpu", found):
        raise UsageError(f"--device {kind}, but torch finds no {kind} device here (its accelerator: {found})")
    if kind == "mps" and collectives:
        raise UsageError("--device mps: no process group backend moves MPS tensors; one process on MPS is "
                         "dp_train.py, several processes: --device cpu")
    return kind


def local_device(kind, local_rank):
    """The device of this process: of the devices of `kind` that it sees, the local_rank-th (shared round robin)."""
    if kind == "cpu":
        return torch.device("cpu")
    torch.accelerator.set_device_index(index := local_rank % torch.accelerator.device_count())
    return torch.device(kind, index)


def pick_backend(args, local_world_size, launcher):
    """--backend, else torch's for the device: gloo on the CPU, nccl on cuda (RCCL on ROCm), xccl on xpu. These want a
    device per process: refused where a process sees fewer than its machine has processes, but one (srun may give
    each task its own: --gpus-per-task; two processes on one GPU, NCCL refuses itself)."""
    backend = args.backend or dist.get_default_backend_for_device(args.device)
    count = torch.accelerator.device_count() if args.device != "cpu" else 0
    if backend != "gloo" and (count == 0 or local_world_size > count and not (launcher == "srun" and count == 1)):
        raise UsageError(f"--backend {backend} needs one accelerator per process: {local_world_size} processes on this "
                         f"machine, {count} {args.device} devices (gloo can share one)")
    # and gloo for what is on the CPU: the object collectives (pickled flags, errors, the checkpoint's metadata) go
    # there, not through the accelerator. (Without an accelerator such a group fails to initialise: gloo alone)
    return backend if backend == "gloo" else f"{args.device}:{backend},cpu:gloo"


def same_flags(args, allowed=("out_dir", "data_dir", "workers", "tensorboard", "local_rank")):
    """Every rank runs rank 0's flags, but the per-machine ones: else one line naming the first that differs."""
    mine = {k: v for k, v in vars(args).items() if k not in allowed}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, flags in enumerate(everyone):
        if differ := [k for k in everyone[0] if flags.get(k) != everyone[0][k]]:
            raise UsageError(f"every process must be given the same flags: --{differ[0].replace('_', '-')} is "
                             f"{everyone[0][differ[0]]} on rank 0, {flags.get(differ[0])} on rank {rank}")


def set_threads_and_math(local_world_size, deterministic):
    """This machine's cores shared among its processes (as torchrun does with several; srun never); TF32 and autotuned
    convolutions on GPUs, unless --deterministic."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux only
        torch.set_num_threads(max(1, cores // local_world_size))
    torch.backends.cudnn.benchmark = torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = not deterministic, deterministic


def on_rank0(fn, rank):
    """fn() where `rank` (global, or local: once per machine) is 0, while the others wait; a UsageError raised there
    is raised on every rank, so that none waits forever in a collective for one that has stopped."""
    result, errors = None, [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    try:
        result = fn() if rank == 0 else None
    except UsageError as e:
        errors = [str(e)] * len(errors)
    if dist.is_initialized():
        dist.all_gather_object(errors, errors[0])
    if any(errors):
        raise UsageError(next(e for e in errors if e))
    return result


# ---- the data and the model: replace these two calls with your own Dataset and nn.Module
def load_data(args, download=False):
    """(train_set, val_set): map-style datasets of (x, label), train_extras/datasets.py's (synthetic, the default,
    included). download=True: the one process that may fetch files."""
    return optional("datasets", f"--dataset {args.dataset}").load(args, download)


def make_model(name, data):
    """train_extras/models.py's (cnn, the default, or a torchvision model), for the channels and classes of `data`."""
    return optional("models", f"--model {name}").for_data(name, data)


def make_loader(ds, batches, run):
    """A DataLoader over `batches` (lists of indices). In-memory tensors: one index a batch, in this process, on the
    accelerator if they fit. Other datasets: --workers processes, pinned memory. Its own generator: the workers' seed
    is not drawn from the one dropout uses, so a resumed run draws what an unbroken one did."""
    if not isinstance(ds, TensorDataset):
        return DataLoader(ds, batch_sampler=batches, num_workers=run.args.workers, generator=torch.Generator(),
                          pin_memory=run.device.type in ("cuda", "xpu"), collate_fn=collate,
                          **(worker_start(ds) if run.args.workers else {}))
    if run.device.type != "cpu" and sum(t.nbytes for t in ds.tensors) < 2**32:
        ds.tensors = tuple(t.to(run.device) for t in ds.tensors)  # copied once, not every step
    # the epoch's indices copied there at once: a list, made a tensor at each step, would wait for the device there
    index = torch.tensor([i for b in batches for i in b], dtype=torch.long, device=ds.tensors[0].device)
    return DataLoader(ds, sampler=index.split([len(b) for b in batches]), batch_size=None, generator=torch.Generator())


def worker_start(ds):
    """The DataLoader's workers started by a fork server, as Python 3.14 does by default, not forked from this
    process: a fork while another thread (gloo's, tqdm's) holds one of Python's locks leaves the worker deadlocked at
    its start, and the run with it (python/cpython#112275: here, Python 3.11.7, 3 hangs in about 1,200 worker
    starts). The server starts once, with what this script imported: a worker, which runs the script's top lines
    again, imports nothing and starts in milliseconds. Windows: spawn, the only way there."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    context = multiprocessing.get_context("forkserver")
    warnings.filterwarnings("ignore", "Got pickle error when attempting to start a worker")  # run() says it, once
    imported = {v.__name__ if inspect.ismodule(v) else getattr(v, "__module__", None)
                for v in [ds, collate, *vars(sys.modules["__main__"]).values()]}
    context.set_forkserver_preload(sorted(m for m in imported if isinstance(m, str) and not m.startswith("_")))
    return dict(multiprocessing_context=context, worker_init_fn=leave_server)


def leave_server(worker_id):
    """In each worker: the server runs while any process holds its end of a pipe, its workers too, and a worker runs
    while its parent, the server, does. Closed here, the server ends with this process even when it is killed
    outright (the OOM killer), and each worker within 5 s of the server (torch's check of its parent)."""
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_alive_fd", None) is not None:  # private: run here on 3.11 only
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None


def collate(samples):
    """default_collate of (input, label) samples; other samples, or inputs of sizes that do not stack, one line."""
    if (s := next((s for s in samples if not (isinstance(s, (tuple, list)) and len(s) == 2)), None)) is not None:
        got = f"a dict of {list(s)}" if isinstance(s, dict) else f"{len(s)} values" if isinstance(s, (tuple, list)) \
            else f"a {type(s).__name__}"
        raise NotASample(f"your Dataset's __getitem__ returns {got}: return two, (input, label), e.g. "
                        "`return d['image'], d['label']`")
    try:
        return default_collate(samples)
    except RuntimeError:
        if len(shapes := {tuple(getattr(x, "shape", ())) for x, _ in samples}) < 2:  # (tensors, numpy arrays)
            raise
        raise DataError(f"inputs of different sizes in one batch ({', '.join(map(str, sorted(shapes)[:3]))}): resize "
                        "them to one in your Dataset (torchvision.transforms.v2.Resize), or give --dataset "
                        "imagefolder an --image-size") from None


def to_device(run, ds, x, y):
    """A batch on the device. Images only: uint8 (4x fewer bytes to copy) made float there by the dataset's
    `normalize`; --channels-last."""
    y = y[:, 0] if y.ndim == 2 and y.shape[1] == 1 else y  # a label of shape (1,) per sample
    if y.is_floating_point() or y.ndim != 1:  # (dtype and shape: no wait for the device)
        raise UsageError(f"labels must be class indices, one integer per sample, not {y.dtype} of shape "
                         f"{tuple(y.shape)}: return int(label) from your Dataset's __getitem__")
    x = x.float() if x.dtype == torch.float64 else x  # numpy's default dtype, for a float32 model
    x, y = x.to(run.device, non_blocking=True), y.to(run.device, torch.long, non_blocking=True)  # int32 labels too
    x = ds.normalize(x) if x.dtype == torch.uint8 and hasattr(ds, "normalize") else x
    return x.contiguous(memory_format=torch.channels_last) if run.args.channels_last and x.ndim == 4 else x, y


def logits(out):
    """A model's output as the loss wants it: its logits, also out of a tuple (auxiliary outputs, as googlenet and
    inception return in training: the first) or a dict (its "logits")."""
    return out[0] if isinstance(out, (tuple, list)) else out["logits"] if isinstance(out, dict) else out


def make_optimizer(args, model, steps_per_epoch):
    """The optimizer over the trainable parameters, and its schedule (per step): linear warmup, then cosine to 0."""
    params, kw = [p for p in model.parameters() if p.requires_grad], dict(weight_decay=args.weight_decay, foreach=True)
    optimizer = torch.optim.AdamW(params, args.lr, **kw) if args.optimizer == "adamw" else \
        torch.optim.SGD(params, args.lr, args.momentum, **kw)
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch
    cosine = lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))  # noqa: E731
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup
                                                        else cosine(s))


# ---- checkpoint files: written atomically, read on the CPU, checked against this run before use
def save_atomic(obj, path):
    """A temporary file, fsynced, then renamed over `path`: a process killed mid-save leaves the previous file whole.
    A write that fails (a full disk, a quota, a folder gone or no longer writable) is one line naming the cause."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise save_failed(path, e) from None
    finally:
        if os.path.exists(tmp):  # a full disk: no partial file left behind
            os.remove(tmp)


def save_failed(path, e):
    """The one line of a save that failed with `e`: its cause and the room left there (on a full disk, torch's own
    writer says only "unexpected pos")."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0][:120]
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(os.path.dirname(path) or ".").free / 2**20
        why = f"{os.strerror(errno.ENOSPC) if free < 1 and isinstance(e, RuntimeError) else why}; {free:.1f} MiB " \
              "free there"
    return UsageError(f"could not save {path}: {why}. The previous checkpoint, if any, is whole")


def read_checkpoint(path):
    """A file's contents, on the CPU (no memory on GPU 0), tensors only (no code in the file runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # missing, empty, truncated, not a torch file, or Python objects that weights_only refuses
        raise UsageError(f"{path} is not a readable checkpoint of tensors ({type(e).__name__}): no such file, a "
                         "truncated one, or a whole pickled model (save model.state_dict() instead)?") from None


def make_out_dir(out_dir, fresh):
    """--out-dir, made; `fresh`: a new run where an earlier one's last.pt is, which it must not replace unasked."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()  # writable: a read-only disk said now, not an epoch later
    except OSError as e:  # a file of that name, no permission, a read-only disk
        raise UsageError(f"--out-dir {out_dir}: {e.strerror}: give a folder this user can write to") from None
    if fresh:
        raise UsageError(f"{out_dir} holds the last.pt of an earlier run: --resume auto continues it, --overwrite "
                         "replaces it, or give another --out-dir")


def find_checkpoint(run):
    """Rank 0, before anything is written: the checkpoint --resume names, checked against this run, or None. A fresh
    run never replaces an earlier last.pt unasked."""
    args, path = run.args, os.path.join(run.out_dir, "last.pt")
    make_out_dir(run.out_dir, fresh=os.path.exists(path) and not (args.resume or args.overwrite))
    if args.resume == "auto" and not os.path.exists(path):
        print(f"--resume auto: no last.pt in {run.out_dir}, starting afresh", flush=True)
    if not args.resume or (args.resume == "auto" and not os.path.exists(path)):
        return None
    path = path if args.resume == "auto" else args.resume
    path = os.path.join(path, "last.pt") if os.path.isfile(os.path.join(path, "last.pt")) else path  # its folder
    if os.path.isdir(path):
        raise UsageError(f"{path} is a sharded checkpoint of fsdp_train.py: convert it to one file first: python -m "
                         f"train_extras.sharded {path} last.pt")
    ckpt = read_checkpoint(path)
    model = ckpt.get("model") if isinstance(ckpt, dict) else None
    return check_fits(path, ckpt, {k: v.shape for k, v in model.items()} if isinstance(model, dict) else None, run)


def check_fits(path, ckpt, shapes, run):
    """`ckpt` (a training state, its model's tensors of `shapes`) if this run can continue it, else one line."""
    if shapes != {k: v.shape for k, v in run.raw_model.state_dict().items()} or "optimizer" not in ckpt or \
            (a := ckpt.get("args", {})).get("freeze_backbone", False) != run.args.freeze_backbone:
        raise UsageError(f"{path} is not a training state of this model and flags (another --model, classes or "
                         "channels, --freeze-backbone; or weights only: give it to --weights)")
    if a.get("optimizer", "sgd") != run.args.optimizer:  # its state would go into another optimizer's
        raise UsageError(f"{path} was trained with --optimizer {a.get('optimizer', 'sgd')}: to start "
                         f"{run.args.optimizer} from its weights, give it to --weights instead of --resume")
    if (saved := ckpt.get("global_batch") or a["batch_size"] * a.get("grad_accum", 1) * ckpt["world_size"]) \
            != run.global_batch:
        raise UsageError(f"{path} was trained with a global batch of {saved}, this run's is {run.global_batch}: keep "
                         f"--batch-size x processes x --grad-accum = {saved}")
    say_changed(a, run.args)
    if ckpt.get("steps_per_epoch", run.steps_per_epoch) != run.steps_per_epoch:  # the position would be elsewhere
        raise UsageError(f"{path} was trained with {ckpt['steps_per_epoch']} steps per epoch, this run has "
                         f"{run.steps_per_epoch}: the data set changed (--train-size, the files); keep it, or start "
                         "from its weights with --weights")
    return ckpt


def say_changed(saved, args):
    """One line naming the flags of the optimizer and schedule that differ from the checkpoint's `saved`: --lr,
    --momentum and --weight-decay are in the optimizer's state, which goes on; the schedule is rebuilt from them."""
    changed = {k: (saved[k], getattr(args, k)) for k in ("lr", "momentum", "weight_decay", "epochs", "warmup_epochs")
               if k in saved and saved[k] != getattr(args, k)}
    if changed:
        print("flags that differ from the checkpoint's: " + ", ".join(
            f"--{k.replace('_', '-')} {new} " + (f"(was {old}: the LR schedule is the new one from here)" if "epochs"
                                                 in k else f"(ignored: its {old} goes on)")
            for k, (old, new) in changed.items()), flush=True)


def rng_state(device):
    """This process's random number generators (dropout draws from them): the CPU's and its accelerator's."""
    on = {} if device.type == "cpu" else {device.type: [torch.get_device_module(device).get_rng_state(device)]}
    return {"cpu": torch.get_rng_state(), **on}


def restore_rng(saved, run):
    """This rank's generators as the checkpoint holds them; at another world size, seeded from (seed, step, rank)."""
    if len(states := saved.get("rng") or []) == run.world_size:
        torch.set_rng_state(states[run.rank]["cpu"])
        for state in states[run.rank].get(run.device.type, []) if run.device.type != "cpu" else []:
            torch.get_device_module(run.device).set_rng_state(state, run.device)  # (only of the same kind)
    else:
        torch.manual_seed((run.args.seed * 1_000_000_007 + (saved["epoch"] * 1_000_003 + saved["step_in_epoch"])
                           * 1_009 + run.rank) % 2**63)


# ---- where training stands, what every rank agrees on at its checks, and rank 0's output
received = 0  # the stop signal this process got: a signal handler's only way out is a global


STOP_SIGNALS = [getattr(signal, name) for name in ("SIGUSR1", "SIGTERM", "SIGHUP") if hasattr(signal, name)]


def note_signal(signum, _):
    """SIGUSR1 (a time limit near), SIGTERM (preemption) or SIGHUP (the terminal closed, as SIGTERM): noted; every
    rank saves and stops at the step of the next check. A second SIGTERM or SIGHUP ends the process at once."""
    global received
    if signum != getattr(signal, "SIGUSR1", None):
        signal.signal(signum, signal.SIG_DFL)
    received = max(received, signum)


class Progress:
    """Where training stands, as a checkpoint keeps it; the epoch's sums (loss, gradient norm) on the device, read only
    at the checks (no host sync a step); rank 0's progress bar."""
    CHECK_S, NEVER = 2.0, 2.0**52  # the checks' cadence in seconds; "no NaN/inf step yet"

    def __init__(self, run, saved=None):
        # what it needs of the run, not the run itself (no reference cycle through it)
        self.args, self.rank, self.device, self.scheduler = run.args, run.rank, run.device, run.scheduler
        self.steps_per_epoch, self.global_batch, saved = run.steps_per_epoch, run.global_batch, saved or {"epoch": 0}
        self.epoch, self.saved_sums = saved["epoch"], [saved.get("loss_sum", 0.0), saved.get("grad_norm_sum", 0.0)]
        steps = saved.get("step_in_epoch", 0)  # (format 1 counted the position in steps; format 2 in samples)
        self.step_in_epoch = saved.get("samples_in_epoch", steps * self.global_batch) // self.global_batch
        self.step = self.epoch * self.steps_per_epoch + self.step_in_epoch
        self.exact = torch.float32 if self.device.type == "mps" else torch.float64  # (MPS has no float64)
        self.first_bad = torch.full((), self.NEVER, dtype=self.exact, device=self.device)
        self.next_check, self.checked = self.step + 1, None

    def start_epoch(self, epoch):  # a resumed epoch keeps the sums of its saved part
        for sig in STOP_SIGNALS if not received else []:  # now there is something to save; before, they end the run
            signal.signal(sig, note_signal)
        self.epoch, self.step_in_epoch = epoch, self.step_in_epoch if epoch == self.epoch else 0
        sums = self.saved_sums if self.step_in_epoch else [0.0, 0.0]
        self.sums, self.t0, self.t1 = torch.tensor(sums, dtype=self.exact, device=self.device), None, None
        self.loss_sum, self.norm_sum = self.sums.unbind()  # views of it: one in-place add a step each
        # a thread lock for the bar, not tqdm's default multiprocessing one: a semaphore, which os._exit would leave
        # to Python's resource tracker ("leaked semaphore objects" at the end of every ddp_spawn_train.py run)
        tqdm.set_lock(threading.RLock())
        self.bar = tqdm(total=self.steps_per_epoch, initial=self.step_in_epoch, desc=f"epoch {epoch + 1}",
                        leave=False, disable=None if self.rank == 0 else True)  # none in a log file

    def step_done(self, loss, norm=None):
        """After each optimizer step: returns check()'s answer. `norm`: fp16's skipped steps (inf) count 0."""
        bad = ~torch.isfinite(loss) & (self.first_bad == self.NEVER)
        self.first_bad = torch.where(bad, self.step + 1, self.first_bad)
        self.loss_sum += loss
        if norm is not None:
            self.norm_sum += torch.nan_to_num(norm, 0.0, 0.0)
        self.last_loss, self.step, self.step_in_epoch = loss, self.step + 1, self.step_in_epoch + 1
        self.t0 = self.t0 or (self.clock(), self.step)  # the steady state: timed from the end of the first step
        self.bar.update()
        return self.check(every_rank=self.save_due or self.last)

    epoch_done = property(lambda self: self.step_in_epoch == self.steps_per_epoch)
    last = property(lambda self: self.epoch_done or self.step == self.args.max_steps)  # saved by the caller
    save_due = property(lambda self: bool(self.args.save_every) and self.step % self.args.save_every == 0)

    def check(self, every_rank):
        """At its cadence, or at a step every rank asks for, one all-reduce: a NaN/inf loss on any rank stops all; a
        stop signal any rank got is returned (None between checks). The cadence is every --log-every steps, or about
        every CHECK_S seconds if sooner, from the slowest rank's time, so that all agree."""
        args = self.args
        if not (every_rank or self.step >= self.next_check):
            return None
        if (first_bad := -(flags := self.agree())[0].item()) < self.NEVER:
            raise UsageError(f"loss is NaN/inf at step {first_bad:.0f}: stopped, the last checkpoint is older", 1)
        per_step = flags[2].item() / max(1, self.step - self.checked[0]) if self.checked else math.inf  # first: measure
        every = min(args.log_every - self.step % args.log_every, max(1, int(self.CHECK_S / max(per_step, 1e-9))))
        self.next_check, self.checked = self.step + every, (self.step, time.monotonic())
        if self.step % args.log_every == 0:
            self.log_line()
        return int(flags[1].item())

    def agree(self):
        """One all-reduce (max) of the first NaN/inf step, the signal and the seconds since the last check. After the
        first, when start-up is over everywhere, collectives get --step-timeout."""
        seconds = torch.tensor([received, time.monotonic() - self.checked[1] if self.checked else 0.0])
        flags = torch.cat([-self.first_bad[None], seconds.to(self.device, self.exact)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            if self.checked is None:  # (shim: torch 2.11 has set_timeout only privately)
                getattr(dist, "set_timeout", dist.distributed_c10d._set_pg_timeout)(
                    datetime.timedelta(seconds=self.args.step_timeout))
        return flags

    def log_line(self):
        """The numbers on the progress bar; in a log file, rank 0 prints them as one plain line."""
        values = {"loss": f"{self.last_loss.item():.4f}", "lr": f"{self.scheduler.get_last_lr()[0]:.2e}",
                  "samples_per_s": f"{self.samples_per_s():.0f}"}
        if self.rank == 0 and self.bar.disable and not self.epoch_done:
            print(f"epoch {self.epoch + 1}: step {self.step_in_epoch} of {self.steps_per_epoch}  "
                  + "  ".join(f"{k} {v}" for k, v in values.items()), flush=True)
        self.bar.set_postfix(values, refresh=False)

    def clock(self):  # the accelerator's queued work is part of the time
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        return time.perf_counter()

    def end_epoch(self):
        self.bar.close()
        self.t1 = self.clock()

    def samples_per_s(self):
        return (self.step - self.t0[1]) * self.global_batch / max((self.t1 or self.clock()) - self.t0[0], 1e-9) \
            if self.t0 else 0.0

    def state(self, sums):
        """What a checkpoint keeps; `sums`: the epoch's so far, averaged over the ranks. The position is in samples."""
        epoch, steps = (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.step_in_epoch)
        return {"format": 2, "epoch": epoch, "step_in_epoch": steps, "samples_in_epoch": steps * self.global_batch,
                "steps_per_epoch": self.steps_per_epoch,
                "loss_sum": sums[0] if steps else 0.0, "grad_norm_sum": sums[1] if steps else 0.0,
                "global_batch": self.global_batch}


def stopped(signum, step):
    """Every rank saved at one step after a signal: exit 0 after SIGUSR1 (requeue, --resume auto), 143 after SIGTERM
    (129 after SIGHUP)."""
    return UsageError(f"stopped by {signal.Signals(signum).name} at step {step}, where last.pt was saved: --resume "
                      "auto continues from there", 0 if signum == getattr(signal, "SIGUSR1", None) else 128 + signum)


def start_output(run):
    """Rank 0: metrics.jsonl keeps the rows of the epochs the checkpoint covers."""
    path, rows = os.path.join(run.out_dir, "metrics.jsonl"), []
    if os.path.exists(path):
        rows = [r for r in map(json.loads, open(path).read().splitlines()) if r["epoch"] <= run.progress.epoch]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def log_epoch(run, row):
    """Rank 0: the epoch's line in metrics.jsonl (its number fractional if --max-steps ended it), on screen, and with
    --tensorboard in an events file of its own (TensorBoard reads every one in --out-dir)."""
    p = run.progress
    row = {"epoch": p.epoch + p.step_in_epoch / p.steps_per_epoch, "step": p.step, **row, "samples_per_s":
           p.samples_per_s(), "epoch_time_s": p.t1 - p.t0[0] if p.t0 else 0.0, "peak_mem_mb":
           torch.accelerator.max_memory_allocated(run.device) / 2**20 if run.device.type in ("cuda", "xpu") else None}
    path, line = os.path.join(run.out_dir, "metrics.jsonl"), (json.dumps(row) + "\n").encode()
    try:
        with open(path, "ab", buffering=0) as f:  # unbuffered: a write that fails fails here, and is taken back
            end = f.tell()
            if f.write(line) != len(line):  # (the disk filled up mid-row)
                f.truncate(end)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:  # a full disk, a quota, the folder gone or read-only; the checkpoint of this step is saved
        raise UsageError(f"could not write {path}: {e.strerror}; the checkpoint of step {p.step} was saved") from None
    if run.args.tensorboard:
        with importlib.import_module("torch.utils.tensorboard").SummaryWriter(run.out_dir) as writer:
            for k in ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s"):
                writer.add_scalar(k, row[k], p.step)
    print(f"epoch {row['epoch']:.4g}  train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f}  val_acc "
          f"{row['val_acc']:.4f}  lr {row['lr']:.2e}  {row['samples_per_s']:.0f} samples/s", flush=True)


# ---- how a run ends: a rank that stops answering named; every error one line and its exit status
@contextlib.contextmanager
def hangs_named(run):
    """A collective that timed out (torch's error names neither it nor the rank) ends the run naming the ranks that
    never arrived: each rank whose wait ran out marks itself in the store, waits for the others to, and reads."""
    try:
        yield
    except RuntimeError as e:
        if run.store is None or "timeout" not in str(e).lower().replace("timed out", "timeout"):
            raise
        try:
            run.store.set(f"hung/{run.rank}", "")
            time.sleep(5)  # the other ranks' waits run out at about the same time
            arrived = [r for r in range(run.world_size) if run.store.check([f"hung/{r}"])]
        except Exception:  # noqa: BLE001 whatever the store raises: it went with the process that held it
            raise UsageError("a collective timed out, and the store is gone with rank 0, which held it", 3,
                             None) from None
        missing = ", ".join(str(r) for r in range(run.world_size) if r not in arrived)
        time.sleep(5 if run.rank == 0 else 0)  # rank 0's process holds the store: the others may still read it
        raise UsageError(f"a collective timed out: rank {missing} never arrived", 3, min(arrived)) from None


def run(main, parse_args):
    """main(parse_args()), ending as docs/failures.md says: an error as one line printed once (by the launcher's rank
    0), and its exit status."""
    ranks = [n[0] for n in LAUNCHERS.values()] + ["SLURM_PROCID"]  # the launcher's rank 0 prints
    rank, code = next((int(os.environ[r]) for r in ranks if os.environ.get(r, "").isdigit()), 0), None
    try:
        main(parse_args())
    except RuntimeError as e:
        if "find_unused_parameters=True" in str(e):  # DDP's, on every rank: its fix is a flag here
            code = say(UsageError("some parameters got no gradient in a step, and DDP waits for every one (a branch "
                                  "not taken, a layer left unused): give --find-unused-parameters"), rank)
        elif received in (0, getattr(signal, "SIGUSR1", None)):  # else: told to stop, and a peer has left already
            raise
        else:
            code = 128 + received
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        if not any("multiprocessing" in f.filename and "popen_" in f.filename
                   for f in traceback.extract_tb(e.__traceback__)):
            raise  # not from starting a DataLoader worker (worker_start), which gets the Dataset pickled
        code = say(UsageError(f"your Dataset cannot be sent to its --workers processes ({e}): keep lambdas, open "
                              "files and the like out of it (open them in __getitem__), or give --workers 0"), rank)
    except UsageError as e:
        code = say(e, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # every way out, a finished run's too, skips the interpreter's teardown, where gloo's threads, still freeing what
    # the collectives used, now and then hang or abort the process (measured: docs/failures.md). Every file is closed
    # by now. Upstream: pytorch/pytorch#190489
    if code is not None:  # an error or a stop: a DataLoader left mid-epoch stops its workers, frees its queues
        gc.collect()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code or 0)


def say(e, rank):
    """`e` printed once, by the rank it names (not by each rank that raised it); returns its exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving anyway: a launcher's SIGTERM must not cut it short,
    if hasattr(signal, "SIGCHLD"):  # nor the DataLoader's check of its workers, which that SIGTERM ends
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if printer := e.printer in (None, rank):
        print(e if e.code == 0 or e.code > 128 else f"error: {e}", file=sys.stderr, flush=True)
    # rank 0 says why before the others exit; before the process group, a launcher's peers may still be starting,
    # and one that has not reached run() yet dies of the SIGTERM that torchrun sends once a first one exits
    time.sleep(3 if not dist.is_initialized() and one_of_several() else 0 if printer else 0.5)
    return e.code
