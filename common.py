"""What the scripts share, however their processes are launched; the optional features are
train_extras/, each used where its file is (extra).

It reads in the order a run meets it: the flags, the extras, the run's fields, who this process
is, the data and the model, --out-dir and the checkpoint, then where training stands, what the
ranks agree on and rank 0's output. Below the banner "stopping and failing", what a run does only
when it stops or fails: the endings and their exit statuses, the stop signals, the DataLoader
workers' deafness to them, and the exit."""
import argparse
import contextlib
import dataclasses
import datetime
import errno
import functools
import gc
import importlib
import json
import math
import multiprocessing
import multiprocessing.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

# ---- the command line: the same flags in every script
def number(kind, low, above=False):
    """Returns an argparse type: a number at least `low` (above, if `above`), not NaN nor inf."""
    def parse(text):
        value = kind(text)
        if not ((low < value) if above else (low <= value)) or value == math.inf:
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}, "
                                             f"got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


class Parser(argparse.ArgumentParser):
    one_process = None  # why a launcher is wrong (a script that starts its own processes)
    collectives = True  # dp_train.py: no process group

    def error(self, message):  # one line, exit 2; a flag of an extra not copied: its file
        words = set(message.replace("=", " ").split())
        for name, flags in EXTRA_FLAGS.items():
            copied = not isinstance(extra(name), NotCopied)
            if message.startswith("unrecognized") and words & set(flags) and not copied:
                message += f" (a flag of train_extras/{name}.py: copy it and its __init__.py)"
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, *a, **kw):
        launcher = one_of_several() if self.one_process else None  # before its --local-rank
        if launcher:  # (or variables left in the shell: named, and said once a machine)
            names = [n for v in LAUNCHERS.values() for n in v] + ["SLURM_PROCID", "SLURM_LOCALID"]
            told = " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ)
            local = [v[2] for v in LAUNCHERS.values()] + ["SLURM_LOCALID"]
            first = all(os.environ.get(n, "0") == "0" for n in local)
            raise UsageError(f"{self.prog} {self.one_process}: start it with python, not "
                             f"{launcher} (its environment has {told})",
                             printer=None if first else 0)
        args = super().parse_args(*a, **kw)
        args.device = device_type(args.device, self.collectives)
        return args


class Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # with the flag's default
        none = action.default is None or action.default is False or \
            action.default is argparse.SUPPRESS  # (not ==: 0 is a default to show)
        return action.help + ("" if none else " (default: %(default)s)")


def get_parser(doc):
    p = Parser(description=doc, formatter_class=Formatter)
    a, positive, above0 = p.add_argument, number(int, 1), number(float, 0, above=True)
    a("--epochs", type=positive, default=2, help="passes over the training set")
    a("--batch-size", type=positive, default=64, help="per process")
    a("--lr", type=number(float, 0), default=0.01, help="peak LR, NOT scaled with processes")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd (with --momentum), adamw")
    a("--momentum", type=number(float, 0), default=0.9, help="SGD momentum")
    a("--weight-decay", type=number(float, 0), default=5e-4, help="weight decay")
    a("--warmup-epochs", type=number(float, 0), default=0.0, help="linear, then cosine to 0")
    a("--seed", type=number(int, 0), default=0, help="model init, data order")
    a("--workers", type=number(int, 0), default=2, help="DataLoader processes for files")
    a("--max-steps", type=positive, help="stop after this many optimizer steps in all")
    a("--grad-accum", type=positive, default=1, help="micro-batches per optimizer step")
    a("--out-dir", help="for metrics.jsonl and last.pt (default ./runs/<script name>)")
    a("--resume", help="a checkpoint to continue, or 'auto': --out-dir's, if any")
    a("--overwrite", action="store_true", help="replace --out-dir's run (its checkpoints, metrics)")
    a("--save-every", type=positive, help="also save every N optimizer steps")
    a("--clip-grad", type=above0, metavar="NORM", help="clip the gradients' norm")
    a("--step-timeout", type=above0, default=300,
      help="seconds a DataLoader worker, and after the first step a collective, may wait")
    a("--log-every", type=positive, default=20, help="a log line, NaN/inf check every N steps")
    a("--device", choices=["cpu", "cuda", "xpu", "mps"], help="default: the accelerator, or cpu")
    a("--channels-last", action="store_true", help="channels_last memory format for images")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--deterministic", action="store_true", help="no TF32, deterministic cuDNN")
    for name in EXTRA_FLAGS:
        extra(name).add_flags(p)
    return p


# ---- the extras: train_extras/<name>.py, each used where its file is
EXTRAS = ("datasets", "models", "finetune", "tensorboard", "workers", "hangs", "restart", "sharded")
EXTRA_FLAGS = {  # the flags of those that have any: a flag not copied is named with its file
    "datasets": ("--dataset", "--data-dir", "--train-size", "--val-size", "--image-size",
                 "--synthetic-shape"),
    "models": ("--model",),
    "finetune": ("--pretrained", "--weights", "--freeze-backbone"),
    "tensorboard": ("--tensorboard",)}




def extra(name):
    """Returns train_extras/<name>.py if copied, else a NotCopied (a name not of EXTRAS: one
    line)."""
    if name not in EXTRAS:
        raise UsageError(f"no extra named {name!r}: train_extras/ holds {', '.join(EXTRAS)}")
    try:
        return importlib.import_module(f"train_extras.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("train_extras", f"train_extras.{name}"):
            raise
        return NotCopied()


class NotCopied:
    """An extra not copied: its steps do nothing and return what they got."""

    def add_flags(self, parser):
        pass

    def fork_server(self, args):  # workers.py's
        pass

    def start(self, dataset):  # workers.py's
        return {}

    def prepare(self, model, run):  # finetune.py's
        return model

    def named(self, run):  # hangs.py's
        return contextlib.nullcontext()

    def refuse_folder(self, path):  # sharded.py's
        pass


def optional(name, what):
    """Returns train_extras/<name>.py, which `what` needs (else one line)."""
    module = extra(name)
    if isinstance(module, NotCopied):
        raise UsageError(f"{what} needs train_extras/{name}.py (and its __init__.py): copy them")
    return module


# ---- the run, declared once: setup_distributed fills the first fields, main and its steps the rest
@dataclasses.dataclass(slots=True)  # slots: no field but these (a script's own: a subclass)
class Run:
    args: argparse.Namespace  # rank 0's flags, on every rank (same_flags)
    rank: int  # rank 0 alone prints and writes files
    world_size: int
    local_rank: int  # on this machine: its accelerator
    device: torch.device
    launcher: str = "python"
    out_dir: str = ""
    global_batch: int = 0  # samples per optimizer step, all ranks together
    train_set: object = None  # (x, label) pairs
    sampler: object = None  # the global order; this rank's part of it
    steps_per_epoch: int = 0  # optimizer steps
    val_loader: object = None  # this rank's share of the validation set
    raw_model: torch.nn.Module = None  # as built: what is saved and evaluated
    model: torch.nn.Module = None  # as trained: wrapped (DDP, DataParallel), maybe compiled
    optimizer: torch.optim.Optimizer = None
    scheduler: object = None  # the LR, per step
    position: "Position" = None  # where training stands
    agreement: "Agreement" = None  # what the ranks agree on at a check
    output: "Output" = None  # rank 0's bar, log lines and metrics rows


# ---- who this process is, and on what device, under every launcher
LAUNCHERS = {  # how a launcher names (rank, world size, local rank, local size)
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # any env:// launch
    "mpirun": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE"),  # Open MPI
    "mpiexec": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")}  # MPICH, Intel MPI


def launcher_env():
    """Returns (rank, world size, local rank, local size, launcher) from the environment."""
    env, launcher, names = os.environ, None, None
    for name, variables in LAUNCHERS.items():  # the first whose rank or size is set
        if variables[0] in env or variables[1] in env:
            launcher, names = name, variables
            break
    if names is None and "SLURM_STEP_NUM_TASKS" in env:  # (not in sbatch's own script)
        return srun_env(env)
    if names is None:
        return 0, 1, 0, 1, None  # a lone process
    if not (names[0] in env and names[1] in env):
        raise UsageError(f"{names[0]} and {names[1]} go together: set both")
    if launcher == "torchrun" and "LOCAL_RANK" not in env:  # a Kubernetes PyTorchJob
        launcher = "env:// (no LOCAL_RANK: one process per machine)"
    if launcher == "torchrun" and any(a.startswith("--local") for a in sys.argv):
        launcher = "python -m torch.distributed.launch"
    world = int(env[names[1]])
    if world > 1 and not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        raise UsageError(f"{launcher}: {world} processes, but no MASTER_ADDR and MASTER_PORT: "
                         "set both, the same on every machine")
    return (int(env[names[0]]), world, int(env.get(names[2], 0)), int(env.get(names[3], 1)),
            launcher)


def srun_env(env):
    """Returns an srun task's (rank, ...); rank 0 is met on the step's first node."""
    counts = re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_STEP_TASKS_PER_NODE"])  # "8(x2),4"
    per_node = [int(n) for count, times in counts for n in [count] * int(times or 1)]
    first_node = re.match(r"[^,\[]+(\[[^,\-\]]+)?", env["SLURM_STEP_NODELIST"]).group(0)
    env.setdefault("MASTER_ADDR", first_node.replace("[", ""))
    env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))  # one per job
    return (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"]),
            per_node[int(env["SLURM_NODEID"])], "srun")


def one_of_several():
    """Returns the launcher that started this process as one of several (its name; "a launcher"
    where its variables do not add up), or None for a lone process."""
    try:
        _, world, _, _, launcher = launcher_env()
    except UsageError:
        return "a launcher"
    return launcher if world > 1 or "TORCHELASTIC_RUN_ID" in os.environ else None


def device_type(asked, collectives=True):
    """Returns --device, else torch's accelerator (not MPS with collectives: pytorch#160732)."""
    found = getattr(torch.accelerator.current_accelerator(check_available=True), "type", None)
    if asked not in (None, "cpu", found):
        raise UsageError(f"--device {asked}, but torch finds no {asked} device here")
    if asked is None and found and not (collectives and found == "mps"):
        asked = found  # the accelerator
    return asked if asked else "cpu"


def local_device(kind, local_rank):
    if kind == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def pick_backend(args):
    # --backend, else the device's; and gloo for the object collectives on the CPU
    backend = args.backend or dist.get_default_backend_for_device(args.device)
    return backend if backend == "gloo" else f"{args.device}:{backend},cpu:gloo"


def same_flags(args, allowed=("out_dir", "data_dir", "workers", "tensorboard", "local_rank")):
    """Refuses flags that differ from rank 0's (but the per-machine ones)."""
    mine = {k: v for k, v in vars(args).items() if k not in allowed}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, flags in enumerate(everyone):
        for k in everyone[0]:
            if flags.get(k) != everyone[0][k]:
                raise UsageError(f"the ranks' flags differ: --{k.replace('_', '-')} is "
                                 f"{everyone[0][k]} on rank 0, {flags.get(k)} on rank {rank}")


def set_threads_and_math(local_world_size, deterministic):
    """Shares the cores among the machine's processes (torchrun: only with several); TF32."""
    if "OMP_NUM_THREADS" not in os.environ:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux only
        cores = len(affinity(0)) if affinity else os.cpu_count()
        torch.set_num_threads(max(1, cores // local_world_size))
    cudnn = torch.backends.cudnn
    cudnn.benchmark = cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not deterministic
    cudnn.deterministic = deterministic


def on_rank0(fn, rank):
    """Runs fn() on rank 0 while the others wait for it (a barrier); returns its result there, None
    on the others. Its UsageError is raised on every rank; any other error ends rank 0, and the
    others when their wait times out."""
    result, error = None, [None]
    if rank == 0:
        try:
            result = fn()
        except UsageError as e:
            error = [str(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UsageError(error[0])
    return result


# ---- the data and the model: replace these calls with your own Dataset and nn.Module
def load_data_rank0_first(args, rank):
    # rank 0 first: the one process that may download files
    data = on_rank0(lambda: load_data(args, download=True), rank)
    if rank != 0:
        data = load_data(args)
    return data


def load_data(args, download=False):
    """Returns (train_set, val_set) of (x, label): replace with your own Datasets."""
    return optional("datasets", "the built-in data").load(args, download)


def make_model(args, data):
    """Returns the built-in model for `data` (train_extras/models.py): replace with yours."""
    return optional("models", "the built-in models").for_data(args, data)


def make_loader(ds, batches, run):
    """Returns a DataLoader over `batches`, its generator not the one dropout draws from."""
    if callable(getattr(ds, "batch_loader", None)):  # whole batches (train_extras/datasets.py)
        return ds.batch_loader(batches, run)
    workers, start = run.args.workers, {}
    if workers:
        start = extra("workers").start(ds)
    return Loader(ds, batch_sampler=batches, num_workers=workers,
                  **start, generator=torch.Generator(),
                  pin_memory=run.device.type != "cpu",
                  timeout=run.args.step_timeout if workers else 0)


def nested(fn, x):
    """Applies fn to every tensor in x: nested dicts, lists, (named) tuples."""
    if isinstance(x, dict):
        return {k: nested(fn, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*[nested(fn, v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)([nested(fn, v) for v in x])
    if isinstance(x, torch.Tensor):
        return fn(x)
    return x


def micro_batches(x, n):
    return [nested(lambda t: t.chunk(n)[i], x) for i in range(n)]


def to_device(run, ds, x, y):
    """Moves a batch to the device (`x` of any structure), labels as class indices."""
    if not isinstance(y, torch.Tensor):  # a dict sample ({"input_ids", "label"}): its keys
        raise UsageError(f"a batch unpacked to ({type(x).__name__}, {type(y).__name__}): a sample "
                         "must be a pair (x, label), x a tensor or a dict, list or tuple of them")
    y = y[:, 0] if y.ndim == 2 and y.shape[1] == 1 else y
    long = y.dtype if y.is_floating_point() else torch.long  # (float: the loss's own error)
    return nested(lambda t: input_on(run, ds, t), x), y.to(run.device, long, non_blocking=True)


def input_on(run, ds, x):
    """Moves one input tensor to the device (uint8 images: made float there)."""
    x = x.float() if x.dtype == torch.float64 else x  # numpy's default
    x = x.to(run.device, non_blocking=True)
    normalize = getattr(ds, "normalize_uint8", None)
    x = normalize(x) if x.dtype == torch.uint8 and callable(normalize) else x
    if run.args.channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def validation_row(totals):
    """The validation figures from the ranks' sums of (loss, correct, count): none but the count
    where there is no validation sample (a run without a validation set)."""
    loss_sum, correct, count = totals.tolist()
    if not count:
        return {"val_loss": None, "val_acc": None, "val_count": 0}
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}


def make_optimizer(args, model, steps_per_epoch):
    """Returns the optimizer and its per-step schedule: linear warmup, cosine to 0."""
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(weight_decay=args.weight_decay, foreach=True)
    optimizer = torch.optim.AdamW(params, args.lr, **kw) if args.optimizer == "adamw" else \
        torch.optim.SGD(params, args.lr, args.momentum, **kw)
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch

    def factor(s):
        return (s + 1) / warmup if s < warmup else \
            0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---- --out-dir and checkpoints: one run a folder; written atomically, read on the CPU, checked
def save_atomic(obj, path):
    """Saves obj to a temporary file, fsynced, renamed over `path`: a kill leaves the last one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise save_failed(path, e) from None
    finally:
        if os.path.exists(tmp):  # no partial file left behind
            os.remove(tmp)


def save_failed(path, e):
    """Returns the save's error line (a full disk inferred: torch says "unexpected pos")."""
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().split("\n")[0]
    with contextlib.suppress(OSError):
        if shutil.disk_usage(os.path.dirname(path) or ".").free < 2**20:
            why = os.strerror(errno.ENOSPC)
    return UsageError(f"could not save {path}: {why[:120]}. The previous checkpoint is whole")


def write_and_end_if_stopped(run, state):
    """Every rank, a save's last step: rank 0 writes `state` to last.pt (None: every rank has
    written its part already) while the others wait; a failed write stops every rank. Then, where
    the ranks agreed on a stop, ends the run here, saved (Stop.end raises Stopped)."""
    if state is not None:
        on_rank0(lambda: save_atomic(state, os.path.join(run.out_dir, "last.pt")), run.rank)
    run.position.has_checkpoint = True
    STOP.end(run.position.step)


def read_checkpoint(path):
    """Reads a checkpoint file on the CPU, tensors only (no code in it runs), its bytes checked."""
    if os.path.isdir(path):  # no last.pt in it; sharded.py names a sharded checkpoint
        extra("sharded").refuse_folder(path)
        raise UsageError(f"--resume {path}: a folder that holds no checkpoint (no last.pt)")
    refuse_damaged(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever torch.load raises
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): missing, "
                         "truncated, or a pickled model (save its state_dict)?") from None


def refuse_damaged(path):
    """Refuses a checkpoint whose bytes changed after its save (a bad copy, a disk, a network
    filesystem): torch's zip format holds each record's CRC-32, which torch.load does not check.
    A record torch wrote without one (CRC 0: torch.serialization.set_crc32_options) is not read."""
    if not zipfile.is_zipfile(path):
        return  # torch's legacy format, or not a checkpoint at all: torch.load says
    try:
        with zipfile.ZipFile(path) as z:
            for record in z.infolist():
                if record.CRC:
                    with z.open(record) as f:
                        while f.read(2**24):  # its CRC checked at the end
                            pass
    except (zipfile.BadZipFile, OSError) as e:
        raise UsageError(f"{path} is damaged ({e}): its bytes changed after it was saved (a bad "
                         "copy, a disk, a network filesystem); give another checkpoint") from None


def rows(run):
    """Rank 0: metrics.jsonl's lines, each with the row it holds where it is one of ours (a dict,
    an integer step, a number epoch), else None: another tool's line, a note, kept as it is."""
    path, found = os.path.join(run.out_dir, "metrics.jsonl"), []
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        row = None
        with contextlib.suppress(ValueError):
            row = json.loads(line)
        ours = isinstance(row, dict) and type(row.get("step")) is int and \
            type(row.get("epoch")) in (int, float)
        found.append((line, row if ours else None))
    return found


def check_out_dir(run):
    """Rank 0, before anything is built: refuses an unwritable --out-dir, or a run in it unasked."""
    args, out = run.args, run.out_dir
    own = resumes_own(args, out)
    if args.overwrite and args.resume and own:
        raise UsageError(f"--overwrite would delete the checkpoint that --resume {args.resume} "
                         "continues: drop one of the two")
    if not os.path.isdir(out):
        return
    try:
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise UsageError(f"--out-dir {out}: {e.strerror}") from None
    found = earlier_checkpoints(out)
    if found and args.resume and not (own or args.overwrite):  # a resume of another run's
        raise UsageError(f"{out} holds the {found[-1]} of another run, which this one would "
                         "replace: give another --out-dir, or --overwrite to replace it")
    if found and not (args.resume or args.overwrite):  # never replaced unasked
        raise UsageError(f"{out} holds the {found[-1]} of an earlier run: "
                         f"{how_to_continue(args, out, found)}, --overwrite replaces it, or give "
                         "another --out-dir")
    logged = [line for line, _ in rows(run) if line.strip()]  # every line is someone's data
    if logged and not (found or args.overwrite):  # its checkpoints deleted, its log kept
        raise UsageError(f"{out} holds the metrics.jsonl of an earlier run ({len(logged)} rows), "
                         "which this one would replace: --overwrite replaces it, or give another "
                         "--out-dir")


def earlier_checkpoints(out):
    # last.pt, and fsdp_train.py's ckpt-<step> folders
    return sorted(n for n in os.listdir(out) if re.fullmatch(r"last\.pt|ckpt-\d+(\.tmp)?", n))


def how_to_continue(args, out, found):
    """What continues the earlier run in `out`: --resume auto; where it left only fsdp_train.py's
    ckpt-<step> folders and this script reads last.pt alone (it has no --ckpt-format), their
    conversion first."""
    if "last.pt" in found or hasattr(args, "ckpt_format"):
        return "--resume auto continues it"
    last = os.path.join(out, "last.pt")
    return (f"python -m train_extras.sharded {os.path.join(out, found[-1])} {last} makes it a "
            "last.pt that --resume auto continues")


def resumes_own(args, out):
    # 'auto', or its folder, or its last.pt
    real = os.path.realpath(args.resume or "")
    return args.resume == "auto" or os.path.realpath(out) in (real, os.path.dirname(real))


def checkpoint_to_resume(run):
    """Rank 0: the checkpoint --resume names, checked that this run can continue it (or None)."""
    args, path, ckpt = run.args, os.path.join(run.out_dir, "last.pt"), None
    found = earlier_checkpoints(run.out_dir) if os.path.isdir(run.out_dir) else []
    if args.resume == "auto" and found and not os.path.exists(path) and \
            not hasattr(args, "ckpt_format"):  # fsdp_train.py's folders: not read here
        raise UsageError(f"--resume auto: {run.out_dir} holds no last.pt but the {found[-1]} of "
                         f"fsdp_train.py: {how_to_continue(args, run.out_dir, found)}")
    if args.resume == "auto" and not os.path.exists(path):
        print(f"--resume auto: no checkpoint in {run.out_dir}, starting afresh", flush=True)
    elif args.resume:
        path = path if args.resume == "auto" else args.resume
        if os.path.isfile(os.path.join(path, "last.pt")):  # its folder
            path = os.path.join(path, "last.pt")
        ckpt = read_checkpoint(path)
        model = ckpt.get("model") if isinstance(ckpt, dict) else None
        shapes = {k: v.shape for k, v in model.items()} if isinstance(model, dict) else None
        ckpt = check_fits(path, ckpt, shapes, run)
    return drop_logged_row(run, ckpt)


def take_over_out_dir(run):
    """Rank 0, once the checkpoint to resume (if any) is accepted: makes --out-dir; --overwrite
    deletes the earlier run there, all of it (--resume auto would take the rest); and a resume
    keeps in metrics.jsonl only the rows of the epochs its checkpoint covers (a row at --max-steps
    mid-epoch goes: an unbroken run has none there), and every line that is not a row of ours."""
    try:
        os.makedirs(run.out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {run.out_dir}: {e.strerror}") from None
    if run.args.overwrite:
        for name in earlier_checkpoints(run.out_dir) + ["metrics.jsonl"]:
            path = os.path.join(run.out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    logged = rows(run)  # a line not of ours stays, as it is
    kept = [line for line, row in logged if row is None or row["epoch"] <= run.position.epoch]
    if len(kept) < len(logged):  # rewritten whole, or not at all
        path = os.path.join(run.out_dir, "metrics.jsonl")
        with open(f"{path}.tmp", "w") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(f"{path}.tmp", path)


def drop_logged_row(run, ckpt):
    """Returns `ckpt`, without its row to evaluate if metrics.jsonl has it, or another run's."""
    row = ckpt.get("row") if ckpt else None
    if row and (row["step"] in [r["step"] for _, r in rows(run) if r] or
                not resumes_own(run.args, run.out_dir)):
        ckpt["row"] = None
    return ckpt


def check_fits(path, ckpt, shapes, run):
    """`ckpt` if this run can continue it exactly."""
    a, args = ckpt.get("args", {}), run.args
    frozen = a.get("freeze_backbone", False) != getattr(args, "freeze_backbone", False)
    if shapes != {k: v.shape for k, v in run.raw_model.state_dict().items()} or \
            "optimizer" not in ckpt or frozen:
        raise UsageError(f"{path} is not a training state of this model and flags (--model, "
                         "classes, channels, --freeze-backbone?): --weights takes weights")
    if a.get("optimizer", "sgd") != args.optimizer:  # its state would go into another optimizer's
        raise UsageError(f"{path} was trained with --optimizer {a.get('optimizer', 'sgd')}: to "
                         f"start {args.optimizer} from its weights, give it to --weights")
    saved = ckpt.get("global_batch")
    if saved != run.global_batch:
        raise UsageError(f"{path} was trained with a global batch of {saved}, this run's is "
                         f"{run.global_batch}: keep --batch-size x processes x --grad-accum")
    saved = ckpt.get("steps_per_epoch", run.steps_per_epoch)
    if saved != run.steps_per_epoch:
        raise UsageError(f"{path} was trained with {saved} steps per epoch, this run has "
                         f"{run.steps_per_epoch}: the data changed; keep it, or use --weights")
    saved, now = ckpt.get("data", data_of(run)), data_of(run)  # its position names these samples
    for k in now:
        what = "training samples" if k == "samples" else "--" + k.replace("_", "-")
        if saved.get(k) != now[k]:
            raise UsageError(f"{path} was trained on other data ({what} {saved.get(k)}, this "
                             f"run's {now[k]}): keep them, or start from its weights with "
                             "--weights")
    return ckpt


def data_of(run):
    """Returns what a saved position (an epoch, a step in it) depends on: the data, its order."""
    a = run.args
    return {"seed": a.seed, "samples": len(run.train_set), "dataset": getattr(a, "dataset", None),
            "train_size": getattr(a, "train_size", None), "val_size": getattr(a, "val_size", None)}


def rng_state(device):
    on = {} if device.type == "cpu" else \
        {device.type: [torch.get_device_module(device).get_rng_state(device)]}
    return {"cpu": torch.get_rng_state(), **on}


def restore_rng(saved, run):
    """Restores this rank's generators; at another world size, seeds them from the position."""
    states = saved.get("rng") or []
    if len(states) == run.world_size:
        torch.set_rng_state(states[run.rank]["cpu"])
        if run.device.type != "cpu":
            for state in states[run.rank].get(run.device.type, []):
                torch.get_device_module(run.device).set_rng_state(state, run.device)
    else:
        position = saved["epoch"] * 1_000_003 + saved["step_in_epoch"]
        torch.manual_seed((run.args.seed * 1_000_000_007 + position * 1_009 + run.rank) % 2**63)


# ---- where training stands
class Position:
    """Where training stands: the epoch, the step, the sums of the losses and gradient norms (on
    the device: no host sync), and what a checkpoint saves of it (state)."""

    def __init__(self, run, saved=None):
        self.run, self.has_checkpoint = run, saved is not None
        saved = saved or {"epoch": 0}
        self.epoch, self.row = saved["epoch"], saved.get("row")  # a row: evaluated first
        self.saved_sums = [saved.get("loss_sum", 0.0), saved.get("grad_norm_sum", 0.0)]
        self.step_in_epoch = saved.get("samples_in_epoch", 0) // run.global_batch
        self.step = self.epoch * run.steps_per_epoch + self.step_in_epoch
        self.start_step = self.step  # where this process started
        self.exact = torch.float32 if run.device.type == "mps" else torch.float64  # sums' dtype
        self.epoch_done = self.last = self.save_due = False

    def start_epoch(self, epoch):
        """A resumed epoch keeps the sums of its saved part."""
        self.row = None  # the epoch's metrics, once trained
        self.epoch, self.step_in_epoch = epoch, self.step_in_epoch if epoch == self.epoch else 0
        sums = self.saved_sums if self.step_in_epoch else [0.0, 0.0]
        self.sums = torch.tensor(sums, dtype=self.exact, device=self.run.device)
        self.loss_sum, self.norm_sum = self.sums.unbind()  # views: += adds into self.sums

    def step_done(self, loss, norm=None):
        """Counts a step (fp16's skipped ones: norm inf, counted 0); says whether it ends the epoch
        or the run (last: the caller saves) and whether --save-every saves it."""
        self.loss_sum += loss
        if norm is not None:
            self.norm_sum += torch.nan_to_num(norm, 0.0, 0.0)
        self.step, self.step_in_epoch = self.step + 1, self.step_in_epoch + 1
        args = self.run.args
        self.epoch_done = self.step_in_epoch == self.run.steps_per_epoch
        self.last = self.epoch_done or self.step == args.max_steps
        self.save_due = bool(args.save_every) and self.step % args.save_every == 0

    def state(self, sums):
        """Returns what a checkpoint holds of the position, the sums averaged over the ranks: the
        next step to take, in samples of its epoch (another world size resumes there too)."""
        run = self.run
        epoch, steps = (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.step_in_epoch)
        sums = sums if steps else [0.0, 0.0]
        return {"epoch": epoch, "step_in_epoch": steps,
                "samples_in_epoch": steps * run.global_batch,
                "steps_per_epoch": run.steps_per_epoch, "global_batch": run.global_batch,
                "loss_sum": sums[0], "grad_norm_sum": sums[1], "row": self.row,
                "data": data_of(run)}


# ---- what the ranks agree on
class Agreement:
    """What every rank learns at the same step, in one all-reduce at a check: the first step whose
    loss was NaN/inf on any rank (NanLoss), a stop signal any rank got (STOP.agreed), and the time
    a step takes. A check comes every --log-every steps, about every CHECK_S seconds, and where
    all ask (a save, the last step, the end of an evaluation)."""
    CHECK_S, NEVER = 2.0, 2.0**52  # the checks' cadence in seconds; "no NaN/inf step yet"

    def __init__(self, run):
        self.run = run
        self.first_bad = torch.full((), self.NEVER, dtype=run.position.exact, device=run.device)
        self.next_check, self.checked = run.position.step + 1, None  # (step, time) of the last

    def step_done(self, loss):
        """Notes a NaN/inf loss (on the device: no host sync), then checks where one is due."""
        position = self.run.position
        bad = ~torch.isfinite(loss) & (self.first_bad == self.NEVER)
        self.first_bad = torch.where(bad, position.step, self.first_bad)
        if position.save_due or position.last or position.step >= self.next_check:
            self.check()

    def check(self):
        """All-reduces the first NaN/inf step, the stop signal and the seconds since the last check;
        then sets the next check (about CHECK_S s on, and at the next --log-every step)."""
        args, position, step = self.run.args, self.run.position, self.run.position.step
        since = time.monotonic() - self.checked[1] if self.checked else 0.0
        # the first bad step negated (the MAX of negatives is the earliest); the highest signal
        # number (SIGTERM's 15 over SIGUSR1's 10: told to stop and to requeue, it stops)
        flags = torch.cat([-self.first_bad[None], torch.tensor([STOP.poll(), since]).to(
            self.run.device, position.exact)])
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        first_bad = -flags[0].item()
        if first_bad < self.NEVER:
            older = "nothing was saved"
            if position.has_checkpoint:
                older = "the last checkpoint is older"
            raise NanLoss(f"loss is NaN/inf at step {first_bad:.0f}: stopped, {older}")
        STOP.agreed = int(flags[1].item())
        if self.checked and self.checked[0] == step:  # again at this step (an evaluation's end)
            return
        per_step = flags[2].item() / (step - self.checked[0]) if self.checked else math.inf
        every = min(args.log_every - step % args.log_every,
                    max(1, int(self.CHECK_S / max(per_step, 1e-9))))
        self.next_check, self.checked = step + every, (step, time.monotonic())


@contextlib.contextmanager
def joining(seconds):
    """Around init_process_group and a first collective: the ranks join within `seconds` (its
    timeout), or each ends with one line (joining_failed), 10 s later at most: a store client
    that reached another program's port waits for an answer forever (torch's TCPStore has no
    timeout there). Joined, the start-up (data, downloads) has 10 minutes."""
    def give_up():
        print(f"error: {joining_failed('timed out')}", file=sys.stderr, flush=True)
        os._exit(UsageError.code)
    timer = threading.Timer(seconds + 10, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    STOP.joined = True
    set_timeout(600)


def set_timeout(seconds):
    """Each collective from now on waits at most `seconds`: the start-up's 10 minutes once the ranks
    joined, --step-timeout from the first step's check on (a rank that stops answering ends the
    run then, exit 3)."""
    STOP.window = seconds
    if not dist.is_initialized():
        return
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(datetime.timedelta(seconds=seconds))
    else:  # torch 2.11: private
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


# ---- rank 0's output: a progress bar (a log line where it is not a terminal), the metrics rows
class Output:
    """Rank 0's output while it trains: the bar, a line every --log-every steps, the epoch's
    metrics row, and their speed (from the end of the first step)."""

    def __init__(self, run):
        self.run = run
        tqdm.set_lock(threading.RLock())  # not a semaphore, which os._exit would leak

    def start_epoch(self):
        self.t0 = self.t1 = None  # (time, step) at the end of the first step; the epoch's end
        position = self.run.position
        self.bar = tqdm(total=self.run.steps_per_epoch, initial=position.step_in_epoch,
                        leave=False, desc=f"epoch {position.epoch + 1}",
                        disable=None if self.run.rank == 0 else True)

    def step_done(self, loss):
        """Moves the bar; every --log-every steps, writes the loss, LR and speed (a host sync)."""
        position, run = self.run.position, self.run
        if self.t0 is None:
            self.t0 = (self.clock(), position.step)
        self.bar.update()
        if position.step % run.args.log_every:
            return
        speed = self.samples_per_s()
        values = {"loss": f"{loss.item():.4f}", "lr": f"{run.scheduler.get_last_lr()[0]:.2e}",
                  **({} if speed is None else {"samples_per_s": f"{speed:.0f}"})}
        if run.rank == 0 and self.bar.disable and not position.epoch_done:
            print(f"epoch {position.epoch + 1}: step {position.step_in_epoch} of "
                  f"{run.steps_per_epoch}  " + "  ".join(map(" ".join, values.items())), flush=True)
        self.bar.set_postfix(values, refresh=False)

    def clock(self):  # the accelerator's queued work is part of the time
        if self.run.device.type != "cpu":
            torch.accelerator.synchronize(self.run.device)
        return time.perf_counter()

    def end_epoch(self):
        self.bar.close()
        self.t1 = self.clock()

    def epoch_row(self, **row):
        """Returns the epoch's row of training metrics; the evaluation adds its own (a stop between
        the two: the checkpoint holds this half, and the resume evaluates it first)."""
        position = self.run.position
        return {"epoch": position.epoch + position.step_in_epoch / self.run.steps_per_epoch,
                "step": position.step, **row, "lr": self.run.scheduler.get_last_lr()[0],
                "samples_per_s": self.samples_per_s(),
                "epoch_time_s": self.t1 - self.t0[0] if self.samples_per_s() else None}

    def samples_per_s(self):
        """From the end of the epoch's first step; None where no step came after it."""
        steps = self.run.position.step - self.t0[1] if self.t0 else 0
        seconds = (self.t1 or self.clock()) - self.t0[0] if steps else 0.0
        return steps * self.run.global_batch / seconds if seconds > 0 else None



def log_and_end_if_stopped(run, row):
    """Every rank, once the epoch is evaluated: rank 0 writes its row (metrics.jsonl, the
    screen, --tensorboard; a failed write stops every rank). Then the ranks agree on a stop that
    came during the evaluation, which ends the run here (Stop.end raises Stopped): the epoch was
    saved before it."""
    on_rank0(lambda: log_epoch(run, row), run.rank)
    run.agreement.check()
    STOP.end(run.position.step)


def log_epoch(run, row):
    """Rank 0: writes the epoch's row to metrics.jsonl, the screen, and --tensorboard."""
    device = run.device
    peak = torch.accelerator.max_memory_allocated(device) if device.type in ("cuda", "xpu") else 0
    row = {**row, "peak_mem_mb": peak / 2**20 if peak else None}
    path, line = os.path.join(run.out_dir, "metrics.jsonl"), (json.dumps(row) + "\n").encode()
    try:
        with open(path, "ab", buffering=0) as f:  # unbuffered: a failed write fails here
            end = f.tell()
            if f.write(line) != len(line):  # the disk filled up mid-row: taken back
                f.truncate(end)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:  # a full disk, a quota, the folder gone
        raise UsageError(f"could not write {path}: {e.strerror}; step {row['step']} was saved") \
            from None
    if getattr(run.args, "tensorboard", False):
        extra("tensorboard").log(run.out_dir, row)
    shown = [f"epoch {row['epoch']:.4g}", f"train_loss {row['train_loss']:.4f}"]
    if row["val_count"]:  # (none: no validation set)
        shown += [f"val_loss {row['val_loss']:.4f}", f"val_acc {row['val_acc']:.4f}"]
    shown.append(f"lr {row['lr']:.2e}")
    if row["samples_per_s"] is not None:  # (none: no step after the first to time)
        shown.append(f"{row['samples_per_s']:.0f} samples/s")
    print("  ".join(shown), flush=True)


# ==================================================================================================
# Stopping and failing: all that is here because a run may stop or fail. How it ends (each ending
# a line and a status), the stop signals, how DataLoader workers and their helpers stay deaf to
# them, the entry point and the exit. A run where nothing goes wrong passes through it only to
# catch the signals, to start its workers deaf, and to leave.
# ==================================================================================================

# ---- the endings: one line, printed once, and an exit status
class Ending(Exception):
    """Ends the run with one line, printed by rank `printer` (None: each rank that raises it;
    -1: none), and the exit status `code`."""

    def __init__(self, message, printer=0):
        super().__init__(message)
        self.printer = printer


class UsageError(Ending):
    code = 2  # the user's: a flag, a launch, a file, the data


class NanLoss(Ending):
    code = 1  # a NaN/inf loss on any rank: all stop at one step


class Hang(Ending):
    code = 3  # a rank or a worker stopped answering (--step-timeout)


class Failed(Ending):
    code = 1  # an error of the code's own, torch's or the user's: its traceback is its line


class Stopped(Ending):
    """A stop signal: exit 0 after SIGUSR1 (a requeue), else 128 + its number."""

    def __init__(self, signum, step=None, printer=0):
        how = "before training: nothing was saved"
        if step is not None:
            how = f"at step {step}, where last.pt was saved: --resume auto continues"
        name = signal.Signals(STOP.named(signum)).name + STOP.orphaned * " (its launcher is gone)"
        super().__init__(f"stopped by {name} {how}", printer)
        self.code = 0 if signum == getattr(signal, "SIGUSR1", None) else 128 + signum


# ---- the stop: a signal, agreed on by the ranks, acted on at one step
STOP_SIGNALS = [getattr(signal, n) for n in ("SIGUSR1", "SIGTERM", "SIGHUP", "SIGINT")
                if hasattr(signal, n)]


class Stop:
    """The stop signals of this process. Its handler notes one (received); the ranks agree on it at
    their next check (Agreement.check sets agreed); the scripts save at that step, and the run
    ends there (end: the one place a Stopped is raised). A second Ctrl-C ends the run at once, a
    second SIGTERM does not (torchrun passes each on; SLURM signals every process)."""

    def __init__(self):
        self.received = self.agreed = self.window = self.joined = 0
        self.unfinished_saves = []  # finished before the run ends: sharded.py's, in the background
        self.continued, self.launcher, self.orphaned = -math.inf, None, False
        self.interrupted = None  # ddp_spawn_train.py's children: a Value, set on Ctrl-C

    def catch(self):
        """From now on, a stop signal saves and stops every rank at one step (unless ignored); so
        does the end of a launcher that watches this process (torchrun, mp.spawn's parent), if it
        leaves it training alone. A SIGCONT is noted: a pause (SIGSTOP, Ctrl-Z) then ended."""
        for sig in STOP_SIGNALS:
            if not self.received and signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self.note)
        if hasattr(signal, "SIGCONT"):
            signal.signal(signal.SIGCONT, lambda *_: setattr(self, "continued", time.monotonic()))
        if "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process():
            self.launcher = os.getppid()

    def poll(self):
        """The stop this process has to tell the ranks: a signal's, or SIGHUP's where its launcher
        is gone (killed: its workers, in sessions of their own, would train on with nobody to
        stop them, and beside a requeued job)."""
        if self.launcher and os.getppid() != self.launcher and not self.received:
            self.orphaned, self.received = True, signal.SIGHUP
        return self.received

    def paused(self):
        """Whether a SIGCONT ended a pause of this process within the last collective's wait."""
        return time.monotonic() - self.continued < self.window + 30

    def named(self, signum):
        """The signal a line names: the user's Ctrl-C where a parent passed it on as SIGTERM."""
        interrupted = signum == signal.SIGTERM and self.interrupted and self.interrupted.value
        return signal.SIGINT if interrupted else signum

    def note(self, signum, _):
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
        self.received = max(self.received, signum)

    def end(self, step):
        """Ends the run at `step`, saved, where the ranks agreed on a stop."""
        if self.agreed:
            for finish in self.unfinished_saves:
                finish()
            raise Stopped(self.agreed, step)


STOP = Stop()


# ---- DataLoader workers: deaf to the stop signals, ended by their trainer
class Loader(DataLoader):
    """A DataLoader whose workers are deaf to stop signals from their first instruction, and so are
    the helpers that their start method starts with them: the fork server (Python 3.14's default
    on Linux) and the resource tracker. All inherit the signals blocked; killed by a job's stop
    signal, a helper would take the workers with it, and the save too."""

    def __iter__(self):  # (the workers start here)
        if not self.num_workers:
            return super().__iter__()
        start_resource_tracker()
        self.worker_init_fn = functools.partial(deaf, sockets_folder())
        with stop_signals_blocked():
            return super().__iter__()


def sockets_folder():
    """multiprocessing's temporary folder (pymp-*, a private name), where a worker's sockets go:
    made once, here, and shared by every worker (leave() removes it). In /tmp where TMPDIR is too
    deep for a socket's path (107 bytes; Python 3.14 checks characters, not bytes): clusters set
    deep ones, and each worker failed with "AF_UNIX path too long"."""
    config = multiprocessing.current_process()._config
    if "tempdir" not in config and len(os.fsencode(tempfile.gettempdir())) > 70:
        config["tempdir"] = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    return multiprocessing.util.get_temp_dir()


@contextlib.contextmanager
def stop_signals_blocked():
    """Blocks the stop signals in this thread: a process started meanwhile, by fork or by spawn,
    inherits them blocked (the mask survives exec). One that comes meanwhile is not lost: another
    thread takes it, or this one when unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def start_resource_tracker():
    """Starts multiprocessing's resource tracker (if not running) deaf to the stop signals, in a
    session of its own. This process's children share it, to unlink their semaphores if they
    cannot (sem.mp-* in /dev/shm, where workers start by forkserver or spawn). Killed by a job's
    stop signal, it would be started again, with a traceback for each semaphore it knew; by a
    SIGKILL to the trainer's process group (torchrun's, at the end of its grace period), it would
    leave them there until a reboot. A call of its own: Python 3.11 and older 3.12s unblock SIGINT
    and SIGTERM in the thread that starts it (python/cpython#127586). It starts through
    multiprocessing.util.spawnv_passfds, which has no session option: swapped for the call."""
    if hasattr(signal, "pthread_sigmask"):  # (Windows: no tracker)
        from multiprocessing import resource_tracker, util
        spawn, util.spawnv_passfds = util.spawnv_passfds, spawn_in_own_session
        try:
            with stop_signals_blocked():
                resource_tracker.ensure_running()
        finally:
            util.spawnv_passfds = spawn


# what lives until os._exit: the Popen of each process spawn_in_own_session started (freed, it
# would let subprocess reap the tracker, which multiprocessing waits for itself); the destroyed
# default process group, DDP's (run_and_exit says why)
KEPT = []


def spawn_in_own_session(path, args, passfds):
    """multiprocessing.util.spawnv_passfds's process (no other descriptor of this one: gloo's
    sockets stay here), in a session of its own."""
    helper = subprocess.Popen(args, executable=path, pass_fds=passfds, start_new_session=True)
    KEPT.append(helper)
    return helper.pid


def deaf(sockets, _):
    """Makes a DataLoader worker ignore stop signals: its trainer saves, then ends it
    (Lightning-AI/pytorch-lightning#17899); its sockets go to its trainer's folder (see
    sockets_folder). A worker started by a fork server also lets go of the
    server's end of a pipe that every process holds while the server is to run (so that its own
    children could start from it): held, it would keep the server, and so the worker, running
    after a trainer killed outright. No public name for it: where it is missing, skipped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    multiprocessing.current_process()._config["tempdir"] = sockets
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def end_workers():
    """Kills this process's daemon children, its DataLoader workers, which ignore SIGTERM. SIGCHLD's
    handler is reset first: the DataLoader would report the kills as its workers failing."""
    if hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def end_fork_server():
    """Ends the fork server that started this process's workers (Python 3.14's default, or
    workers.py's), once they are gone: its pipe from this process closed, the server ends; waited
    for up to 5 s, then killed (multiprocessing's own tears down what it preloaded, torch too,
    and would outlive the run). No public name for it: where it is missing, skipped."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    os.close(server._forkserver_alive_fd)
    with contextlib.suppress(ChildProcessError):
        for _ in range(50):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


# ---- the entry point: main, then its ending's line and status, then the exit
def run_and_exit(main, parse_args):
    """Calls main(parse_args()), then leaves: an ending prints its one line (say), and its status
    is the process's."""
    code, ended, inherited = 0, False, mp_temp_dir()
    try:
        main(parse_args())
    except (Exception, KeyboardInterrupt) as e:  # (SystemExit passes: --help's)
        code, ended = say(ending(e), launcher_rank()), True
    finally:
        end_workers()
        if dist.is_initialized():
            # kept until os._exit. Freed by leave()'s gc along with DDP's Reducer, which holds the
            # GIL, the group would wait for its gloo threads; one of them may be waiting for the
            # GIL to free the last collective's tensors. A deadlock (pytorch/pytorch#56297): 1 stop
            # in 80 on 2 busy cores, ended only by the launcher's SIGKILL
            KEPT.append(dist.group.WORLD)
            dist.destroy_process_group()
    leave(code, ended, inherited)


def ending(e):
    """Returns the Ending that exception `e` means: an Ending is its own; Ctrl-C before the first
    step, a stop with nothing saved; any error after a stop signal (a peer that stopped first) the
    signal's status, silently, but after SIGUSR1, whose status 0 would hide a crash; a timeout (a
    collective, a worker) a Hang; any other error its traceback, printed here, and exit 1."""
    why = str(e).strip().split("\n")[0]
    timeout, lost = re.search("timed out|timeout", why.lower()), peer_lost(why)
    if isinstance(e, Ending):
        return e
    if isinstance(e, KeyboardInterrupt):
        return Stopped(signal.SIGINT)
    if (timeout or lost) and STOP.paused():  # all the job paused: nobody to blame
        return Hang("a collective failed after this process was paused (SIGSTOP or Ctrl-Z, then "
                    "SIGCONT) longer than --step-timeout, which gloo and NCCL count too: nobody "
                    "froze, but the run ends here; --resume auto continues", printer=None)
    if (timeout or lost or "EADDRINUSE" in why) and not STOP.joined and one_of_several():
        return UsageError(joining_failed(why), printer=None)
    if STOP.received not in (0, getattr(signal, "SIGUSR1", None)) and not (lost and
                                                                           not STOP.agreed):
        return Stopped(STOP.received, printer=-1)
    if timeout:
        return Hang(f"{why} (--step-timeout): a rank or a worker stopped answering", printer=None)
    if lost:  # (named by train_extras/hangs.py, where it is)
        said = re.sub(r"\[\S+:\d+\] |\. This is typically.*", "", why)  # gloo's source and advice
        return Hang(f"a peer's connection closed ({said}): a rank is gone", printer=None)
    traceback.print_exception(e)
    return Failed(why, printer=-1)


def peer_lost(why):
    """Whether an error says that a peer's process is gone (gloo's words, NCCL's)."""
    words = ("connection closed by peer", "connection reset by peer", "remote process exited")
    return any(w in why.lower() for w in words)


def joining_failed(why):
    """The line of a process group that did not form within --step-timeout: a launch mistake."""
    env = os.environ
    where = f"MASTER_ADDR={env.get('MASTER_ADDR')} MASTER_PORT={env.get('MASTER_PORT')}"
    if "EADDRINUSE" in why:  # rank 0 could not serve the store there
        return f"{where}: the port is taken by another program; give a free one"
    return (f"the ranks did not join within --step-timeout at {where}, WORLD_SIZE="
            f"{env.get('WORLD_SIZE')}: every rank needs the same WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT, a port no other program holds, and all must start")


def launcher_rank():
    """This process's rank as its launcher names it (0 where none does): its rank 0 prints."""
    for name in [n[0] for n in LAUNCHERS.values()] + ["SLURM_PROCID"]:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def say(e, rank):
    """Prints `e` on its printer's rank; returns its exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving anyway: neither a launcher's SIGTERM
    end_workers()  # nor the DataLoader's check of its workers cuts it short
    if e.printer == -1:  # said already (a traceback), or by a peer
        return e.code
    printer = e.printer in (None, rank)
    if printer:
        print(e if isinstance(e, Stopped) else f"error: {e}", file=sys.stderr, flush=True)
    # rank 0 says why before the others exit; before the process group, torchrun's SIGTERM
    # would kill peers still starting (exit -15, not 2)
    if not dist.is_initialized() and one_of_several():
        time.sleep(3)
    elif not printer:
        time.sleep(0.5)
    return e.code


def leave(code, ended, inherited):
    """Leaves the process by os._exit, not by the interpreter's teardown, where gloo's threads now
    and then hang or abort it (pytorch/pytorch#190489). Every file is closed by now. First: frees
    a DataLoader left mid-epoch (where an ending came); waits, up to 1 s, for each thread of a
    DataLoader's queues, which holds the queue's 2 named semaphores until it ends (else the
    resource tracker warns of them as leaked); ends the fork server; removes multiprocessing's own
    temporary folder (pymp-*, the fork server's socket), made here, which only its exit handler
    would."""
    if ended:
        gc.collect()
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(timeout=1)
    end_fork_server()
    if mp_temp_dir() not in (None, inherited):
        shutil.rmtree(mp_temp_dir(), ignore_errors=True)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def mp_temp_dir():
    # multiprocessing's pymp-* folder, inherited from a parent process or made here (private name)
    return multiprocessing.current_process()._config.get("tempdir")
