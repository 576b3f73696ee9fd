"""What checking a last.pt's bytes costs as it is read: failsafe.refuse_unreadable (every record read back against the
CRC-32 that torch wrote) against torch.load itself, both on the same file, in the page cache (as right after a save,
or after a first read), and for a resnet50 as the scripts save it (its weights and SGD's momentum).

    python benchmarks/checkpoint_read.py                          # resnet50: 51.1 M floats, 195 MiB
    python benchmarks/checkpoint_read.py --model resnet18 --repeats 3

It prints the file's size and, for each, the minimum, median and maximum of --repeats timings, in seconds.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torchvision  # noqa: E402

import common  # noqa: E402
import failsafe  # noqa: E402


def timed(fn, repeats):
    seconds = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return min(seconds), statistics.median(seconds), max(seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50", help="a torchvision model")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = getattr(torchvision.models, args.model)()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # the momentum exists
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "last.pt")
        common.save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        check = timed(lambda: failsafe.refuse_unreadable(path), args.repeats)
        load = timed(lambda: torch.load(path, map_location="cpu", weights_only=True), args.repeats)
        print(f"{args.model}: last.pt of {os.path.getsize(path) / 2**20:.0f} MiB, {args.repeats} repeats "
              "(min, median, max s)")
        print(f"failsafe.refuse_unreadable: {check[0]:.3f}, {check[1]:.3f}, {check[2]:.3f}")
        print(f"torch.load:            {load[0]:.3f}, {load[1]:.3f}, {load[2]:.3f}")


if __name__ == "__main__":
    main()
