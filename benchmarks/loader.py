"""How fast the scripts' ImageFolder training pipeline feeds a GPU: images/s per DataLoader worker process (one
worker = one core), against a plain torchvision.datasets.ImageFolder with the v1 transforms of the ImageNet recipe.

    python benchmarks/loader.py                          # 1 worker, 5 interleaved repeats, generated JPEGs
    python benchmarks/loader.py --workers 2 --json loader.json
    python benchmarks/loader.py --images 16 --repeats 1  # a smoke test: checks that it runs, times nothing

It writes --images JPEGs of ImageNet-like size (500x375, quality 90; smooth colour fields with noise, ~60 KB each) in
a temporary folder, then times a whole pass over them, batch 64, shuffled, for each pipeline:
  baseline      torchvision.datasets.ImageFolder: PIL decode, RandomResizedCrop(224), RandomHorizontalFlip,
                ToTensor, Normalize (torchvision.transforms, v1)
  scripts       train_extras.datasets.ImageFiles, as the scripts train on an ImageFolder:
                torchvision.io.decode_image, then
                transforms.v2 on the uint8 tensor (resize to 224x224, random crop with padding, flip); each
                sample's randomness seeded from (seed, epoch, index). Batches leave the worker as uint8 and are
                made float and normalized in this process (ImageFiles.normalize_uint8), as the scripts do on their
                device
  pretrained    train_extras.datasets.ImageFiles with --pretrained's training transform (RandomResizedCrop(224)
                and flip, v2 on
                the uint8 tensor): the same work as the baseline, done the scripts' way
Each pass runs twice in a row and the second is timed (the first starts the workers and fills the page cache).
The rows are interleaved, repeat by repeat; the table shows medians and, for each pipeline, the median of its
per-repeat ratios to the baseline, with their range.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader, RandomSampler  # noqa: E402


def write_jpegs(root, n, size=(500, 375)):
    """n JPEGs in 2 classes: smooth random colour fields (upsampled 8x6 noise) plus pixel noise, quality 90."""
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        field = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 8, generator=g) * 255, size=size[::-1],
                                                mode="bicubic", align_corners=False)
        pixels = (field[0] + 12 * torch.randn(3, size[1], size[0], generator=g)).clamp(0, 255).byte()
        folder = os.path.join(root, "train", f"class{i % 2}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def loaders(root, workers, batch):
    from torchvision import datasets, models, transforms as T

    from train_extras.datasets import IMAGENET_MEAN, IMAGENET_STD, ImageFiles
    baseline = datasets.ImageFolder(root, transform=T.Compose([
        T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]))
    scripts = ImageFiles(root, 224, augment=True, seed=0)
    weights = models.get_model_weights("resnet50").DEFAULT  # its transforms only: nothing is downloaded
    pretrained = ImageFiles(root, None, augment=True, seed=0, weights=weights)

    def as_the_scripts_load(ds):
        """common.make_loader's DataLoader for files (shuffled batches of indices, --workers processes), but with
        persistent workers, as the baseline's: the timed pass is the steady state, not the workers' start. (The
        scripts start theirs once an epoch.) Batches come as uint8 and are normalized by `normalize_uint8` in this
        process, as the scripts do on their device."""
        loader = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), batch, drop_last=False),
                            num_workers=workers, persistent_workers=workers > 0, generator=torch.Generator())
        loader.normalize_uint8 = ds.normalize_uint8
        return loader
    return {"baseline": DataLoader(baseline, batch_size=batch, shuffle=True, num_workers=workers,
                                   persistent_workers=workers > 0),
            "scripts": as_the_scripts_load(scripts), "pretrained": as_the_scripts_load(pretrained)}


def images_per_s(loader):
    for _ in loader:  # the first pass: workers start, files come into the page cache
        pass
    t, n = time.perf_counter(), 0
    for x, _ in loader:
        x = getattr(loader, "normalize_uint8", torch.nn.Identity())(x)  # the scripts' loaders: uint8 to float
        n += len(x)
    assert x.dtype == torch.float32 and x.shape[1:] == (3, 224, 224), x.shape
    return n / (time.perf_counter() - t)


def main(a):
    with tempfile.TemporaryDirectory() as tmp:
        write_jpegs(tmp, a.images)
        files = [e for d in os.scandir(os.path.join(tmp, "train")) for e in os.scandir(d)]
        kb = sum(e.stat().st_size for e in files) / a.images / 1024
        runs = {}
        for r in range(a.repeats):
            for name, loader in loaders(os.path.join(tmp, "train"), a.workers, a.batch_size).items():
                runs.setdefault(name, []).append(images_per_s(loader))
                print(f"repeat {r + 1}/{a.repeats}  {name}: {runs[name][-1]:.1f} images/s", file=sys.stderr, flush=True)
    base = runs["baseline"]
    rows = [{"name": name, "workers": a.workers, "images": a.images, "repeats": a.repeats, "jpeg_kb": kb,
             "images_per_s": statistics.median(rs),
             "images_per_s_per_worker": statistics.median(rs) / max(1, a.workers),
             "ratio_to_baseline": statistics.median(x / b for x, b in zip(rs, base)),
             "ratio_runs": [x / b for x, b in zip(rs, base)], "images_per_s_runs": rs} for name, rs in runs.items()]
    print(f"\n{a.images} JPEGs 500x375 (~{kb:.0f} KB), batch {a.batch_size}, {a.workers} worker(s), "
          f"median of {a.repeats}, torch {torch.__version__}")
    print(f"{'pipeline':12} {'images/s':>9} {'per worker':>10} {'ratio':>6} {'range':>11}")
    for t in rows:
        spread = f"{min(t['ratio_runs']):.2f}-{max(t['ratio_runs']):.2f}"
        print(f"{t['name']:12} {t['images_per_s']:9.1f} {t['images_per_s_per_worker']:10.1f} "
              f"{t['ratio_to_baseline']:6.2f} {spread:>11}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=256, help="JPEGs to generate and read in each timed pass")
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (0: in this process)")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of every pipeline, interleaved")
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args()
    if args.images < 2 or args.repeats < 1 or args.workers < 0 or args.batch_size < 1:
        p.error("--images must be at least 2, --repeats and --batch-size at least 1, --workers at least 0")
    main(args)
