"""How often a DataLoader worker never starts: a copied fsdp_train.py (2 processes under torchrun, 2
workers each, a training and a validation loader every epoch) run again and again on a small
ImageFolder, with and without train_extras/workers.py (the fork server), each run under a time limit.

    python benchmarks/worker_starts.py --runs 16 --epochs 40                 # workers.py copied
    python benchmarks/worker_starts.py --runs 16 --epochs 40 --without       # plain fork, torch's default

Each epoch starts 8 workers (2 loaders x 2 workers x 2 ranks): 16 runs of 40 epochs are 5,120 starts.
A run that outlives --limit seconds is counted as a hang (its stacks are dumped, then it is killed).
On Pythons where the bug was fixed (train_extras/workers.py: AFFECTED) both modes fork.
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_images(root, per_class=24, size=8):
    from PIL import Image
    for split, n in (("train", per_class), ("val", per_class // 3)):
        for c in ("a", "b"):
            os.makedirs(os.path.join(root, split, c))
            for i in range(n):
                Image.new("RGB", (size, size), (40 * i % 255, 90 * (c == "b"), 0)).save(
                    os.path.join(root, split, c, f"{i}.png"))


def copy_project(folder, with_workers):
    """fsdp_train.py, common.py, failsafe.py and the train_extras/ modules an ImageFolder run needs."""
    os.makedirs(os.path.join(folder, "train_extras"))
    for name in ("fsdp_train.py", "common.py", "failsafe.py"):
        shutil.copy(os.path.join(ROOT, name), folder)
    for name in ("__init__", "datasets", "models") + (("workers",) if with_workers else ()):
        shutil.copy(os.path.join(ROOT, "train_extras", f"{name}.py"), os.path.join(folder, "train_extras"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--limit", type=float, default=180, help="seconds a run may take before it counts as a hang")
    p.add_argument("--without", action="store_true", help="train_extras/workers.py not copied: forked workers")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_images(os.path.join(tmp, "data"))
        copy_project(os.path.join(tmp, "project"), not a.without)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1"}
        hangs, seconds = 0, []
        for run in range(a.runs):
            out = os.path.join(tmp, f"out{run}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=127.0.0.1:0", "fsdp_train.py", "--dataset", "imagefolder", "--data-dir",
                   os.path.join(tmp, "data"), "--image-size", "8", "--batch-size", "4", "--epochs", str(a.epochs),
                   "--workers", "2", "--out-dir", out]
            t = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=os.path.join(tmp, "project"), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            try:
                _, err = proc.communicate(timeout=a.limit)
                if proc.returncode != 0:
                    sys.exit(f"run {run} failed (exit {proc.returncode}):\n{err[-3000:]}")
                seconds.append(time.monotonic() - t)
            except subprocess.TimeoutExpired:
                hangs += 1
                os.killpg(proc.pid, signal.SIGABRT)  # every process's stacks (PYTHONFAULTHANDLER)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
                print(f"run {run}: still running after {a.limit:.0f} s: counted as a hang\n"
                      f"{proc.communicate()[1][-2000:]}", flush=True)
            print(f"run {run + 1}/{a.runs}: {8 * a.epochs * (run + 1)} worker starts, {hangs} hangs", flush=True)
    mode = "forked (workers.py not copied)" if a.without else "train_extras/workers.py"
    print(f"{mode}, Python {sys.version.split()[0]}: {a.runs} runs, {8 * a.epochs * a.runs} worker starts, "
          f"{hangs} hangs; a finished run took {min(seconds):.1f}-{max(seconds):.1f} s" if seconds else "")


if __name__ == "__main__":
    main()
