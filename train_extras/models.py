"""--model: cnn (the default, a small 2-conv net) or any classification model of torchvision, for
this data's classes and channels: what common.make_model returns."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import failsafe


class Net(nn.Module):
    """The MNIST tutorials' 2-conv net, without dropout; the adaptive pool takes any image size."""

    def __init__(self, channels=1, classes=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(channels, 32, 3), nn.Conv2d(32, 64, 3)
        self.pool = nn.AdaptiveMaxPool2d(12)  # = max_pool2d(2) on 28x28 inputs
        self.fc1, self.fc2 = nn.Linear(64 * 12 * 12, 128), nn.Linear(128, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Smooth(nn.Module):
    """A smaller cnn with nothing to decide: SiLU for ReLU, average for max pooling. Two runs that
    differ only in the order of a sum (other process counts, launchers, CPUs, kernels) stay within
    rounding of each other; in the cnn one ReLU or max-pool decision that flips moves the weights
    by 4e-6 at once. The tests compare runs of it (docs/correctness.md)."""

    def __init__(self, channels=1, classes=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(channels, 16, 3), nn.Conv2d(16, 32, 3)
        self.pool = nn.AdaptiveAvgPool2d(6)
        self.fc1, self.fc2 = nn.Linear(32 * 6 * 6, 64), nn.Linear(64, classes)

    def forward(self, x):
        x = self.pool(F.silu(self.conv2(F.silu(self.conv1(x)))))
        return self.fc2(F.silu(self.fc1(x.flatten(1))))


def make(name, channels, classes):
    """cnn, smooth, or torchvision's model `name` for `classes` classes, its first conv made for
    `channels` channels."""
    if name == "cnn":
        return Net(channels, classes)
    if name == "smooth":
        return Smooth(channels, classes)
    import torchvision  # only for its models: the cnn does without
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise failsafe.UsageError(f"unknown --model {name!r}: use cnn or a torchvision "
                                  "classification model, e.g. resnet18")
    # googlenet and inception_v3 would return auxiliary outputs in training mode, which the loss
    # does not take
    extra = dict(aux_logits=False, init_weights=True) if name in ("googlenet", "inception_v3") \
        else {}
    model = torchvision.models.get_model(name, num_classes=classes, **extra)
    parent, key, conv = first_conv(model)
    if channels != conv.in_channels:
        setattr(parent, key, nn.Conv2d(channels, conv.out_channels, conv.kernel_size, conv.stride,
                                       conv.padding, bias=conv.bias is not None))
    return model


def first_conv(model):
    """(Its parent, its name, the first nn.Conv2d) of `model`, or None: the layer make() sizes for
    the channels."""
    return next(((p, k, m) for p in model.modules() for k, m in p.named_children()
                 if isinstance(m, nn.Conv2d)), None)


def channels_and_classes(ds):
    """(x's first dimension, the classes: the dataset's `classes`, a count or the names; else the
    labels')."""
    # a label may be an array of one element, as common.to_device takes it
    classes = getattr(ds, "classes", None) or 1 + int(max(ds.tensors[1])
                                                      if isinstance(ds, TensorDataset) else
                                                      max(torch.as_tensor(y).item() for _, y in ds))
    if (classes := classes if isinstance(classes, int) else len(classes)) < 2:
        raise failsafe.UsageError(f"the data holds {classes} class: a classifier needs at least 2")
    return ds[0][0].shape[0], classes


def add_flags(parser):
    parser.add_argument("--model", default="cnn",
                        help="cnn (a small 2-conv net), smooth (a smaller one without ReLU or "
                        "max-pooling: runs compare within rounding) or a torchvision "
                        "classification model, e.g. resnet18")


def for_data(args, ds):
    """make(), for --model and the channels and classes of the dataset `ds` (common.make_model)."""
    return make(args.model, *channels_and_classes(ds))
