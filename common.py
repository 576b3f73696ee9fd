"""What the scripts share: the path a run takes when nothing goes wrong, in the order a run meets it
(the flags, the extras, the run, who this process is, data, model, optimizer, the evaluation's
figures, the checkpoint, where training stands, the progress and rank 0's output). What a run does
because it may stop or fail is failsafe.py's, called at a few points named for all they do; the
optional features are train_extras/, each used where its file is (extra)."""
import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import shutil
import threading
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import failsafe


# ---- the command line: the same flags in every script
def number(kind, low, above=False):
    """Returns an argparse type: a number at least `low` (above, if `above`), not NaN nor inf."""
    def parse(text):
        value = kind(text)
        if not ((low < value) if above else (low <= value)) or value == math.inf:  # (NaN: False)
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}, "
                                             f"got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


class Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action):  # with the flag's default
        none = action.default is None or action.default is False or \
            action.default is argparse.SUPPRESS  # (not ==: 0 is a default to show)
        return action.help + ("" if none else " (default: %(default)s)")


def get_parser(doc):
    """Every script's flags, and each copied extra's (failsafe.Parser: errors in one line)."""
    p = failsafe.Parser(description=doc, formatter_class=Formatter)
    a, positive, nonneg = p.add_argument, number(int, 1), number(float, 0)
    above0 = number(float, 0, above=True)
    a("--epochs", type=positive, default=2, help="passes over the training set")
    a("--batch-size", type=positive, default=64, help="per process")
    a("--lr", type=nonneg, default=0.01, help="peak LR, NOT scaled with processes")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd (with --momentum), adamw")
    a("--momentum", type=nonneg, default=0.9, help="SGD momentum")
    a("--weight-decay", type=nonneg, default=5e-4, help="weight decay")
    a("--warmup-epochs", type=nonneg, default=0.0, help="linear, then cosine to 0")
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
      help="seconds for the ranks to join; a DataLoader worker, and after the first step a "
      "collective, may wait as long")
    a("--log-every", type=positive, default=20, help="a log line, NaN/inf check every N steps")
    a("--device", choices=["cpu", "cuda", "xpu", "mps"],  # resolved as parsed (failsafe.Parser)
      help="default: the accelerator, or cpu")
    a("--channels-last", action="store_true", help="channels_last memory format for images")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--deterministic", action="store_true", help="no TF32, deterministic cuDNN")
    for name in EXTRA_FLAGS:
        extra(name).add_flags(p)
    return p


# ---- the extras: train_extras/<name>.py, each used where its file is
EXTRAS = ("datasets", "models", "finetune", "tensorboard", "workers", "hangs", "restart", "sharded",
          "launchers")
EXTRA_FLAGS = {  # the flags of those that have any: a flag not copied is named with its file
    "datasets": ("--dataset", "--data-dir", "--train-size", "--val-size", "--image-size",
                 "--synthetic-shape"),
    "models": ("--model",),
    "finetune": ("--pretrained", "--weights", "--freeze-backbone"),
    "tensorboard": ("--tensorboard",),
    "launchers": ("--local-rank", "--local_rank")}


def extra(name):
    """Returns train_extras/<name>.py if copied, else a NotCopied (not one of EXTRAS: one line)."""
    if name not in EXTRAS:
        raise failsafe.UsageError(f"no extra named {name!r}: train_extras/ holds "
                                  f"{', '.join(EXTRAS)}")
    try:
        return importlib.import_module(f"train_extras.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("train_extras", f"train_extras.{name}"):
            raise
        return NotCopied()


class NotCopied:
    """An extra not copied: its steps do nothing (each returns what it got, or an empty value)."""

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

    def refuse_folders_only(self, run, found):  # sharded.py's
        pass

    def launcher_env(self, env):  # launchers.py's
        return None


def optional(name, what):
    """Returns train_extras/<name>.py, which `what` needs (else one line naming the file)."""
    module = extra(name)
    if isinstance(module, NotCopied):
        raise failsafe.UsageError(f"{what} needs train_extras/{name}.py (and its __init__.py): "
                                  "copy them")
    return module


# ---- the run, declared once: setup_distributed fills the first fields, main and its steps the rest
@dataclasses.dataclass(slots=True)  # slots: no field but these (a script's own: a subclass)
class Run:
    args: argparse.Namespace  # rank 0's flags, on every rank (failsafe.same_flags)
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
    agreement: "failsafe.Agreement" = None  # what the ranks agree on at a check
    progress: "Progress" = None  # the steps counted and timed; rank 0's bar, lines and rows


# ---- who this process is, and on what device
def launcher_env():
    """Returns (rank, world size, local rank, local size, launcher): torchrun's variables (any
    env:// launch's), else a lone process's; srun's, mpirun's, a Kubernetes pod's and the old
    launcher's: train_extras/launchers.py. failsafe checks MASTER_ADDR and MASTER_PORT."""
    env = os.environ
    found = extra("launchers").launcher_env(env)
    if found is None:
        failsafe.check_launch(env)
        found = (int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                 int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1)),
                 "torchrun" if "RANK" in env else None)
    if found[1] > 1:
        failsafe.check_rendezvous(env, found[4], found[1])
    return found


def device_type(asked, collectives=True):
    """Returns --device, else torch's accelerator (not MPS with collectives: pytorch#160732)."""
    found = getattr(torch.accelerator.current_accelerator(check_available=True), "type", None)
    if asked not in (None, "cpu", found):
        raise failsafe.UsageError(f"--device {asked}, but torch finds no {asked} device here")
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
    """--backend, else the device's; and gloo for the object collectives on the CPU."""
    backend = args.backend or dist.get_default_backend_for_device(args.device)
    return backend if backend == "gloo" else f"{args.device}:{backend},cpu:gloo"


def set_threads_and_math(local_world_size, deterministic):
    """Shares the cores among the machine's processes where OMP_NUM_THREADS is unset (torchrun sets
    it only with several); TF32 and cuDNN's benchmark, or determinism."""
    if "OMP_NUM_THREADS" not in os.environ:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux only
        cores = len(affinity(0)) if affinity else os.cpu_count()
        torch.set_num_threads(max(1, cores // local_world_size))
    cudnn = torch.backends.cudnn
    cudnn.benchmark = cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not deterministic
    cudnn.deterministic = deterministic


def on_rank0(fn, rank):
    """Runs fn() on rank 0 while the others wait for it (a barrier); returns its result there, None
    on the others. Its UsageError (a refusal) is raised on every rank; any other error ends rank
    0, and the others when their wait times out."""
    result, error = None, [None]
    if rank == 0:
        try:
            result = fn()
        except failsafe.UsageError as e:
            error = [str(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise failsafe.UsageError(error[0])
    return result


# ---- the data and the model: replace these calls with your own Dataset and nn.Module
def load_data_rank0_first(args, rank):
    """Rank 0 first: the one process that may download files."""
    data = on_rank0(lambda: load_data(args, download=True), rank)
    if rank != 0:
        data = load_data(args)
    return data


def load_data(args, download=False):
    """Returns (train_set, val_set) of (x, label): replace with your own Datasets (on every rank;
    rank 0 first). Steps a Dataset may carry: set_epoch, normalize_uint8, batch_loader."""
    return optional("datasets", "the built-in data").load(args, download)


def make_model(args, data):
    """Returns the built-in model for `data` (train_extras/models.py): replace with yours."""
    return optional("models", "the built-in models").for_data(args, data)


def make_loader(ds, batches, run):
    """Returns a DataLoader over `batches`, its generator not the one dropout draws from, its
    workers deaf to the stop signals (failsafe.DeafWorkersLoader)."""
    if callable(getattr(ds, "batch_loader", None)):  # whole batches (train_extras/datasets.py)
        return ds.batch_loader(batches, run)
    workers = run.args.workers
    start = extra("workers").start(ds) if workers else {}
    return failsafe.DeafWorkersLoader(ds, batch_sampler=batches, num_workers=workers, **start,
                                      generator=torch.Generator(),
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
    return fn(x) if isinstance(x, torch.Tensor) else x


def micro_batches(x, n):
    return [nested(lambda t: t.chunk(n)[i], x) for i in range(n)]


def to_device(run, ds, x, y):
    """Moves a batch to the device (`x` of any structure), integer labels as int64 (float ones, soft
    targets, as they are)."""
    failsafe.check_sample(x, y)
    y = y[:, 0] if y.ndim == 2 and y.shape[1] == 1 else y
    y = y.to(run.device, y.dtype if y.is_floating_point() else torch.long, non_blocking=True)
    return nested(lambda t: input_on(run, ds, t), x), y


def input_on(run, ds, x):
    """Moves one input tensor to the device: float64 as float32; uint8 made float there (the
    Dataset's normalize_uint8); channels_last with --channels-last."""
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


# ---- the checkpoint: written atomically, read on the CPU; --out-dir holds one run
def save_atomic(obj, path):
    """Saves obj to a temporary file, fsynced, renamed over `path`: a kill leaves the last one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        raise failsafe.save_failed(path, e) from None
    finally:
        if os.path.exists(tmp):  # no partial file left behind
            os.remove(tmp)


def write_and_end_if_stopped(run, state):
    """Every rank, a save's last step: rank 0 writes `state` to last.pt (None: FSDP's sharded save)
    while the others wait (a failed write stops every rank); the position notes it; where the ranks
    agreed on a stop, the run ends here, saved (failsafe.STOP.end raises Stopped)."""
    if state is not None:
        on_rank0(lambda: save_atomic(state, os.path.join(run.out_dir, "last.pt")), run.rank)
    run.position.has_checkpoint = True
    failsafe.STOP.end(run.position.step)


def read_checkpoint(path):
    """Reads a checkpoint file on the CPU, tensors only (no code in it runs), its bytes checked
    against the CRCs torch wrote (failsafe.refuse_unreadable)."""
    failsafe.refuse_unreadable(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever torch.load raises
        raise failsafe.unreadable(path, e) from None


def checkpoint_to_resume(run):
    """Rank 0: the checkpoint --resume names ('auto': --out-dir's, if any), read, checked that this
    run can continue it, its row to evaluate dropped where metrics.jsonl has it; None for none."""
    args, path = run.args, os.path.join(run.out_dir, "last.pt")
    if args.resume == "auto" and not os.path.exists(path):
        print(f"--resume auto: no checkpoint in {run.out_dir}, starting afresh", flush=True)
        return None
    if not args.resume:
        return None
    path = path if args.resume == "auto" else args.resume
    if os.path.isfile(os.path.join(path, "last.pt")):  # its folder
        path = os.path.join(path, "last.pt")
    ckpt = read_checkpoint(path)
    model = ckpt.get("model") if isinstance(ckpt, dict) else None
    shapes = {k: v.shape for k, v in model.items()} if isinstance(model, dict) else None
    return failsafe.drop_logged_row(run, failsafe.check_fits(path, ckpt, shapes, run))


def take_over_out_dir(run):
    """Rank 0, once the checkpoint to resume (if any) is accepted: makes --out-dir; --overwrite
    deletes the earlier run there, all of it (--resume auto would take the rest); a resume keeps
    the metrics rows its checkpoint covers (failsafe.keep_covered_rows)."""
    try:
        os.makedirs(run.out_dir, exist_ok=True)
    except OSError as e:
        raise failsafe.UsageError(f"--out-dir {run.out_dir}: {e.strerror}") from None
    if run.args.overwrite:
        for name in failsafe.earlier_checkpoints(run.out_dir) + ["metrics.jsonl"]:
            path = os.path.join(run.out_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    failsafe.keep_covered_rows(run)


def metrics_file(run):
    return os.path.join(run.out_dir, "metrics.jsonl")


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
    """Where training stands: the epoch, the step, the sums of the losses and gradient norms (on the
    device: no host sync), and what a checkpoint saves of it (state)."""

    def __init__(self, run, saved=None):
        self.run, self.has_checkpoint = run, saved is not None
        saved = saved or {"epoch": 0}  # pending_row: an epoch's, saved but not yet evaluated
        self.epoch, self.pending_row = saved["epoch"], saved.get("row")
        self.saved_sums = [saved.get("loss_sum", 0.0), saved.get("grad_norm_sum", 0.0)]
        self.step_in_epoch = saved.get("samples_in_epoch", 0) // run.global_batch
        self.step = self.epoch * run.steps_per_epoch + self.step_in_epoch
        self.start_step = self.step  # where this process started
        self.sums_dtype = torch.float32 if run.device.type == "mps" else torch.float64
        self.epoch_done = self.last = self.save_due = False

    def start_epoch(self, epoch):
        """A resumed epoch keeps the sums of its saved part."""
        self.pending_row = None  # the epoch's metrics, once trained
        self.epoch, self.step_in_epoch = epoch, self.step_in_epoch if epoch == self.epoch else 0
        self.sums = torch.tensor(self.saved_sums if self.step_in_epoch else [0.0, 0.0],
                                 dtype=self.sums_dtype, device=self.run.device)
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
        next step, in samples of its epoch (another world size, same global batch: same step)."""
        run = self.run
        epoch, steps = (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.step_in_epoch)
        sums = sums if steps else [0.0, 0.0]
        return {"epoch": epoch, "step_in_epoch": steps,
                "samples_in_epoch": steps * run.global_batch,
                "steps_per_epoch": run.steps_per_epoch, "global_batch": run.global_batch,
                "loss_sum": sums[0], "grad_norm_sum": sums[1], "row": self.pending_row,
                "data": data_of(run)}


# ---- the progress: every rank counts and times its steps; rank 0 alone shows them
class Progress:
    """The run's progress, on every rank (its clock waits for the accelerator): the steps of the
    epoch and their speed (from the end of the first step), the epoch's metrics row; rank 0 alone
    shows the bar, and a line every --log-every steps where the output is not a terminal."""

    def __init__(self, run):
        self.run = run
        tqdm.set_lock(threading.RLock())  # not a semaphore, which os._exit would leak

    def start_epoch(self):
        self.first_step_end = self.epoch_end = None  # (time, step) after the first step; a time
        position = self.run.position
        self.bar = tqdm(total=self.run.steps_per_epoch, initial=position.step_in_epoch,
                        leave=False, desc=f"epoch {position.epoch + 1}",
                        disable=None if self.run.rank == 0 else True)

    def step_done(self, loss):
        """Moves the bar; every --log-every steps, the loss, LR and speed in it and in rank 0's line
        (the loss's .item(): a host sync, on every rank)."""
        position, run = self.run.position, self.run
        if self.first_step_end is None:
            self.first_step_end = (self.clock(), position.step)
        self.bar.update()
        if position.step % run.args.log_every:
            return
        values, speed = {"loss": f"{loss.item():.4f}",
                         "lr": f"{run.scheduler.get_last_lr()[0]:.2e}"}, self.samples_per_s()
        if speed is not None:  # (none: no step after the first to time)
            values["samples_per_s"] = f"{speed:.0f}"
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
        self.epoch_end = self.clock()

    def epoch_row(self, **row):
        """Returns the epoch's row of training metrics; the evaluation adds its own (a stop between
        the two: the checkpoint holds this half, and the resume evaluates it first)."""
        position, speed = self.run.position, self.samples_per_s()
        return {"epoch": position.epoch + position.step_in_epoch / self.run.steps_per_epoch,
                "step": position.step, **row, "lr": self.run.scheduler.get_last_lr()[0],
                "samples_per_s": speed,  # (none: no step after the first, and no epoch_time_s)
                "epoch_time_s": self.epoch_end - self.first_step_end[0] if speed else None}

    def samples_per_s(self):
        """From the end of the epoch's first step; None where no step came after it."""
        start = self.first_step_end
        steps = self.run.position.step - start[1] if start else 0
        seconds = (self.epoch_end or self.clock()) - start[0] if steps else 0.0
        return steps * self.run.global_batch / seconds if seconds > 0 else None


def log_and_end_if_stopped(run, row):
    """Every rank, once the epoch is evaluated: rank 0 writes its row (metrics.jsonl, the
    screen, --tensorboard; a failed write stops every rank). Then the ranks agree on a stop that
    came during the evaluation, which ends the run here (failsafe.STOP.end raises Stopped): the
    epoch was saved before it."""
    on_rank0(lambda: log_epoch(run, row), run.rank)
    run.agreement.check()
    failsafe.STOP.end(run.position.step)


def log_epoch(run, row):
    """Rank 0: writes the epoch's row to metrics.jsonl, the screen, and --tensorboard."""
    peak = run.device.type in ("cuda", "xpu") and torch.accelerator.max_memory_allocated(run.device)
    row = {**row, "peak_mem_mb": peak / 2**20 if peak else None}
    failsafe.append_row(metrics_file(run), (json.dumps(row) + "\n").encode(), row["step"])
    if getattr(run.args, "tensorboard", False):
        extra("tensorboard").log(run.out_dir, row)
    val = ("" if not row["val_count"] else  # (no validation set)
           f"  val_loss {row['val_loss']:.4f}  val_acc {row['val_acc']:.4f}")
    speed = f"  {row['samples_per_s']:.0f} samples/s" if row["samples_per_s"] else ""  # (one step)
    print(f"epoch {row['epoch']:.4g}  train_loss {row['train_loss']:.4f}{val}  lr {row['lr']:.2e}"
          f"{speed}", flush=True)
