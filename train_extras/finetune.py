"""--pretrained, --weights FILE and --freeze-backbone: the model a script built, given its starting
weights and frozen where asked, before the script moves it to the device and wraps it (DDP, FSDP,
DataParallel)."""
import functools
import os
import types

import torch
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import common
import failsafe

AUX_LOGITS = ("googlenet", "inception_v3")  # as models.py builds them: no auxiliary outputs


def add_flags(parser):
    tune = parser.add_mutually_exclusive_group().add_argument
    tune("--pretrained", action="store_true", help="start from the torchvision model's ImageNet "
         "weights, a new head")
    tune("--weights", help="start from this state_dict or checkpoint: the tensors that match by "
         "name and shape")
    parser.add_argument("--freeze-backbone", action="store_true", help="train only the "
                        "classifier head")


def prepare(model, run):
    """Returns `model` with the starting weights the flags ask for, frozen but for its head with
    --freeze-backbone (called by the scripts' build_model). --weights is read on rank 0 only (nodes
    need not share a filesystem): DDP's wrapping, or the script, gives its weights to the others."""
    args = run.args
    if not (args.pretrained or args.weights or args.freeze_backbone):
        return model
    if not (args.pretrained or args.weights):
        raise failsafe.UsageError("--freeze-backbone needs --pretrained or --weights: a random "
                                  "backbone is not worth freezing")
    if args.pretrained:  # the weights are --model's, a flag of models.py
        common.optional("models", "--pretrained")
    head = head_names(model, getattr(args, "model", None))
    # one process per machine downloads them into the torch hub cache; then every rank reads it
    if args.pretrained:
        # every rank alike: a UsageError for a model without weights
        weights = pretrained_weights(args.model)
        common.on_rank0(lambda: fetch_pretrained(args.model), run.local_rank)  # once per machine
        model = load_pretrained(model, args.model, head)
        if run.rank == 0:
            # a head tensor's first dimension: the classes (a Linear's or a 1x1 Conv2d's outputs)
            classes = model.state_dict()[min(head)].shape[0]
            print(f"{weights}: every tensor loaded but the new head for {classes} classes "
                  f"({', '.join(sorted(head))})", flush=True)
    if args.weights:
        common.on_rank0(lambda: load_weights(model, args, head), run.rank)
    if args.freeze_backbone:
        freeze_backbone(model, head)
    return model


def pretrained_weights(name):
    """The default (best) ImageNet weights of torchvision's model `name`: their URL, preprocessing
    and metadata."""
    import torchvision
    try:
        return torchvision.models.get_model_weights(name).DEFAULT
    except ValueError:  # cnn, or a model torchvision has no weights for
        raise failsafe.UsageError(f"--pretrained needs a torchvision model (e.g. --model "
                                  f"resnet50): {name} has no pretrained weights") from None


def fetch_pretrained(name):
    """The default weights of `name` downloaded into the torch hub cache
    ($TORCH_HOME/hub/checkpoints), unless they are there already."""
    weights = pretrained_weights(name)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    try:
        # a download is checked against the hash in its name
        weights.get_state_dict(progress=True, check_hash=True)
    except Exception as e:  # no network, a proxy, a truncated file...
        if os.path.exists(path):
            raise failsafe.UsageError(f"{path} could not be read ({type(e).__name__}): "
                                      "delete it to download it again") from None
        raise failsafe.UsageError(f"could not download the {weights} weights ({type(e).__name__}): "
                                  f"put {os.path.basename(path)} (from {weights.url}) in "
                                  f"{os.path.dirname(path)}") from None


def load_pretrained(model, name, head):
    """torchvision's model `name` with its default weights, read from the cache, and `model`'s fresh
    head in place of its own. Built by torchvision's builder, which also sets what the weights need
    (vit_h_14's image size, inception's transform_input) and adapts older files (densenet's key
    names)."""
    import torchvision
    weights = pretrained_weights(name)
    extra = dict(aux_logits=False) if name in AUX_LOGITS else {}
    pretrained = torchvision.models.get_model(name, weights=weights, progress=False, **extra)
    for path in sorted({n.rsplit(".", 1)[0] for n in head}):
        pretrained.set_submodule(path, model.get_submodule(path))
    return pretrained


def head_names(model, name=None):
    """Names of the classifier head's tensors. Of the built-in model `name` (--model, models.py's):
    those whose shape depends on the number of classes. Of your own model (another than that, or
    no models.py): its last layer that has parameters. Either way the model's own: no sample is
    read to count the classes."""
    if name is not None and (conv := common.extra("models").first_conv(model)):
        shapes, head = built_in_head(name, conv[-1].in_channels)
        own = {k: v.shape for k, v in model.state_dict().items()}
        # the built-in model for any number of classes: its tensors, of its shapes but the head's
        if own.keys() == shapes.keys() and {k for k in own if own[k] != shapes[k]} <= head:
            return head
    last = [n for n, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None][-1]
    return frozenset(f"{last}.{k}" if last else k
                     for k, _ in model.get_submodule(last).named_parameters(recurse=False))


@functools.lru_cache
def built_in_head(name, channels):
    """(The tensors' shapes, the head's names) of models.py's `name` for `channels` channels: built
    for 2 and 3 classes on the meta device (no memory, no weights initialized, no random numbers
    drawn), the head being what differs."""
    make = common.extra("models").make
    try:
        with torch.device("meta"):
            a, b = (make(name, channels, n).state_dict() for n in (2, 3))
    except NotImplementedError:  # a builder that sizes its layers with tensors (regnet): on the CPU
        with torch.random.fork_rng(devices=[]):
            a, b = (make(name, channels, n).state_dict() for n in (2, 3))
    return {k: v.shape for k, v in a.items()}, frozenset(k for k in a if a[k].shape != b[k].shape)


def load_weights(model, args, head):
    """--weights: the file's tensors loaded into `model` where name and shape match (a DDP `module.`
    or torch.compile `_orig_mod.` prefix ignored); the others keep their fresh values (another head
    size, another channel count), and one line says which. No match at all is an error, not a
    silently fresh model; so is a backbone tensor left fresh under --freeze-backbone, which would
    freeze it at its random start."""
    state, own = state_dict_in(args.weights), model.state_dict()
    # torch.compile of DDP, or DDP of torch.compile
    for prefix in ("_orig_mod.", "module.", "_orig_mod."):
        consume_prefix_in_state_dict_if_present(state, prefix)
    hits = {k: v for k, v in state.items()
            if k in own and torch.is_tensor(v) and v.shape == own[k].shape}
    if not hits:
        raise failsafe.UsageError(f"{args.weights} holds no tensor of this --model's names and "
                                  f"shapes: is it a {model.__class__.__name__}?")
    fresh, unused = [k for k in own if k not in hits], [k for k in state if k not in own]
    frozen_fresh = [k for k in fresh if k not in head] if args.freeze_backbone else []
    if frozen_fresh:
        raise failsafe.UsageError(f"--freeze-backbone would freeze tensors that {args.weights} "
                                  f"does not hold: {listed(frozen_fresh)}")
    model.load_state_dict(hits, strict=False)
    print(f"{args.weights}: loaded {len(hits)} of the model's {len(own)} tensors"
          + (f"; kept fresh (another shape, or not in the file): {listed(fresh)}" if fresh else "")
          + (f"; ignored from the file (no such name here): {listed(unused)}" if unused else ""),
          flush=True)


def state_dict_in(path):
    """The model's state_dict in a file: this collection's checkpoint, another tool's
    ("state_dict"), or one alone."""
    ckpt = common.read_checkpoint(path)
    state = ckpt.get("model", ckpt.get("state_dict", ckpt)) if isinstance(ckpt, dict) else None
    if not isinstance(state, dict) or not any(torch.is_tensor(v) for v in state.values()):
        raise failsafe.UsageError(f"{path} holds no state_dict "
                                  "(no 'model' or 'state_dict' entry of tensors)")
    return dict(state)


def listed(names):
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def freeze_backbone(model, head):
    """Only the head's parameters keep requires_grad: done before wrapping, DDP then leaves the
    others out of its gradient buckets. The backbone's BatchNorm layers stay in eval mode,
    model.train() or not: they normalize with the loaded running statistics, not each GPU's batch
    statistics, which would depend on the per-GPU batch size and drift from what the weights were
    trained with."""
    for name, p in model.named_parameters():
        p.requires_grad_(name in head)
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and \
                not any(k.startswith(f"{name}.") for k in head):
            # this instance's train(), which Module.train() calls
            m.train = types.MethodType(stay_in_eval, m)
            m.eval()


def stay_in_eval(self, mode=True):
    """A frozen BatchNorm layer's train(): eval mode, whatever is asked."""
    return nn.Module.train(self, False)
