"""--model <a torchvision model>: any classification model of torchvision, for this data's classes and channels."""
import torch.nn as nn
import torchvision

import common


def make(name, channels, classes):
    """torchvision's model `name` for `classes` classes, its first conv made for `channels` channels."""
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise common.UsageError(f"unknown --model {name!r}: use cnn or a torchvision classification model, e.g. "
                                "resnet18")
    # googlenet and inception_v3 would return auxiliary outputs in training mode, which the loss does not take
    extra = dict(aux_logits=False, init_weights=True) if name in ("googlenet", "inception_v3") else {}
    model = torchvision.models.get_model(name, num_classes=classes, **extra)
    parent, key, conv = next((p, k, m) for p in model.modules() for k, m in p.named_children()
                             if isinstance(m, nn.Conv2d))  # the first conv
    if channels != conv.in_channels:
        setattr(parent, key, nn.Conv2d(channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                                       bias=conv.bias is not None))
    return model
