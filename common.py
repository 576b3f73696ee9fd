"""What the training scripts share that does not depend on how their processes are launched: the command line, the
data, the model, checkpoint files, progress and metrics. Nothing runs at import. The distributed part of each
script (how a process learns its rank, how the model is wrapped, how gradients and results are reduced) is in the
script itself."""
import argparse
import contextlib
import datetime
import faulthandler
import fcntl
import functools
import importlib.util
import json
import math
import os
import pickle
import re
import resource
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader
from tqdm import tqdm


class UsageError(Exception):
    """Bad input: the scripts print it as one line (on rank 0 only) and exit with status 2."""

    def __str__(self):  # raised again in the main process after a DataLoader worker's: its original last line
        return super().__str__().strip().splitlines()[-1].split("UsageError: ")[-1]


class BadFile(UsageError):
    """A file that only one rank reads turned out unreadable (an image in a DataLoader worker): that rank prints it."""


class NonFinite(Exception):
    """The loss became NaN/inf: every rank stops at the same step, exit status 1."""


class Hung(Exception):
    """A collective timed out: a rank stopped answering. Exit status 3; printed by the first rank that was not
    behind."""

    def __init__(self, message, print_it):
        super().__init__(message)
        self.print_it = print_it


class Stopped(Exception):
    """A signal stopped the run after every rank saved at the same step: exit status 0 after SIGUSR1 (a time limit
    near: requeue and --resume auto), 143 (128 + 15) after SIGTERM."""

    def __init__(self, signum, step):
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}, where last.pt was saved: "
                         "--resume auto continues from there")
        self.code = 0 if signum == signal.SIGUSR1 else 128 + signum


def exit_code(e):
    """The exit status for what ended a run: see the table in docs/failures.md."""
    return e.code if isinstance(e, Stopped) else 2 if isinstance(e, UsageError) else 3 if isinstance(e, Hung) else 1


HERE = os.path.dirname(os.path.abspath(__file__))  # the scripts' folder


# ---- command line: the same flags, with the same meanings, in every script
def launcher_rank():
    """This process's rank as its launcher set it (torchrun, srun), 0 without one: who prints a usage error."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def launched_as_one_of_several():
    """The launcher that started this process as one of several (torchrun, an srun step of several tasks), or None:
    what the one-process scripts refuse. (sbatch's batch script is one process, though SLURM_NTASKS may be more.)"""
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "torchrun"
    return "srun" if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 else None


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """argparse's own errors (an unknown flag, a bad choice): once, not once per process of a launcher."""
        if launcher_rank() == 0:
            print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def get_parser(doc):
    p = Parser(description=doc, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--dataset", default="synthetic", choices=["synthetic", "mnist", "cifar10", "imagefolder"],
      help="synthetic (offline, MNIST-shaped), mnist, cifar10 or imagefolder")
    a("--data-dir", default="./data", help="mnist/cifar10: downloaded here; imagefolder: the folder of train/, val/")
    a("--train-size", type=int, help="training samples (synthetic: default 10000; real data: a subset, default all)")
    a("--val-size", type=int, help="validation samples (synthetic: default 2000; real data: a subset, default all)")
    a("--image-size", type=int, help="imagefolder: resize to this square (default 224; with --pretrained: the crop "
      "size, default the weights' own)")
    a("--synthetic-shape", default="1x28x28", help="synthetic: image shape CxHxW, e.g. 3x224x224 for ImageNet models")
    a("--model", default="cnn", help="cnn (a small 2-conv net) or a torchvision classification model, e.g. resnet18")
    a("--pretrained", action="store_true", help="start from the torchvision model's default ImageNet weights, with a "
      "new head for this data's classes and the weights' own preprocessing (fetched once per machine)")
    a("--freeze-backbone", action="store_true", help="train only the classifier head; the rest (BatchNorm statistics "
      "included) keeps the --pretrained or --weights values")
    a("--epochs", type=int, default=2, help="number of passes over the training set")
    a("--batch-size", type=int, default=64, help="per process (per GPU): the global batch is this times the processes")
    a("--lr", type=float, default=0.01, help="peak learning rate, for the global batch: NOT rescaled with processes")
    a("--optimizer", default="sgd", choices=["sgd", "adamw"], help="sgd (with --momentum) or adamw")
    a("--momentum", type=float, default=0.9, help="SGD momentum")
    a("--weight-decay", type=float, default=5e-4, help="weight decay")
    a("--warmup-epochs", type=float, default=0.0, help="linear LR warmup (may be fractional), then cosine decay to 0")
    a("--seed", type=int, default=0, help="seeds the model init, the synthetic data, the data order and augmentation")
    a("--workers", type=int, default=2, help="DataLoader worker processes for files (in-memory data needs none)")
    a("--max-steps", type=int, help="stop after this many optimizer steps in all (quick runs, benchmarks)")
    a("--grad-accum", type=int, default=1, help="accumulate gradients of this many micro-batches per optimizer step")
    a("--out-dir", help="where metrics.jsonl and last.pt go (default ./runs/<script name>)")
    a("--overwrite", action="store_true", help="start afresh in an --out-dir that holds a checkpoint, replacing it")
    a("--save-every", type=int, help="also save every N optimizer steps, not only at epoch ends")
    a("--ckpt-format", choices=["file", "dcp"], default="file",
      help="file: one last.pt, gathered whole to rank 0 (loads anywhere, even without torch.distributed); dcp: a "
      "sharded checkpoint folder ckpt-<step>, every rank writing its own part, nothing gathered (for models whose "
      "whole state does not fit one host; needs a filesystem every rank sees). Both reshard on --resume")
    a("--async-save", action="store_true", help="with --ckpt-format dcp: write in the background while training goes "
      "on (a copy of this rank's state in host memory meanwhile); a save on a signal is still synchronous")
    a("--resume", help="checkpoint (last.pt or a ckpt-<step> folder) to continue from, or 'auto': the newest complete "
      "one in --out-dir if there is one")
    a("--weights", help="initialize the model from this state_dict or checkpoint; tensors of other names or shapes "
      "(another head size or channel count) keep their fresh values. Optimizer and schedule start fresh")
    a("--clip-grad", type=float, metavar="MAX_NORM", help="clip the gradients' global norm (over all ranks and "
      "shards; after unscaling under fp16) to MAX_NORM; metrics.jsonl then gets grad_norm, their mean norm before "
      "clipping, and skipped_steps")
    a("--step-timeout", type=float, default=300, help="after the first step, seconds that any collective may wait "
      "(a step, an evaluation, rank 0 writing a checkpoint): past it, every rank stops and names the ranks that did "
      "not arrive")
    a("--log-every", type=int, default=20, help="update the progress bar and check for NaN/inf every N steps (a sync)")
    a("--tensorboard", action="store_true", help="also log to TensorBoard in --out-dir (pip install tensorboard)")
    a("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    a("--channels-last", action="store_true", help="channels_last memory format (faster convolutions on GPU)")
    a("--compile", action="store_true", help="torch.compile the model")
    a("--deterministic", action="store_true", help="no TF32, deterministic cuDNN: for comparing weights, not for speed")
    return p


def validate(args):
    """Every flag checked before anything is built, on every rank alike, so that every rank stops together. Pure:
    it reads `args` (and whether this machine has CUDA and tensorboard), nothing else."""
    for name in ("epochs", "batch_size", "grad_accum", "log_every", "max_steps", "save_every", "train_size",
                 "val_size", "nprocs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name, low, high in (("lr", 0, math.inf), ("momentum", 0, 1), ("weight_decay", 0, math.inf),
                            ("warmup_epochs", 0, math.inf)):
        value = getattr(args, name)
        if not (math.isfinite(value) and low <= value < high):
            within = f"at least {low}" if high == math.inf else f"at least {low} and below {high}"
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number {within}, got {value}")
    if args.clip_grad is not None and not (math.isfinite(args.clip_grad) and args.clip_grad > 0):
        raise UsageError(f"--clip-grad must be a finite number above 0, got {args.clip_grad}")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in 0 .. {2**32 - 1}, got {args.seed}")
    if args.workers < 0:
        raise UsageError(f"--workers must be 0 (load in the training process) or more, got {args.workers}")
    if args.image_size is not None and args.image_size < 7:
        raise UsageError(f"--image-size must be at least 7, got {args.image_size}")
    if not parse_shape(args.synthetic_shape):
        raise UsageError(f"--synthetic-shape must be CxHxW with positive integers and H, W at least 7, got "
                         f"{args.synthetic_shape!r}")
    if args.model != "cnn":
        import torchvision
        if args.model not in torchvision.models.list_models(module=torchvision.models):
            raise UsageError(f"unknown --model {args.model!r}: use cnn or a torchvision classification model such "
                             "as resnet18")
    if args.pretrained and args.model == "cnn":
        raise UsageError("--pretrained needs a torchvision model (e.g. --model resnet50): cnn has no pretrained "
                         "weights")
    if args.pretrained and args.weights:
        raise UsageError("--pretrained and --weights both set the starting weights: choose one")
    if args.freeze_backbone and not (args.pretrained or args.weights):
        raise UsageError("--freeze-backbone needs --pretrained or --weights: a randomly initialized backbone is not "
                         "worth freezing")
    if args.overwrite and args.resume:
        raise UsageError("--overwrite starts afresh and --resume continues: choose one")
    if args.async_save and args.ckpt_format != "dcp":
        raise UsageError("--async-save needs --ckpt-format dcp (a last.pt is gathered and written by rank 0 alone)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but this machine has no CUDA GPU (or this torch build has no CUDA)")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard")


def parse_shape(text):
    """(C, H, W) from 'CxHxW', or None if it is not one."""
    try:
        c, h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        return None
    return (c, h, w) if c >= 1 and h >= 7 and w >= 7 else None


def set_cpu_threads(local_world_size):
    """Share the cores among the processes of this machine (torchrun does so only with several processes, srun
    never)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world_size))


def set_fast_math(device, deterministic):
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic  # autotune convolutions for the fixed input shape
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cuda.matmul.allow_tf32 = not deterministic  # TF32 on Ampere+: ~fp32 accuracy, much faster
        torch.backends.cudnn.allow_tf32 = not deterministic


# ---- data: the built-in datasets, keyed by (epoch, index) so that augmentation does not depend on --workers
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class InMemory(torch.utils.data.Dataset):
    """Tensors in memory. Indexed by (epoch, list of indices): one tensor index makes the whole batch,
    no per-sample Python and no collate."""

    def __init__(self, x, y, classes=10, augment=False, seed=0):
        self.x, self.y, self.classes, self.augment, self.seed = x, y, classes, augment, seed

    def __len__(self):
        return len(self.y)

    def __getitem__(self, key):
        epoch, idx = key
        idx = torch.as_tensor(idx, device=self.x.device)
        x = self.x[idx]
        if self.augment:
            x = crop_flip(x, per_sample_random(self.seed, epoch, idx), pad=x.shape[-1] // 8)
        return x, self.y[idx]


class ImageFiles(torch.utils.data.Dataset):
    """An ImageFolder decoded in DataLoader workers, keyed by (epoch, index): its random augmentation is seeded from
    (seed, epoch, index), not from a worker's RNG, so results do not depend on --workers. Resized to `size`, with
    random crop and flip for training; with `weights` (--pretrained), the weights' own preprocessing: validation
    exactly as theirs, training with the augmentation of torchvision's recipes (random resized crop, flip).
    For speed, training images are decoded by torchvision.io, cropped, resized and flipped while still uint8
    (transforms.v2), and leave the workers as uint8: 4x fewer bytes to carry to the main process and the GPU, where
    `normalize` makes them float. About 1.4x the images/s of PIL and the v1 transforms (benchmarks/loader.py)."""

    def __init__(self, root, size, augment, seed, weights=None):
        from torchvision import datasets
        from torchvision.transforms import v2
        self.folder, self.seed = datasets.ImageFolder(root), seed  # its loader makes every image RGB
        self.classes = self.folder.classes
        if weights is None:
            size = size or 224
            flips = [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip()] if augment else []
            steps = [v2.Resize((size, size))] + flips
            mean, std = IMAGENET_MEAN, IMAGENET_STD
        else:
            preset = weights.transforms()  # resize, center crop, mean/std: how the weights were evaluated
            if size:  # another crop size, the resize scaled with it
                preset = weights.transforms(crop_size=size, resize_size=round(size * preset.resize_size[0] /
                                                                              preset.crop_size[0]))
            steps = [v2.RandomResizedCrop(preset.crop_size, interpolation=preset.interpolation),
                     v2.RandomHorizontalFlip()]
            mean, std = preset.mean, preset.std
        self.transform = v2.Compose([v2.ToImage()] + steps)  # on the uint8 image: 1 byte a value to resize
        self.mean, self.std = mean, std
        self.as_pil = weights is not None and not augment
        if self.as_pil:  # validation is exactly the weights' own, on the PIL image (a tensor's resize differs a bit)
            self.transform = preset

    def __len__(self):
        return len(self.folder)

    def read(self, path):
        from torchvision.transforms.functional import pil_to_tensor
        if self.as_pil:
            return self.folder.loader(path)
        try:  # torchvision 0.29 deprecates its decoders for TorchCodec; if they are gone, PIL reads every file
            from torchvision.io import ImageReadMode, decode_image
            return decode_image(path, mode=ImageReadMode.RGB)
        except (ImportError, RuntimeError):  # or a format it does not read (BMP, TIFF, ...), or a broken file
            return pil_to_tensor(self.folder.loader(path))

    def normalize(self, x):
        """A batch of this dataset's images, on its device: uint8 to float, normalized with the mean and std (the
        scale to [0, 1] folded in), in place. Validation with --pretrained is float already."""
        if x.dtype != torch.uint8:
            return x
        x = x.float()
        for c, (m, s) in enumerate(zip(self.mean, self.std)):  # Python scalars: nothing to copy to the GPU
            x[:, c].sub_(255 * m).div_(255 * s)
        return x

    def __getitem__(self, key):
        epoch, i = key
        path, label = self.folder.samples[i]
        try:
            image = self.read(path)
        except (OSError, ValueError) as e:  # truncated, empty, not an image: name the file, among 100,000 others
            raise BadFile(f"{path} is not a readable image ({type(e).__name__}: {e}): remove or replace it") from None
        with torch.random.fork_rng(devices=[]):  # torchvision's random transforms draw from torch's CPU RNG
            torch.default_generator.manual_seed(int(per_sample_random(self.seed, epoch, torch.tensor(i))))
            return self.transform(image), label


def per_sample_random(seed, epoch, idx):
    """A pseudo-random 31-bit integer per sample, a function of (seed, epoch, index) alone."""
    h = (idx.long() + ((seed * 1_000_003 + epoch * 7_919) % 2**31) * 40_503) & 0x7FFFFFFF
    for _ in range(3):
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
    return h


def crop_flip(x, r, pad):
    """Random crop after zero padding, and random horizontal flip, for a batch (B, C, H, W); r from
    per_sample_random."""
    B, C, H, W = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy, dx = (r >> 1) % (2 * pad + 1), (r >> 9) % (2 * pad + 1)
    rows = dy[:, None] + torch.arange(H, device=x.device)
    cols = dx[:, None] + torch.arange(W, device=x.device)
    cols = torch.where((r & 1).bool()[:, None], cols.flip(1), cols)
    out = padded[torch.arange(B, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # B,H,W,C
    return out.permute(0, 3, 1, 2).contiguous()


def synthetic(n, seed, templates_seed, shape=(1, 28, 28)):
    """MNIST-shaped by default and learnable, but not trivially: 10 smooth class templates under random shifts,
    contrast and noise. Another shape (C, H, W), e.g. (3, 224, 224), times models made for larger images."""
    c, h, w = shape
    g = torch.Generator().manual_seed(templates_seed)
    templates = F.interpolate(torch.randn(10, c, 7, 7, generator=g), size=(h, w), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    shifts = torch.randint(0, 2**31 - 1, (n,), generator=g)
    x = crop_flip(templates[y], shifts & ~1, pad=min(h, w) // 7)  # shift only; bit 0 (the flip) cleared
    x = x * (0.5 + torch.rand(n, 1, 1, 1, generator=g)) + 1.2 * torch.randn(n, c, h, w, generator=g)
    return x, y


def load_data(args, download=False):
    """(train_set, val_set) for --dataset. With download=True (rank 0 only) fetch what is missing.
    With --pretrained, images are normalized as the weights expect, and grayscale ones repeated to 3 channels."""
    d, weights = args.dataset, pretrained_weights(args.model) if args.pretrained else None
    to_rgb = (lambda x: x.expand(-1, 3, -1, -1).contiguous()) if weights else (lambda x: x)
    if d == "synthetic":
        shape = parse_shape(args.synthetic_shape)
        if weights and shape[0] not in (1, 3):
            raise UsageError(f"--pretrained needs images of 1 or 3 channels, not {shape[0]}")
        xt, yt = synthetic(args.train_size or 10000, args.seed, args.seed, shape)
        xv, yv = synthetic(args.val_size or 2000, args.seed + 10**6, args.seed, shape)
        mean, std = xt.mean(), xt.std()
        return InMemory(to_rgb((xt - mean) / std), yt), InMemory(to_rgb((xv - mean) / std), yv)
    if d == "imagefolder":
        sets = []
        for split, n in (("train", args.train_size), ("val", args.val_size)):
            root = os.path.join(args.data_dir, split)
            try:
                sets.append(ImageFiles(root, args.image_size, split == "train", args.seed, weights))
            except (FileNotFoundError, OSError) as e:
                raise UsageError(f"--dataset imagefolder needs {root}/<class>/<image> files: {e}") from None
            samples = sets[-1].folder.samples
            sets[-1].folder.samples = [samples[i] for i in subset([s[1] for s in samples], n, args.seed, split)]
        if sets[0].classes != sets[1].classes:
            raise UsageError(f"train/ and val/ in {args.data_dir} hold different classes: "
                             f"{sets[0].classes} vs {sets[1].classes}")
        if download and args.image_size is None and not weights:  # said once, by the process that downloads
            print("imagefolder: images resized to 224x224; small images train much faster at about their own size: "
                  "--image-size", flush=True)
        return tuple(sets)
    from torchvision import datasets
    cls, mean, std = {"mnist": (datasets.MNIST, [0.1307], [0.3081]),
                      "cifar10": (datasets.CIFAR10, [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])}[d]
    if weights:  # the mean/std the pretrained model was trained with (at this data's own resolution: docs/usage.md)
        mean, std = weights.transforms().mean, weights.transforms().std
    out = []
    for train, n in ((True, args.train_size), (False, args.val_size)):
        try:
            ds = cls(args.data_dir, train=train, download=download)
        except Exception as e:  # no network, or no files and download=False
            where = os.path.join(args.data_dir, *(("MNIST", "raw") if d == "mnist" else ("cifar-10-batches-py",)))
            raise UsageError(f"{d} is not in {args.data_dir} and could not be downloaded ({type(e).__name__}): put "
                             f"its files in {where}, or use --dataset synthetic, which needs no download") from None
        keep = subset(torch.as_tensor(ds.targets).tolist(), n, args.seed, "train" if train else "val")
        x = torch.as_tensor(ds.data[keep]).float().div(255)
        x = to_rgb(x[:, None] if x.ndim == 3 else x.permute(0, 3, 1, 2))  # MNIST: N,H,W; CIFAR: N,H,W,C
        x = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        out.append(InMemory(x.contiguous(), torch.as_tensor(ds.targets)[keep], augment=train and d == "cifar10",
                            seed=args.seed))
    return tuple(out)


def subset(labels, n, seed, split):
    """Indices of a class-stratified subset of n samples (all without n), drawn with `seed`: the same on every rank
    and every run. Each class gets its proportional share, rounded by largest remainder; none may get 0."""
    if n is None or n >= len(labels):
        return list(range(len(labels)))
    by_class = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    exact = {c: n * len(idx) / len(labels) for c, idx in by_class.items()}
    share = {c: int(q) for c, q in exact.items()}
    for c in sorted(exact, key=lambda c: share[c] - exact[c])[:n - sum(share.values())]:  # largest remainders
        share[c] += 1
    if min(share.values()) == 0:
        needed = math.ceil(len(labels) / min(map(len, by_class.values())))
        raise UsageError(f"--{split}-size {n} leaves a class without any {split} sample ({len(by_class)} classes, "
                         f"the smallest {min(map(len, by_class.values()))} of {len(labels)}): take at least {needed}")
    g, keep = torch.Generator().manual_seed(seed), []
    for c, idx in by_class.items():
        keep += [idx[j] for j in torch.randperm(len(idx), generator=g)[:share[c]].tolist()]
    return sorted(keep)


def channels_and_classes(ds):
    """(image channels, number of classes) of any map-style dataset of (image, label) pairs: the classes from its
    `classes` attribute where it has one (a count, or the names as torchvision's datasets hold them), else from one
    pass over its labels (every image is read: give your dataset a `classes` attribute to skip that)."""
    x = ds.x[:1] if isinstance(ds, InMemory) else ds[(0, 0) if isinstance(ds, ImageFiles) else 0][0][None]
    classes = getattr(ds, "classes", None)
    if classes is None:
        classes = 1 + max(int(y) for _, y in (ds[i] for i in range(len(ds))))
    classes = classes if isinstance(classes, int) else len(classes)
    if classes < 2:
        raise UsageError(f"the data holds {classes} class: a classifier needs at least 2")
    return x.shape[1], classes


class Batches(BatchSampler):
    """Batches of a sampler's indices, as the dataset wants its keys: the built-in ones with the sampler's epoch (for
    their augmentation's seed), any other dataset plain indices. `skip` batches are left out of the next pass only:
    that is how a resumed run skips what it had consumed."""

    def __init__(self, sampler, batch_size, drop_last, ds):
        super().__init__(sampler, batch_size, drop_last)
        self.kind, self.skip = type(ds), 0

    def __iter__(self):
        epoch, skip, self.skip = getattr(self.sampler, "epoch", 0), self.skip, 0
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                yield (epoch, batch) if self.kind is InMemory else [(epoch, j) for j in batch] \
                    if self.kind is ImageFiles else batch


def make_loader(ds, sampler, batch_size, drop_last, workers, device):
    """A DataLoader over batches of `sampler`; set `loader.batches.skip` to leave out the first batches of a pass,
    and call `loader.normalize(x)` on each batch of images once on the device."""
    batches = Batches(sampler, batch_size, drop_last, ds)
    if isinstance(ds, InMemory):  # the whole batch with one tensor index, in this process, on the GPU if it fits
        if device.type == "cuda" and ds.x.nbytes < 4 * 2**30:
            ds.x, ds.y = ds.x.to(device), ds.y.to(device)  # copied once, not every step
        loader = DataLoader(ds, sampler=batches, batch_size=None, generator=torch.Generator().manual_seed(0))
    else:  # files: decoded in worker processes, into pinned memory for asynchronous copies to the GPU
        loader = DataLoader(ds, batch_sampler=batches, num_workers=workers, pin_memory=device.type == "cuda",
                            persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))
    # (a generator of its own: an iterator draws its workers' seed from it, not from the one dropout draws from, so
    # that resuming mid-epoch, which starts a new iterator, draws nothing more than the uninterrupted run did)
    loader.batches = batches
    # image files come as uint8 (4x fewer bytes to move): `x = loader.normalize(x)` on the device makes them float
    loader.normalize = ds.normalize if isinstance(ds, ImageFiles) else nn.Identity()
    return loader


# ---- model: the built-in ones, pretrained weights, freezing, optimizer and schedule
class Net(nn.Module):
    """The classic 2-conv net of the MNIST tutorials, without dropout; the adaptive pool lets it take any image
    size."""

    def __init__(self, channels=1, classes=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(channels, 32, 3), nn.Conv2d(32, 64, 3)
        self.pool = nn.AdaptiveMaxPool2d(12)  # = max_pool2d(2) on 28x28 inputs
        self.fc1, self.fc2 = nn.Linear(64 * 12 * 12, 128), nn.Linear(128, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


AUX_LOGITS = ("googlenet", "inception_v3")


def make_model(name, channels, classes):
    if name == "cnn":
        return Net(channels, classes)
    import torchvision
    # googlenet and inception_v3 would return auxiliary outputs in training mode, which the loss does not take
    extra = dict(aux_logits=False, init_weights=True) if name in AUX_LOGITS else {}
    model = torchvision.models.get_model(name, num_classes=classes, **extra)
    if channels != 3:  # swap the first conv for one that takes this data's channels
        for parent in model.modules():
            for child_name, child in parent.named_children():
                if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                    setattr(parent, child_name, nn.Conv2d(channels, child.out_channels, child.kernel_size,
                                                          child.stride, child.padding, bias=child.bias is not None))
                    return model
    return model


def pretrained_weights(name):
    """The default (best) ImageNet weights of torchvision model `name`: their URL, preprocessing and metadata."""
    import torchvision
    return torchvision.models.get_model_weights(name).DEFAULT


def fetch_pretrained(name):
    """Download the default weights of `name` into the torch hub cache ($TORCH_HOME/hub/checkpoints), unless they are
    there already. Run by one process per machine while the others wait, so that they do not all download it."""
    weights = pretrained_weights(name)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    try:
        weights.get_state_dict(progress=True, check_hash=True)  # a download is checked against the hash in its name
    except Exception as e:  # no network, a proxy, a truncated file...
        if os.path.exists(path):
            raise UsageError(f"{path} could not be read ({type(e).__name__}): delete it to download it again") from None
        raise UsageError(f"could not download the {weights} weights ({type(e).__name__}): put "
                         f"{os.path.basename(path)} (from {weights.url}) in {os.path.dirname(path)}") from None


def load_pretrained(model, name, channels, classes):
    """torchvision's model `name` with its default weights, read from the cache, and the fresh classifier head of
    `model` (for this data's classes) in place of its own: returns it, and one line saying so. Built by torchvision's
    builder, which also sets what the weights need (vit_h_14's image size, inception's transform_input) and adapts
    older weight files (densenet's key names)."""
    import torchvision
    weights = pretrained_weights(name)
    extra = dict(aux_logits=False) if name in AUX_LOGITS else {}
    pretrained = torchvision.models.get_model(name, weights=weights, progress=False, **extra)
    head = head_names(name, channels, classes)
    for path in sorted({n.rsplit(".", 1)[0] for n in head}):
        pretrained.set_submodule(path, model.get_submodule(path))
    head = ", ".join(sorted(head))
    return pretrained, f"{weights}: every tensor loaded but the new head for {classes} classes ({head})"


@functools.lru_cache
def head_names(name, channels, classes):
    """Names of the classifier head's tensors: those whose shape depends on the number of classes (found by building
    the model for one class more, on the meta device: no memory, no weights initialized, no random numbers drawn)."""
    try:
        with torch.device("meta"):
            a, b = (make_model(name, channels, n).state_dict() for n in (classes, classes + 1))
    except NotImplementedError:  # a builder that computes its layer sizes with tensors (regnet): on the CPU
        with torch.random.fork_rng(devices=[]):
            a, b = (make_model(name, channels, n).state_dict() for n in (classes, classes + 1))
    return frozenset(k for k in a if a[k].shape != b[k].shape)


def load_weights(model, args, channels, classes):
    """--weights: a state_dict or a checkpoint (this collection's, or another tool's: a DDP `module.` or torch.compile
    `_orig_mod.` prefix is ignored), read on this rank. Returns a full state dict for `model`: the file's tensors
    where name and shape match, `model`'s own fresh ones elsewhere (another head size, another channel count).
    Prints one line saying what was left out. No match at all is an error, not a silently fresh model; so is a
    backbone tensor left fresh under --freeze-backbone, which would freeze it at its random start."""
    state, own, names = read_checkpoint(args.weights)[1], model.state_dict(), {}
    for k in state:
        name = k
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        names[name] = k
    hits = {n: state[k] for n, k in names.items()
            if n in own and torch.is_tensor(state[k]) and state[k].shape == own[n].shape}
    if not hits:
        raise UsageError(f"{args.weights} holds no tensor of this --model's names and shapes: is it a "
                         f"{model.__class__.__name__}?")
    fresh, unused = [n for n in own if n not in hits], [n for n in names if n not in own]
    listed = lambda names: ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    if args.freeze_backbone:
        frozen_fresh = [n for n in fresh if n not in head_names(args.model, channels, classes)]
        if frozen_fresh:
            raise UsageError(f"--freeze-backbone would freeze tensors that {args.weights} does not hold: "
                             f"{listed(frozen_fresh)}")
    print(f"{args.weights}: loaded {len(hits)} of the model's {len(own)} tensors"
          + (f"; kept fresh (another shape, or not in the file): {listed(fresh)}" if fresh else "")
          + (f"; ignored from the file (no such name here): {listed(unused)}" if unused else ""))
    return {**{k: v.clone() for k, v in own.items()}, **hits}


def freeze_backbone(model, name, channels, classes):
    """Only the classifier head keeps requires_grad. Called before DDP wraps the model: DDP then leaves the frozen
    parameters out of its gradient buckets, and no find_unused_parameters is needed."""
    head = head_names(name, channels, classes)
    for n, p in model.named_parameters():
        p.requires_grad_(n in head)


def train_mode(model, frozen_backbone):
    """model.train(); but a frozen backbone stays frozen whole: its BatchNorm layers normalize with the pretrained
    running statistics (eval mode) instead of each GPU's batch statistics, which would depend on the per-GPU batch
    size, drift from what the weights were trained with, and change the saved buffers."""
    model.train()
    if frozen_backbone:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()


def clip_grad_norm(optimizer, max_norm):
    """Scales the gradients down so that their global norm, over all ranks and shards, is at most max_norm; returns
    the norm before clipping, on the device (no host sync). After DDP's all-reduce every rank holds the whole
    gradient, so its norm is the global one. Under FSDP each rank holds a shard, a DTensor whose norm comes out as a
    partial sum: full_tensor() adds it up over the ranks (torch's clip_grad_norm_ returns the partial norm there,
    pytorch/pytorch#170862)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def make_optimizer(args, model, steps_per_epoch):
    """The optimizer over the trainable parameters (with --freeze-backbone: the head only), and its schedule: linear
    warmup over --warmup-epochs, then cosine decay to 0, stepped per optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "adamw":
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    else:
        optimizer = torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                    foreach=True)
    warmup, total = round(args.warmup_epochs * steps_per_epoch), args.epochs * steps_per_epoch

    def multiplier(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


# ---- checkpoint files: written atomically, read on the CPU, checked before use
WRITING = set()  # the temporary files being written now


def save_atomic(obj, path):
    """Write to a temporary file in the same folder, fsync, then rename over `path`: a process killed mid-save leaves
    the previous file intact. A SIGTERM or Ctrl-C that comes meanwhile takes effect once the file is in place (it
    would otherwise break into torch.save, whose writer then fails with an error that hides the signal)."""
    tmp, received = f"{path}.tmp{os.getpid()}", []
    WRITING.add(tmp)  # removed by Watch if its time is up mid-write
    handlers = {s: signal.signal(s, lambda signum, _: received.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    except BaseException:  # a full disk: leave no partial file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        WRITING.discard(tmp)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if received:
        signal.raise_signal(received[0])


def fsync_dir(path):
    """Make a rename in this folder durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(path):
    """(the file's contents, its model state_dict): a checkpoint of this collection or another tool's (a
    `state_dict` entry), or a bare state_dict."""
    if not os.path.isfile(path):
        raise UsageError(f"no such checkpoint: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)  # CPU: no memory on GPU 0; weights_only: no code
    except Exception as e:  # empty, truncated, not a torch file; or objects that weights_only refuses to build
        if isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
            raise UsageError(f"{path} holds Python objects, not only tensors (a whole pickled model?): save and give "
                             "model.state_dict() instead") from None
        raise UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): a truncated or empty file? "
                         "Give another one, or delete it to start afresh") from None
    state = ckpt.get("model", ckpt.get("state_dict", ckpt)) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not any(torch.is_tensor(v) for v in state.values()):
        raise UsageError(f"{path} holds no state_dict (no 'model' or 'state_dict' entry of tensors)")
    return ckpt, state


def find_checkpoint(resume, out_dir, model, freeze_backbone, global_batch):
    """The checkpoint --resume names, read and checked against this run (the model's names and shapes exactly, the
    same global batch), or None for a fresh start. A sharded one (a ckpt-<step> folder) is checked from its
    metadata and returned without its tensors, as {..., "sharded": its folder}: every rank then reads its own part
    (load_sharded)."""
    if not resume:
        return None
    path = newest_checkpoint(out_dir) if resume == "auto" else resume
    if path is None:
        return None
    if os.path.isdir(path):
        ckpt, shapes = read_sharded(path)
    else:
        ckpt, state = read_checkpoint(path)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    own = model.state_dict()
    for k in own:
        if k not in shapes or shapes[k] != tuple(own[k].shape):
            raise UsageError(f"{path} does not hold this model: {k} is {shapes.get(k, 'missing')} there, "
                             f"{tuple(own[k].shape)} here (another --model, or other classes or channels?)")
    if set(shapes) != set(own):
        raise UsageError(f"{path} does not hold this model: it has tensors this --model lacks, e.g. "
                         f"{sorted(set(shapes) - set(own))[0]}")
    if "optimizer" not in ckpt and "sharded" not in ckpt:
        raise UsageError(f"{path} holds weights only, not a training state to resume: use --weights {path}")
    a = ckpt.get("args", {})
    if a.get("freeze_backbone", False) != freeze_backbone:  # its optimizer holds other parameters
        raise UsageError(f"{path} was trained {'with' if not freeze_backbone else 'without'} --freeze-backbone: "
                         "resume it the same way")
    saved = ckpt.get("global_batch") or a["batch_size"] * a.get("grad_accum", 1) * ckpt["world_size"]  # format 1
    if saved != global_batch:
        raise UsageError(f"{path} was trained with a global batch of {saved}, this run's is {global_batch}: its "
                         f"schedule and position count batches of {saved}; keep --batch-size x processes x "
                         f"--grad-accum = {saved}")
    return ckpt


def claim_out_dir(out_dir, args):
    """Rank 0, before training: the output folder exists and is writable, holds no last.pt that this run would
    replace unasked, and no other live run writes into it. Returns the folder, open and locked (flock) until this
    process ends: the kernel releases it even after SIGKILL (NFS and Lustre may not honour it)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(out_dir, os.O_RDONLY)
    except OSError as e:  # a file of that name, no permission
        raise UsageError(f"--out-dir {out_dir}: {e.strerror}: give a folder this user can write to") from None
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out-dir {out_dir} is not writable: give a folder this user can write to")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"--out-dir {out_dir} is in use by another run that is still going: wait for it to end, "
                         "or give another --out-dir") from None
    earlier = newest_checkpoint(out_dir)
    if earlier and not (args.resume or args.overwrite):
        raise UsageError(f"{out_dir} holds the {os.path.basename(earlier)} of an earlier run: --resume auto continues "
                         "it, --overwrite starts afresh and replaces it, or give another --out-dir")
    for name in os.listdir(out_dir):  # sharded saves that never completed (their run was killed): no use to anyone
        if re.fullmatch(r"ckpt-\d+\.tmp", name):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return fd


# ---- sharded checkpoints (--ckpt-format dcp): torch.distributed.checkpoint, every rank writing its own part
def sharded_checkpoints(out_dir):
    """The complete ckpt-<step> folders in out_dir, oldest first. Complete: its meta.pt is there, which is written
    only once DCP has finished every rank's part and the .metadata."""
    found = [os.path.join(out_dir, n) for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n)] \
        if os.path.isdir(out_dir) else []
    found = [p for p in found if os.path.isfile(os.path.join(p, "meta.pt"))]
    return sorted(found, key=lambda p: os.stat(os.path.join(p, "meta.pt")).st_mtime_ns)


def newest_checkpoint(out_dir):
    """What --resume auto continues: the newest of out_dir's last.pt and complete ckpt-<step> folders, or None."""
    found = sharded_checkpoints(out_dir)
    last = os.path.join(out_dir, "last.pt")
    if os.path.exists(last):
        found.append(last)
    mtime = lambda p: os.stat(os.path.join(p, "meta.pt") if os.path.isdir(p) else p).st_mtime_ns  # noqa: E731
    return max(found, key=mtime, default=None)


def read_sharded(path):
    """(a ckpt-<step> folder's meta.pt with "sharded": path, {model tensor name: shape} from its .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    if not (os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, "meta.pt"))):
        raise UsageError(f"{path} is not a complete sharded checkpoint (no .metadata or meta.pt): a save that was "
                         "cut short? Give another one")
    meta = torch.load(os.path.join(path, "meta.pt"), map_location="cpu", weights_only=True)
    tensors = FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = {k[len("model."):]: tuple(v.size) for k, v in tensors.items() if k.startswith("model.")}
    return {**meta, "sharded": path}, shapes


def load_sharded(path, model, optimizer):
    """On every rank: model and optimizer from a ckpt-<step> folder, each rank reading just what its own layout holds
    (DDP: everything; FSDP: its shards), whatever the number of processes and the script that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.isdir(path))
    if not all(seen):
        raise UsageError(f"{path} is not there for rank(s) {[r for r, s in enumerate(seen) if not s]}: a sharded "
                         "checkpoint must be on a filesystem that every rank sees")
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's tensors, to be filled in place
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class ShardedCheckpoints:
    """--ckpt-format dcp: each save is a folder ckpt-<step>, written by every rank with torch.distributed.checkpoint
    (DCP), nothing gathered. DCP is not atomic, so it writes ckpt-<step>.tmp, and rank 0 renames it once complete
    (after writing meta.pt: scheduler, position, generators, args). The newest KEEP stay.

    --async-save: DCP copies this rank's state to host memory, returns, and writes in a thread while training goes
    on. Its collectives run on a gloo group of their own: on the default group they would interleave with the
    training's and gloo aborts the process. A new save, and the end of the run, first wait for the previous one."""
    KEEP = 2

    def __init__(self, out_dir, async_save, watch):
        self.out_dir, self.watch, self.pending = out_dir, watch, None
        self.group = dist.new_group(backend="gloo") if async_save else None

    def save(self, step, model_state, optim_state, meta):
        """On every rank. The save of a run told to stop (watch.stopping, the same on every rank) is synchronous."""
        import torch.distributed.checkpoint as dcp
        self.wait()
        tmp, state = os.path.join(self.out_dir, f"ckpt-{step}.tmp"), {"model": model_state, "optimizer": optim_state}
        if self.group is None or self.watch.stopping:
            dcp.save(state, checkpoint_id=tmp)
            self.commit(tmp, meta)
        else:
            self.pending = (dcp.async_save(state, checkpoint_id=tmp, process_group=self.group), tmp, meta)

    def wait(self):
        """The save in the background, if any, finished and committed."""
        if self.pending is not None:
            future, tmp, meta = self.pending
            self.pending = None
            future.result()
            self.commit(tmp, meta)

    def commit(self, tmp, meta):
        """Rank 0, once DCP has returned there: every rank's part and the .metadata are written (DCP's coordinator,
        rank 0, writes .metadata after gathering every rank's results)."""
        if dist.get_rank() != 0:
            return
        save_atomic(meta, os.path.join(tmp, "meta.pt"))
        final = tmp[:-len(".tmp")]
        if os.path.isdir(final):  # the same step saved again (a resumed run): the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.out_dir)
        for old in sharded_checkpoints(self.out_dir)[:-self.KEEP]:
            shutil.rmtree(old, ignore_errors=True)


def sharded_to_file(src, dst):
    """A ckpt-<step> folder as one last.pt (whole tensors, loadable anywhere with weights_only=True), in one
    process without a process group: python -c "import common; common.sharded_to_file('runs/x/ckpt-96', 'last.pt')\""""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    meta, _ = read_sharded(src)
    whole = f"{dst}.tmp{os.getpid()}"
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
            warnings.simplefilter("ignore", UserWarning)
            dcp_to_torch_save(src, whole)
        state = torch.load(whole, map_location="cpu", weights_only=True)
    finally:
        if os.path.exists(whole):
            os.remove(whole)
    meta.pop("sharded")
    save_atomic({"model": state["model"], "optimizer": state["optimizer"], **meta}, dst)


def file_to_sharded(src, dst):
    """A last.pt as a ckpt-<step> folder, in one process:
    python -c "import common; common.file_to_sharded('last.pt', 'runs/x/ckpt-96')\""""
    import torch.distributed.checkpoint as dcp
    ckpt, _ = read_checkpoint(src)
    tmp = f"{dst}.tmp"
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": ckpt.pop("model"), "optimizer": ckpt.pop("optimizer")}, checkpoint_id=tmp, no_dist=True)
    save_atomic(ckpt, os.path.join(tmp, "meta.pt"))
    os.replace(tmp, dst)


# ---- random number generators: a checkpoint keeps each rank's, so that dropout draws on as if never stopped
def rng_state(devices):
    """This process's random number generators: the CPU's, and those of the GPUs among `devices`."""
    return {"cpu": torch.get_rng_state(), "cuda": [torch.cuda.get_rng_state(d) for d in devices if d.type == "cuda"]}


def restore_rng(saved, rank, world_size, seed, devices):
    """This rank's generators as the checkpoint `saved` holds them. At another world size, or from a checkpoint
    without them, each rank's are seeded from (seed, position, rank) instead, and rank 0 says so."""
    states = saved.get("rng") or []
    if len(states) == world_size:
        torch.set_rng_state(states[rank]["cpu"])
        for device, state in zip([d for d in devices if d.type == "cuda"], states[rank]["cuda"]):
            torch.cuda.set_rng_state(state, device)
        return
    position = (saved["epoch"] * 1_000_003 + saved["step_in_epoch"]) * 1_009 + rank
    torch.manual_seed((seed * 1_000_000_007 + position) % 2**63)  # the CPU's and every GPU's
    if rank == 0:
        print(f"random number generators seeded from (--seed, step, rank): the checkpoint holds "
              f"{f'the states of {len(states)} processes, this run has {world_size}' if states else 'none'}, so "
              f"dropout and the like draw other numbers than an uninterrupted run would")


# ---- progress and metrics: the step counters a checkpoint keeps, rank 0's metrics.jsonl and summary lines
NEVER = 2**62  # "no step yet" for the first NaN/inf step


class Progress:
    """Where training stands, as a checkpoint keeps it (epoch, step_in_epoch, the epoch's loss sum so far), and what
    each step adds. The loss sum and the first NaN/inf step stay on the device: no host sync until the script looks."""

    def __init__(self, steps_per_epoch, global_batch, max_steps, device, saved=None):
        saved = saved or {"epoch": 0, "step_in_epoch": 0, "loss_sum": 0.0}
        self.epoch, self.saved_loss_sum = saved["epoch"], saved["loss_sum"]
        self.saved_norms = saved.get("grad_norm_sum", 0.0), saved.get("applied_steps", 0)  # --clip-grad's
        self.step_in_epoch = saved.get("samples_in_epoch", saved["step_in_epoch"] * global_batch) // global_batch
        self.steps_per_epoch, self.global_batch, self.max_steps = steps_per_epoch, global_batch, max_steps
        self.step, self.device = self.epoch * steps_per_epoch + self.step_in_epoch, device
        self.first_bad, self.first_step_time = torch.full((), NEVER, device=device), None
        self.start_epoch(self.epoch)

    def start_epoch(self, epoch):
        """A resumed epoch keeps its steps and the loss sum of its saved part (the same on every rank, so the mean
        over the ranks stays right); another starts from 0."""
        if epoch != self.epoch:
            self.epoch, self.step_in_epoch = epoch, 0
        carried = self.saved_loss_sum if self.step_in_epoch else 0.0
        self.loss_sum = torch.full((), carried, dtype=torch.float64, device=self.device)
        norm_sum, applied = self.saved_norms if self.step_in_epoch else (0.0, 0)
        self.norm_sum = torch.full((), norm_sum, dtype=torch.float64, device=self.device)
        self.applied, self.clipping = torch.full((), applied, device=self.device), False
        self.t0 = self.train_time = None
        self.data_wait = 0.0

    def timed(self, loader):
        """The loader's batches, adding the time spent waiting for each to data_wait: a host-side clock, no sync (on
        a GPU the host runs ahead, so it waits here only when the data, not the GPU, is what is slow)."""
        batches = iter(loader)
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            self.data_wait += time.perf_counter() - t
            if batch is None:
                return
            yield batch

    def step_done(self, loss, grad_norm=None):
        """One optimizer step done, with this loss and, under --clip-grad, this norm before clipping (0-dim, on the
        device). A non-finite norm is an fp16 step that the scaler skipped: counted, not averaged."""
        self.first_bad = torch.where(~torch.isfinite(loss) & (self.first_bad == NEVER), self.step, self.first_bad)
        self.loss_sum += loss
        if grad_norm is not None:
            applied = torch.isfinite(grad_norm)
            self.norm_sum += torch.where(applied, grad_norm.double(), 0.0)
            self.applied += applied
            self.clipping = True
        self.last_loss, self.step, self.step_in_epoch = loss, self.step + 1, self.step_in_epoch + 1
        if self.t0 is None:  # time the steady state: from the end of the epoch's first step on
            self.t0, self.t0_step = synced_time(self.device), self.step
            self.first_step_time = self.first_step_time or self.t0

    @property
    def epoch_done(self):
        return self.step_in_epoch == self.steps_per_epoch or self.step >= (self.max_steps or math.inf)

    def due(self, every):
        return every is not None and self.step % every == 0

    def waiting(self):
        """{"data_wait": its share of the epoch's time so far}, for the progress line when it exceeds 5%."""
        share = self.data_wait / max(time.time() - self.t0, 1e-9) if self.t0 else 0.0
        return {"data_wait": f"{share:.0%}"} if share > 0.05 else {}

    def grad_norms(self):
        """{"grad_norm": mean norm before clipping over the applied steps (None if none), "skipped_steps"} under
        --clip-grad, else {}: one host sync, at the epoch's end."""
        if not self.clipping:
            return {}
        norm_sum, applied = self.norm_sum.item(), int(self.applied.item())
        return {"grad_norm": norm_sum / applied if applied else None, "skipped_steps": self.step_in_epoch - applied}

    def end_epoch(self):
        self.train_time = synced_time(self.device) - self.t0 if self.t0 else 0.0

    def samples_per_s(self):
        elapsed = self.train_time if self.train_time is not None else time.time() - self.t0
        return (self.step - self.t0_step) * self.global_batch / max(elapsed, 1e-9) if self.t0 else 0.0

    def state(self, loss_sum):
        """What a checkpoint keeps; `loss_sum`: the epoch's loss sum so far, averaged over the ranks. The position
        in the epoch is in samples; format 1 (without `format`) had steps only."""
        epoch, steps = (self.epoch + 1, 0) if self.step_in_epoch == self.steps_per_epoch else (self.epoch,
                                                                                              self.step_in_epoch)
        return {"format": 2, "epoch": epoch, "step_in_epoch": steps, "samples_in_epoch": steps * self.global_batch,
                "loss_sum": loss_sum if steps else 0.0, "global_batch": self.global_batch,
                "grad_norm_sum": self.norm_sum.item() if steps else 0.0,
                "applied_steps": int(self.applied.item()) if steps else 0}


def synced_time(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the GPU's queued work is part of the time
    return time.time()


def start_output(out_dir, progress, tensorboard):
    """Rank 0: metrics.jsonl keeps the rows of the epochs the checkpoint covers (none on a fresh start); returns a
    TensorBoard writer or None."""
    os.makedirs(out_dir, exist_ok=True)
    path, rows = os.path.join(out_dir, "metrics.jsonl"), []
    if os.path.exists(path):
        rows = [r for r in map(json.loads, open(path).read().splitlines()) if r["epoch"] <= progress.epoch]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter(out_dir)


def log_epoch(out_dir, writer, progress, row):
    """Rank 0: the epoch's JSON line in metrics.jsonl (its number fractional if --max-steps ended it early), the
    TensorBoard scalars, and the summary line."""
    finished = progress.step_in_epoch == progress.steps_per_epoch
    row = {"epoch": progress.epoch + (1 if finished else progress.step_in_epoch / progress.steps_per_epoch),
           "step": progress.step, **row, "samples_per_s": progress.samples_per_s(),
           "epoch_time_s": progress.train_time, "data_wait_s": progress.data_wait,
           "first_step_time": progress.first_step_time, **progress.grad_norms()}
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if writer:
        for k in ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s"):
            writer.add_scalar(k, row[k], progress.step)
        writer.flush()  # each epoch visible now, and nothing lost at exit
    where = "" if finished else f" (stopped at step {progress.step_in_epoch} of {progress.steps_per_epoch})"
    print(f"epoch {progress.epoch + 1}{where}  train_loss {row['train_loss']:.4f}  val_loss {row['val_loss']:.4f}  "
          f"val_acc {row['val_acc']:.4f}  lr {row['lr']:.2e}  {row['samples_per_s']:.0f} samples/s  "
          f"{progress.train_time:.1f}s", flush=True)


def progress_bar(progress, master):
    """Rank 0's progress: a tqdm bar on a terminal; in a log file (a SLURM job, a redirect) a plain line at each
    quarter of the epoch instead of the bar's refreshes, so that every line of the log is whole."""
    if master and sys.stdout.isatty():
        return tqdm(total=progress.steps_per_epoch, initial=progress.step_in_epoch, desc=f"epoch {progress.epoch + 1}",
                    leave=False, file=sys.stdout)
    return PlainBar(progress, master)


class PlainBar:
    def __init__(self, progress, master):
        self.progress, self.master = progress, master
        self.shown = progress.step_in_epoch * 4 // progress.steps_per_epoch

    def update(self):
        pass

    def set_postfix(self, **values):
        quarter = self.progress.step_in_epoch * 4 // self.progress.steps_per_epoch
        if self.master and quarter > self.shown and quarter < 4:
            self.shown = quarter
            print(f"epoch {self.progress.epoch + 1}: step {self.progress.step_in_epoch} of "
                  f"{self.progress.steps_per_epoch}  " + "  ".join(f"{k} {v}" for k, v in values.items()), flush=True)

    def close(self):
        pass


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ---- signals and hangs: a run stopped at a step every rank agrees on, and a rank that stops answering named
class Watch:
    """What keeps a run from ending without a checkpoint, or hanging without a word.

    SIGUSR1 (a scheduler's notice before the time limit: `sbatch --signal`) and SIGTERM (preemption; a launcher
    stopping its workers) only note themselves here. `step_done()`, called once a step, returns the signal once
    every rank knows it, at the same step on every rank: the loop saves there and stops. After a SIGTERM the process
    has SAVE_BUDGET_S to save and leave: past it, it leaves without the checkpoint (the previous last.pt stays
    intact), before the launcher's SIGKILL (torchrun waits 30 s, SLURM's KillWait is 30 s by default). A second
    SIGTERM, like Ctrl-C, ends the process at once. SIGUSR2 prints the Python stack of every thread.

    Hangs: the process group starts with a generous timeout (start-up: data, downloads, the first step); after the
    first step every collective gets `step_timeout` seconds. A thread writes this rank's step into the process
    group's store every second, so that when a collective times out, `hangs_named` turns torch's error (gloo's
    names neither the collective nor the rank) into one line: where this rank waited, and the ranks behind it."""
    SAVE_BUDGET_S = 20
    live = None  # this process's: the one hangs_named asks

    def __init__(self, group, rank, step_timeout):
        self.group, self.rank, self.step_timeout = group, rank, step_timeout
        Watch.live = self
        self.received, self.posted, self.step, self.stopping = 0, None, None, 0
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, self.note)
        faulthandler.register(signal.SIGUSR2, all_threads=True)  # `kill -USR2 <pid>`: where is it now?
        if group is not None:
            # the store every rank met on (torchrun's, or rank 0's TCPStore): private API, as public torch has none
            self.store = dist.PrefixStore("heartbeat/", dist.distributed_c10d._get_default_store())
            self.stop = threading.Event()
            self.beat = threading.Thread(target=self.heartbeat, daemon=True)
            self.beat.start()

    def note(self, signum, _):
        if signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one: at once, even inside a collective
            threading.Thread(target=self.give_up, daemon=True).start()
        self.received = max(self.received, signum)

    def give_up(self):
        time.sleep(self.SAVE_BUDGET_S)
        if self.rank == 0:
            print(f"SIGTERM: not saved and stopped within {self.SAVE_BUDGET_S:g} s: leaving without a new checkpoint "
                  "(last.pt is the previous one)", file=sys.stderr, flush=True)
        for tmp in list(WRITING):
            with contextlib.suppress(OSError):
                os.remove(tmp)
        os._exit(128 + signal.SIGTERM)

    def heartbeat(self):
        while True:
            try:
                self.store.set(str(self.rank), str(self.step))
            except Exception:  # noqa: BLE001 the store is gone (and the timeout's message will say so): stop, rather
                return  # than add torch's warning, a C++ stack, to the log every second
            if self.stop.wait(1):
                return

    def close(self):
        """Before the process group goes (hangs_named calls it): no thread of torch's or ours may be left holding a
        tensor or the store while Python shuts down. A thread that touches Python then, such as gloo's worker freeing
        the flag of the last step's all-reduce, aborts the process ("terminate called without an active exception",
        exit code -6, after a finished run). So: the last flag's all-reduce finished (every rank posted it; at most
        5 s where a peer is gone), and the heartbeat stopped."""
        if self.posted is not None:
            with contextlib.suppress(Exception):  # timed out, or a peer gone: the run is ending with an error anyway
                self.posted[1].wait(datetime.timedelta(seconds=5))
            self.posted = None
        if self.group is not None:
            self.stop.set()
            self.beat.join(timeout=5)

    def step_done(self, step):
        """Once a step, on every rank: returns the signal that any rank has received (0: none), agreed through a
        one-number all-reduce on a gloo group of its own, posted at this step and read at the next, so that no
        step waits for it and no GPU stream is touched. One process (no group) answers at once."""
        if self.step is None and self.group is not None:  # the first step is done: from now on, the step timeout
            # public as torch.distributed.set_timeout in newer torch (2.14 and 2.15 have it); 2.11 has only the
            # private one. It applies to collectives started from now on, for gloo and NCCL alike
            set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
            for group in (None, self.group):
                set_timeout(datetime.timedelta(seconds=self.step_timeout), group)
        self.step = step
        if self.group is None:
            if self.received:
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a late second one must not kill it as it shuts down
            self.stopping = self.received
            return self.stopping
        flag = torch.tensor(self.received)
        posted, self.posted = self.posted, (flag, dist.all_reduce(flag, dist.ReduceOp.MAX, self.group, async_op=True))
        if posted is None:
            return 0
        posted[1].wait()
        if posted[0]:  # agreed: the run saves and stops. A SIGUSR1 arriving late (e.g. sent to both srun and its
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # tasks) must not kill it as Python shuts down
        self.stopping = int(posted[0])
        return self.stopping

    def hung(self, error):
        """A Hung for torch's error of a collective that timed out: where this rank waited and who was behind."""
        ours = [f for f in traceback.extract_tb(error.__traceback__)
                if os.path.dirname(os.path.abspath(f.filename)) == HERE]
        where = f"{ours[-1].name} ({os.path.basename(ours[-1].filename)}:{ours[-1].lineno})" if ours else "?"
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
            steps = {r: self.store.get(str(r)).decode() for r in range(dist.get_world_size())}
        except Exception:  # noqa: BLE001 (whatever the store raises: it is gone with the rank that held it)
            return Hung(f"a collective timed out after {self.step_timeout:g} s in {where} at step {self.step}, and "
                        "the store does not answer: rank 0, which holds it, is gone", print_it=True)
        behind = {r: s for r, s in steps.items() if s == "None" or int(s) < (self.step or 0)}
        who = (", ".join(f"rank {r} (at step {s})" for r, s in behind.items()) + " never arrived" if behind else
               "no rank was behind in steps: one is stuck within this step")
        return Hung(f"a collective timed out after {self.step_timeout:g} s in {where} at step {self.step}: {who}",
                    print_it=self.rank == min(set(steps) - set(behind), default=0))


def nccl_flight_recorder():
    """NCCL's flight recorder on: it keeps each rank's last 2,000 collectives, and a timeout makes every rank dump
    them to /tmp/nccl_trace_rank_<rank> on its node, where `python -m torch.distributed.flight_recorder.fr_trace
    /tmp --prefix nccl_trace_rank_` names the collective and the ranks that never joined it. Set before the process
    group is made; a variable already set wins."""
    for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_FR_DUMP_TEMP_FILE", "/tmp/nccl_trace_rank_")):
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def hangs_named():
    """Around a script's main(): a collective that timed out after the first step, which torch reports as a
    RuntimeError naming neither the collective nor the rank, is raised as a Hung that names them (see Watch)."""
    try:
        yield
    except RuntimeError as e:
        watch = Watch.live
        if watch is not None and watch.received == signal.SIGTERM:  # told to stop, and a peer has left already
            raise SystemExit(128 + signal.SIGTERM) from None
        # gloo says "timed out" where this rank's own wait ran out, and "Application timeout caused pair closure"
        # where it waited in an asynchronous one (DDP's gradient all-reduce in the backward pass)
        if watch is None or watch.group is None or not any(w in str(e).lower() for w in ("timed out", "timeout")):
            raise
        raise watch.hung(e) from None
    finally:
        if Watch.live is not None:
            Watch.live.close()


def prints(e, rank):
    """Whether this rank prints the error that ends the run: rank 0, as every rank raises it alike; only the
    rank that knows it, for a BadFile (one rank read the file) or a Hung."""
    return e.print_it if isinstance(e, Hung) else rank == 0 or isinstance(e, BadFile)


# ---- processes: one of them does a thing while the others wait; torchrun's store across restarts
def on_rank0(fn, rank):
    """fn() where `rank` is 0, while the other processes wait: give the global rank for once in all (rank 0 decides
    and reads; nodes need not share a filesystem), the local rank for once per machine. A UsageError of any of them
    is raised on every rank, so that no rank is left waiting in a collective for one that failed."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except UsageError as e:
            error = str(e)
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise UsageError(error)
    return result


def torchrun_store(rank, world_size, timeout):
    """The store of torchrun's agent (at MASTER_ADDR:MASTER_PORT), under a prefix that only this attempt uses.

    The agent's store outlives worker restarts, keys of earlier attempts included: meeting there without a prefix
    (the default env:// setup) often fails or hangs after a restart. TORCHELASTIC_RESTART_COUNT cannot be the
    prefix: each node's agent counts its own restarts, and after a restart across nodes the counts differ. So rank 0
    draws a random prefix and hands it to each rank in answer to a random token of that rank: no key left by an
    earlier attempt can answer it. Upstream: pytorch/pytorch#135712 (the shared store and restarts), #108158 (restart
    counts differ per node); remove this when init_process_group alone survives tests/test_cluster.py's restarts."""
    import time

    if os.environ["MASTER_PORT"] == "0":
        raise UsageError("torchrun --master_port=0 tells the workers port 0: give a free port, or use --standalone")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    hello = dist.PrefixStore("hello", store)
    if rank == 0:
        prefix, last_token, joined = os.urandom(16).hex(), {}, set()
        deadline = time.monotonic() + timeout.total_seconds()
        while len(joined) < world_size - 1:  # answer each rank's latest token until it confirms the prefix
            for r in set(range(1, world_size)) - joined:
                if hello.check([f"{prefix}/{r}"]):
                    joined.add(r)
                elif hello.check([f"token{r}"]) and (token := hello.get(f"token{r}")) != last_token.get(r):
                    hello.set(f"answer/{token.decode()}", prefix)
                    last_token[r] = token
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(1, world_size)) - joined)} did not join in {timeout}")
            time.sleep(0.01)
    else:
        token = os.urandom(16).hex()
        hello.set(f"token{rank}", token)
        prefix = hello.get(f"answer/{token}").decode()  # waits for rank 0's answer (up to the timeout)
        hello.set(f"{prefix}/{rank}", "")
    return dist.PrefixStore(prefix, store)
