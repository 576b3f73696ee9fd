"""--tensorboard: each epoch's row of metrics.jsonl also in TensorBoard's files in --out-dir."""
import argparse
import importlib.util

KEYS = ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s")


class Flag(argparse.Action):
    """--tensorboard, refused in one line where the tensorboard package is not installed."""

    def __init__(self, **kw):
        super().__init__(nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if importlib.util.find_spec("tensorboard") is None:
            parser.error("--tensorboard needs the tensorboard package: pip install tensorboard")
        setattr(namespace, self.dest, True)


def add_flags(parser):
    parser.add_argument("--tensorboard", action=Flag, help="also log to TensorBoard in --out-dir")


def log(out_dir, row):
    """The row in an events file of its own (TensorBoard reads every one in out_dir)."""
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(out_dir) as writer:
        for k in KEYS:
            if row[k] is not None:  # (no validation set; no step timed)
                writer.add_scalar(k, row[k], row["step"])
