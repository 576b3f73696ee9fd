"""--dataset synthetic (the default: offline, in memory), mnist, cifar10 and imagefolder: what
common.load_data returns. Random augmentation is drawn from (seed, epoch, index) alone, never from a
worker's generator: results do not depend on --workers. The scripts call a dataset's
set_epoch(epoch) before each epoch's DataLoader."""
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import common
import failsafe

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STATS = {"mnist": ([0.1307], [0.3081]),
         "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616])}


def add_flags(parser):
    a = parser.add_argument
    a("--dataset", default="synthetic", choices=["synthetic", "mnist", "cifar10", "imagefolder"],
      help="synthetic (offline, in memory), mnist, cifar10, imagefolder")
    a("--data-dir", default="./data", help="mnist/cifar10: downloaded here; imagefolder: the "
      "folder of train/, val/")
    a("--train-size", type=common.number(int, 1), help="training samples (synthetic: default "
      "10000; real data: a random subset)")
    a("--val-size", type=common.number(int, 1), help="validation samples (synthetic: default "
      "2000; real data: a random subset)")
    a("--image-size", type=common.number(int, 7), help="imagefolder: resize to this square "
      "(default 224)")
    a("--synthetic-shape", default="1x28x28", help="synthetic: CxHxW, e.g. 3x224x224 (H, W at "
      "least 7)")


class UnreadableFile(failsafe.UsageError):
    """A file that cannot train, found where it is read (a DataLoader worker, or this process):
    only that rank knows, so that rank says it. From a worker it comes back with the worker's
    traceback as its message: the last line is the one."""

    def __init__(self, message):
        super().__init__(message, printer=None)

    def __str__(self):
        return super().__str__().strip().splitlines()[-1].split("UnreadableFile: ", 1)[-1]


def load(args, download=False):
    """(train_set, val_set) for --dataset. download=True: the one process that may fetch files
    (rank 0, before the others). With --pretrained: the weights' normalization, and grayscale
    repeated to the 3 channels they expect."""
    if args.dataset == "synthetic":
        return synthetic_sets(args)
    weights = None
    if getattr(args, "pretrained", False):  # (then finetune.py is there: the flag is its)
        common.optional("models", "--pretrained")  # the weights are --model's, a flag of models.py
        weights = common.optional("finetune", "--pretrained").pretrained_weights(args.model)
    if args.dataset == "imagefolder":
        return image_folder(args, weights, download)
    return tuple(in_memory(args, train, weights, download) for train in (True, False))


def synthetic(n, seed, shape):
    """Learnable, not trivially: 10 smooth class templates (the same for seed and seed + 10**6)
    under random shifts, contrast and noise."""
    c, h, w = shape
    templates = F.interpolate(torch.randn(10, c, 7, 7,
                                          generator=torch.Generator().manual_seed(seed % 10**6)),
                              size=(h, w), mode="bilinear", align_corners=False)
    g, pad = torch.Generator().manual_seed(seed), min(h, w) // 7
    y, shifts = torch.randint(0, 10, (n,), generator=g), \
        torch.randint(0, 2**31 - 1, (n,), generator=g)
    dy, dx, padded = (shifts >> 1) % (2 * pad + 1), (shifts >> 9) % (2 * pad + 1), \
        F.pad(templates[y], (pad,) * 4)
    x = torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])
    return (x * (0.5 + torch.rand(n, 1, 1, 1, generator=g))
            + 1.2 * torch.randn(n, c, h, w, generator=g), y)


def synthetic_sets(args):
    """--train-size and --val-size samples of --synthetic-shape (RGB with --pretrained: ImageNet
    weights want it), normalized with the training set's mean and std; 10 classes, however few
    samples are drawn."""
    try:
        shape = tuple(map(int, args.synthetic_shape.lower().split("x")))
        c, h, w = (3, *shape[1:]) if getattr(args, "pretrained", False) else shape
    except ValueError:
        c = h = w = 0
    if min(c, h - 6, w - 6) < 1:
        raise failsafe.UsageError(f"--synthetic-shape {args.synthetic_shape}: "
                                  "give CxHxW with C >= 1 and H, W >= 7")
    (xt, yt), (xv, yv) = (synthetic(n, args.seed + k, (c, h, w)) for n, k in
                          ((args.train_size or 10000, 0), (args.val_size or 2000, 10**6)))
    mean, std = xt.mean(), xt.std()
    return InMemory((xt - mean) / std, yt, 10), InMemory((xv - mean) / std, yv, 10)


def random_subset(n_all, n, seed, flag):
    """Indices of n of n_all samples (all without n), drawn with `seed`: the same on every rank and
    every run. More than there are: one line, not n_all without a word."""
    if n is not None and n > n_all:
        raise failsafe.UsageError(f"{flag} {n}: the data has {n_all} samples")
    if n is None or n == n_all:
        return list(range(n_all))
    return torch.randperm(n_all, generator=torch.Generator().manual_seed(seed))[:n] \
        .sort().values.tolist()


# ---- synthetic data, MNIST and CIFAR-10: in memory, normalized once
class InMemory(TensorDataset):
    """Normalized images and labels in memory. ds[list of indices] is a whole batch (`batch_loader`:
    one tensor index, no per-sample Python); `augment`: a random crop and flip per sample, drawn
    from (seed, epoch, index), done on the batch where the tensors are (on the GPU, if
    `batch_loader` moved them there)."""

    def __init__(self, x, y, classes, augment=False, seed=0):
        super().__init__(x, y)
        self.classes, self.augment, self.seed, self.epoch = classes, augment, seed, 0

    def batch_loader(self, batches, run):
        """Returns common.make_loader's DataLoader: one index a batch, on the accelerator if the
        tensors fit. Its own generator: not the one dropout draws from."""
        if run.device.type != "cpu" and sum(t.nbytes for t in self.tensors) < 2**32:  # once
            self.tensors = tuple(t.to(run.device) for t in self.tensors)
        # the epoch's indices there at once (a list would wait for the device at every step)
        index = torch.tensor([i for b in batches for i in b], dtype=torch.long,
                             device=self.tensors[0].device)
        return DataLoader(self, sampler=index.split([len(b) for b in batches]), batch_size=None,
                          generator=torch.Generator())

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __getitem__(self, idx):
        x, y = super().__getitem__(idx)
        if not self.augment:
            return x, y
        idx = torch.as_tensor(idx, device=x.device)
        batch = x if x.ndim == 4 else x[None]  # one sample: a batch of one
        batch = crop_flip(batch, per_sample_random(self.seed, self.epoch, idx.reshape(-1)),
                          pad=x.shape[-1] // 8)
        return batch if x.ndim == 4 else batch[0], y


def in_memory(args, train, weights, download):
    """MNIST's or CIFAR-10's training or test set via torchvision (fetched into --data-dir where
    `download`), as an InMemory; CIFAR-10's training set augmented."""
    from torchvision import datasets
    d = args.dataset
    try:
        ds = (datasets.MNIST if d == "mnist" else datasets.CIFAR10)(
            args.data_dir, train=train, download=download)
    except Exception as e:  # no network, or no files and download=False
        where = os.path.join(args.data_dir,
                             *(("MNIST", "raw") if d == "mnist" else ("cifar-10-batches-py",)))
        raise failsafe.UsageError(f"{d} is not in {args.data_dir} and could not be downloaded "
                                  f"({type(e).__name__}): put its files in {where}, or use "
                                  "--dataset synthetic, which needs no download") from None
    flag, n = ("--train-size", args.train_size) if train else ("--val-size", args.val_size)
    keep = random_subset(len(ds.targets), n, args.seed, flag)
    x = torch.as_tensor(ds.data[keep]).float().div(255)  # the subset first: less to convert
    x = x[:, None] if x.ndim == 3 else x.permute(0, 3, 1, 2)  # MNIST: N,H,W; CIFAR-10: N,H,W,C
    mean, std = STATS[d]
    if weights:  # the weights' statistics (at this data's own resolution: docs/usage.md), and RGB
        mean, std = weights.transforms().mean, weights.transforms().std
        x = x.expand(-1, 3, -1, -1)
    x = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return InMemory(x.contiguous(), torch.as_tensor(ds.targets)[keep], ds.classes,
                    train and d == "cifar10", args.seed)


def per_sample_random(seed, epoch, idx):
    """A pseudo-random 31-bit integer per sample (a tensor of indices), a function of
    (seed, epoch, index) alone."""
    h = (idx.long() + ((seed * 1_000_003 + epoch * 7_919) % 2**31) * 40_503) & 0x7FFFFFFF
    for _ in range(3):
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
    return h


def crop_flip(x, r, pad):
    """A random crop after zero padding and a random horizontal flip of each image of a batch
    (B, C, H, W), as the bits of r (from per_sample_random) say: one gather for the whole batch."""
    B, C, H, W = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy, dx = (r >> 1) % (2 * pad + 1), (r >> 9) % (2 * pad + 1)
    rows = dy[:, None] + torch.arange(H, device=x.device)
    cols = dx[:, None] + torch.arange(W, device=x.device)
    cols = torch.where((r & 1).bool()[:, None], cols.flip(1), cols)
    out = padded[torch.arange(B, device=x.device)[:, None, None], :, rows[:, :, None],
                 cols[:, None, :]]  # B,H,W,C
    return out.permute(0, 3, 1, 2).contiguous()


# ---- an ImageFolder: files decoded in DataLoader workers
class ImageFiles(Dataset):
    """The images of root/<class>/<image>, resized to `size` (with random crop and flip where
    `augment`), or with `weights` (--pretrained) preprocessed as theirs. Decoded by torchvision.io
    and transformed while still uint8 (4x fewer bytes to carry to the main process and the GPU),
    made float by `normalize_uint8` on the device."""

    def __init__(self, root, size, augment, seed, weights=None):
        # its list of files and classes (read by pil_rgb or torchvision.io)
        folder = visible_folder(root)
        self.samples, self.classes = folder.samples, folder.classes
        self.seed, self.epoch = seed, 0
        self.transform, self.mean, self.std, self.as_pil = transforms(size, augment, weights)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.samples)

    def read(self, path):
        """The file as RGB: grayscale, palette, alpha and CMYK images made RGB, 16-bit ones scaled
        to 8 bits."""
        if self.as_pil:
            return pil_rgb(path)
        # torchvision 0.29 deprecates its decoders for TorchCodec; if gone, PIL reads every file
        try:
            from torchvision.io import ImageReadMode, decode_image
            image = decode_image(path, mode=ImageReadMode.RGB)
        except (ImportError, RuntimeError):  # or a format it can't read (TIFF...), or a broken file
            from torchvision.transforms.functional import pil_to_tensor
            return pil_to_tensor(pil_rgb(path))
        # a 16-bit PNG decodes to uint16: 0..65535 scaled to 0..255 (rounded), whatever its batch
        return ((image.to(torch.int32) + 128) // 257).to(torch.uint8) \
            if image.dtype == torch.uint16 else image

    def __getitem__(self, i):
        path, label = self.samples[i]
        try:
            image = self.read(path)
        except (OSError, ValueError) as e:
            # truncated, empty, not an image: name the file, among 100,000 others
            why = " ".join(str(e).split())  # one line: a DataError keeps only the last
            raise UnreadableFile(f"{path} is not a readable image ({type(e).__name__}: {why}): "
                                 "remove or replace it") from None
        # torchvision's random transforms use torch's CPU generator: seeded here, and left as it was
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(
                int(per_sample_random(self.seed, self.epoch, torch.tensor(i))))
            return self.transform(image), label

    def normalize_uint8(self, x):
        """A uint8 batch of these images, on its device, made float and normalized (the scale to
        [0, 1] folded into the mean and std: Python scalars, nothing copied to the GPU). Validation
        with --pretrained is float already."""
        if x.dtype != torch.uint8:
            return x
        x = x.float()
        for c, (m, s) in enumerate(zip(self.mean, self.std)):
            x[:, c].sub_(255 * m).div_(255 * s)
        return x


def visible_folder(root):
    """torchvision's ImageFolder of root/<class>/<image> without what `ls` hides (names that start
    with "."): a Mac's copy holds a ._<name> AppleDouble file beside each image, which no decoder
    reads, and a .ipynb_checkpoints folder is no class."""
    from torchvision import datasets
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    class Visible(datasets.ImageFolder):
        def find_classes(self, directory):
            classes = sorted(e.name for e in os.scandir(directory)
                             if e.is_dir() and not e.name.startswith("."))
            if not classes:
                raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
            return classes, {c: i for i, c in enumerate(classes)}

    def shown(path):  # below root: the folders above it may be hidden (~/.cache/...)
        parts = os.path.relpath(path, os.path.expanduser(root)).split(os.sep)
        return not any(p.startswith(".") for p in parts) and \
            has_file_allowed_extension(path, IMG_EXTENSIONS)
    return Visible(root, is_valid_file=shown)


def pil_rgb(path):
    """PIL's RGB image of the file. 16- and 32-bit grayscale (TIFF, and PNG where torchvision.io
    cannot read it): scaled to 8 bits first, where PIL's convert("RGB") would clip all but the
    darkest pixels to white."""
    from PIL import Image
    with Image.open(path) as image:
        if image.mode.startswith("I"):
            image = image.convert("I").point(lambda v: v / 257).convert("L")
        return image.convert("RGB")


def transforms(size, augment, weights):
    """(transform, mean, std, as_pil) of ImageFiles. With `weights`: validation exactly theirs (on
    the PIL image: a tensor's resize differs a bit), training with the augmentation of torchvision's
    recipes; `size` the crop, their resize scaled with it."""
    from torchvision.transforms import v2
    if weights is None:
        size = size or 224
        flips = [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip()] \
            if augment else []
        return (v2.Compose([v2.ToImage(), v2.Resize((size, size))] + flips), IMAGENET_MEAN,
                IMAGENET_STD, False)
    preset = weights.transforms()  # resize, center crop, mean/std: how the weights were evaluated
    if size:
        resize = round(size * preset.resize_size[0] / preset.crop_size[0])
        preset = weights.transforms(crop_size=size, resize_size=resize)
    if not augment:
        return preset, preset.mean, preset.std, True
    steps = [v2.RandomResizedCrop(preset.crop_size, interpolation=preset.interpolation),
             v2.RandomHorizontalFlip()]
    return v2.Compose([v2.ToImage()] + steps), preset.mean, preset.std, False


def image_folder(args, weights, download):
    """ImageFiles of --data-dir's train/ and val/, random subsets of --train-size/--val-size."""
    sets = []
    for split, n in (("train", args.train_size), ("val", args.val_size)):
        root = os.path.join(args.data_dir, split)
        try:
            ds = ImageFiles(root, args.image_size, split == "train", args.seed, weights)
        except OSError as e:  # no such folder, no class folders, a class without images
            raise failsafe.UsageError(
                f"--dataset imagefolder needs {root}/<class>/<image> files: {e}") from None
        keep = random_subset(len(ds.samples), n, args.seed, f"--{split}-size")
        ds.samples = [ds.samples[i] for i in keep]
        sets.append(ds)
    # label 3 would mean one class in training and another in validation
    if sets[0].classes != sets[1].classes:
        raise failsafe.UsageError(f"train/ and val/ in {args.data_dir} hold different classes: "
                                  f"{sets[0].classes} vs {sets[1].classes}")
    if download and args.image_size is None and not weights:  # said once, by rank 0 (download=True)
        print("imagefolder: images resized to 224x224; small images train much faster at about "
              "their own size: --image-size", flush=True)
    return tuple(sets)
