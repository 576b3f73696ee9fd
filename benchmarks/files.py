"""The file path end to end: a whole training script on an ImageFolder of JPEGs, from its launch to its exit,
against a plain torchvision pipeline doing the same work in a process of its own.

    python benchmarks/files.py                              # 1024 train + 256 val JPEGs, 5 interleaved repeats
    python benchmarks/files.py --repeats 9 --json files.json
    python benchmarks/files.py --train 8 --val 4 --batch-size 4 --repeats 1   # a smoke test: times nothing

It writes an ImageFolder of generated JPEGs of ImageNet-like size (benchmarks/loader.py's write_jpegs: 500x375,
quality 90, 2 classes) in a temporary folder, train/ and val/, then times whole commands:
  script   python ddp_launch_train.py --dataset imagefolder --data-dir D --image-size 32 --workers 2 --epochs 2
           (the default cnn, SGD and batch 64), each run in a fresh --out-dir
  plain    this file's --plain-worker: torchvision.datasets.ImageFolder (PIL decode) with torchvision.transforms
           doing what the scripts' transforms do at --image-size 32 (resize to 32x32, random crop with padding 4,
           flip, ToTensor, Normalize; validation: resize, ToTensor, Normalize), DataLoader(batch_size=64,
           shuffle=True, num_workers=2, persistent_workers=True) for training and a persistent-worker loader for
           validation, the same cnn and SGD (lr 0.01, momentum 0.9, weight decay 5e-4, cosine schedule), 2 epochs,
           an evaluation over val/ after each epoch, and a torch.save of the model and optimizer state after each
           epoch (the scripts save last.pt every epoch)
Both run with this process's environment (OMP_NUM_THREADS as it has it; launchers' variables removed).

Columns: images/s end to end (training images x epochs / seconds from the launch to the exit), medians over
--repeats. The exit is the process's, as `time` sees it: the plain run's includes Python's own teardown (its
workers joined); the script's ends with os._exit, and the fork server it may leave ends a moment later, uncounted.
Runs are interleaved as benchmarks/bench.py's: plain first and again after every script run, each script run divided
by the mean of the two plain runs around it (ratio; range: the lowest and highest). The plain row's range is the
reference against itself (each plain run between two others over their mean): the machine's own spread.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def write_folder(root, train, val):
    """root/train/class{0,1}/*.jpg and root/val/class{0,1}/*.jpg (loader.py's images; val/ from a folder of its
    own, so that it is not a copy of train/'s first files)."""
    from loader import write_jpegs
    write_jpegs(root, train)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        write_jpegs(tmp, train + val)
        os.rename(os.path.join(tmp, "train"), os.path.join(root, "val"))
        for d in os.scandir(os.path.join(root, "val")):  # its last `val` images only
            for e in os.scandir(d):
                if int(e.name.split(".")[0]) < train:
                    os.remove(e.path)


def plain(a):
    """The reference: a plain torchvision pipeline doing the script's work (this file's --plain-worker)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms as T

    from train_extras.datasets import IMAGENET_MEAN, IMAGENET_STD
    from train_extras.models import Net
    size, norm = a.image_size, T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_set = datasets.ImageFolder(os.path.join(a.data_dir, "train"), T.Compose([
        T.Resize((size, size)), T.RandomCrop(size, padding=size // 8), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_set = datasets.ImageFolder(os.path.join(a.data_dir, "val"), T.Compose([
        T.Resize((size, size)), T.ToTensor(), norm]))
    kw = dict(batch_size=a.batch_size, num_workers=a.workers, persistent_workers=a.workers > 0)
    train_loader = DataLoader(train_set, shuffle=True, **kw)
    val_loader = DataLoader(val_set, **kw)
    torch.manual_seed(0)
    model = Net(3, len(train_set.classes))
    optimizer = torch.optim.SGD(model.parameters(), 0.01, 0.9, weight_decay=5e-4, foreach=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, a.epochs * len(train_loader))
    os.makedirs(a.out_dir, exist_ok=True)
    for epoch in range(a.epochs):
        model.train()
        loss_sum = torch.zeros(())
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(a.out_dir, "last.pt"))
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in val_loader:
                correct += (model(x).argmax(1) == y).sum().item()
        print(f"epoch {epoch + 1}  train_loss {loss_sum.item() / len(train_loader):.4f}  "
              f"val_acc {correct / len(val_set):.4f}", flush=True)


def commands(a, data):
    py = sys.executable
    shared = ["--data-dir", data, "--image-size", str(a.image_size), "--workers", str(a.workers),
              "--epochs", str(a.epochs), "--batch-size", str(a.batch_size)]
    return {"plain": [py, os.path.abspath(__file__), "--plain-worker"] + shared,
            "script": [py, os.path.join(ROOT, "ddp_launch_train.py"), "--dataset", "imagefolder"] + shared}


def timed(cmd, out, timeout):
    """Seconds from the launch of `cmd --out-dir out` to its exit (the process's: a fork server it started may
    take a moment longer to end, as after a plain run its workers do)."""
    from bench import LAUNCHER_VARS  # here, not in the plain worker, whose start-up is timed
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    with tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd + ["--out-dir", out], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            sys.exit(f"timed out after {timeout}s: {' '.join(cmd)}")
        seconds = time.perf_counter() - t
        if p.returncode != 0:
            err.seek(0)
            sys.exit(f"exit status {p.returncode}: {' '.join(cmd)}\n{err.read()[-3000:]}")
    if not os.path.exists(os.path.join(out, "last.pt")):
        sys.exit(f"no last.pt written: {' '.join(cmd)}")
    shutil.rmtree(out)
    return seconds


def main(a):
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        write_folder(data, a.train, a.val)
        cmds, images = commands(a, data), a.train * a.epochs
        speeds = {"plain": [], "script": []}

        def run(name, r):
            seconds = timed(cmds[name], os.path.join(tmp, f"out{r}{name}"), a.timeout)
            speeds[name].append(images / seconds)
            print(f"repeat {r + 1}/{a.repeats}  {name}: {seconds:.2f} s, {speeds[name][-1]:.1f} images/s",
                  file=sys.stderr, flush=True)
            return speeds[name][-1]
        before, ratios = run("plain", 0), []
        for r in range(a.repeats):  # each script run between two plain runs
            speed = run("script", r)
            after = run("plain", r)
            ratios.append(speed / ((before + after) / 2))
            before = after
    p = speeds["plain"]
    itself = [b / ((x + y) / 2) for x, b, y in zip(p, p[1:], p[2:])]
    rows = [{"name": name, "train_images": a.train, "val_images": a.val, "epochs": a.epochs,
             "image_size": a.image_size, "workers": a.workers, "batch_size": a.batch_size, "repeats": a.repeats,
             "images_per_s": statistics.median(rs), "images_per_s_runs": rs,
             "ratio_to_plain": 1.0 if name == "plain" else statistics.median(ratios),
             "ratio_runs": itself if name == "plain" else ratios} for name, rs in speeds.items()]
    import torch
    print(f"\n{a.train} + {a.val} JPEGs 500x375, --image-size {a.image_size}, {a.workers} workers, batch "
          f"{a.batch_size}, {a.epochs} epochs, median of {a.repeats}, torch {torch.__version__}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'run':8} {'images/s':>9} {'ratio':>6} {'range':>11}")
    for t in rows:
        spread = f"{min(t['ratio_runs']):.2f}-{max(t['ratio_runs']):.2f}" if t["ratio_runs"] else "-"
        print(f"{t['name']:8} {t['images_per_s']:9.1f} {t['ratio_to_plain']:6.2f} {spread:>11}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=int, default=1024, help="training JPEGs (half in each class)")
    p.add_argument("--val", type=int, default=256, help="validation JPEGs")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--image-size", type=int, default=32, help="the script's --image-size; the plain resize")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes of each run")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="script runs, each between two plain runs")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for each run")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.train, args.val) < 2 or min(args.repeats, args.epochs, args.batch_size) < 1 or args.workers < 0 \
            or args.image_size < 7 or args.train < args.batch_size:
        p.error("--train and --val must be at least 2 (--train at least --batch-size), --repeats, --epochs and "
                "--batch-size at least 1, --workers at least 0, --image-size at least 7")
    plain(args) if args.plain_worker else main(args)
