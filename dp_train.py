"""nn.DataParallel: one process drives all the GPUs it sees; each step splits the batch over them.

    python dp_train.py                 # all visible GPUs, or the CPU where there is none
    python dp_train.py --gpus 0,1      # these GPUs only
    CUDA_VISIBLE_DEVICES=2,3 python dp_train.py   # physical GPUs 2 and 3, which the script sees as 0 and 1

The simplest way to use several GPUs, and the slowest: one Python process (one GIL) scatters every batch, copies
the model to every GPU at every step, and gathers the results on GPU 0, which therefore holds more memory than the
others. Here each GPU computes its own loss (model and criterion in one module), so only per-GPU loss sums are
gathered, not every output; --gather-outputs shows the classic way. Prefer DDP (ddp_launch_train.py) for speed.
With no GPU or one, DataParallel simply calls the module: the scatter and gather need two or more GPUs.
"""
import functools
import math
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.utils.data.distributed import DistributedSampler

import common


class ModelWithLoss(nn.Module):
    """The model and its criterion as one module: each GPU's replica returns only its loss sum and correct count,
    so GPU 0 gathers a few numbers instead of every replica's outputs (what DataParallelModel/DataParallelCriterion
    did, without the package)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return F.cross_entropy(out.float(), y, reduction="sum")[None], (out.argmax(1) == y).sum()[None]


def setup_devices(args):
    """The GPUs this one process drives (none on a CPU machine) and the device its parameters live on: GPU numbers
    count the visible GPUs, so with CUDA_VISIBLE_DEVICES=2,3, --gpus 0,1 means physical GPUs 2 and 3."""
    if common.launched_as_one_of_several():
        raise common.UsageError(f"dp_train.py is one process that drives every GPU: start it with python, not "
                                f"{common.launched_as_one_of_several()} (one process per GPU: ddp_launch_train.py)")
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    visible = torch.cuda.device_count() if use_cuda else 0
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
    try:
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(visible))
    except ValueError:
        raise common.UsageError(f"--gpus {args.gpus}: give GPU numbers such as 0,1") from None
    if args.gpus and not use_cuda:
        raise common.UsageError(f"--gpus {args.gpus}: no GPU is visible{shown}, or --device cpu: training on the CPU")
    if not all(0 <= g < visible for g in gpus):
        raise common.UsageError(f"--gpus {args.gpus}: the visible GPUs{shown} are numbered 0 to {visible - 1}")
    device = torch.device(f"cuda:{gpus[0]}" if use_cuda else "cpu")  # parameters live here, copied to the others
    if use_cuda and (args.output_device or 0) not in range(torch.cuda.device_count()):
        raise common.UsageError(f"--output-device {args.output_device} is not a GPU of this machine")
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_cpu_threads(1)
    common.set_fast_math(device, args.deterministic)
    return gpus, device


def build_data(args, gpus, device):  # [dp]
    """One loader, each batch --batch-size samples per GPU, in the same global order as the DDP scripts (a
    one-replica DistributedSampler), so that all scripts agree. Returns (train_set, sampler, train_loader,
    val_loader)."""
    train_set, val_set = common.load_data(args, download=True)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True)
    per_step = args.batch_size * max(1, len(gpus))
    train_loader = common.make_loader(train_set, sampler, per_step * args.grad_accum, True, args.workers, device)
    val_loader = common.make_loader(val_set, range(len(val_set)), per_step, False, args.workers, device)
    if len(train_loader) == 0:
        raise common.UsageError(f"{len(train_set)} training samples are less than one global batch "
                                f"({per_step * args.grad_accum})")
    return train_set, sampler, train_loader, val_loader


def build_model(args, train_set, device, memory_format, gpus):  # [dp]
    """The model on the first GPU, and DataParallel around it, which copies it to every GPU at every step. Returns
    (raw_model, model, forward): forward(x, y) gives the loss sum and the correct count of a batch."""
    torch.manual_seed(args.seed)
    channels, classes = common.channels_and_classes(train_set)
    raw_model = common.make_model(args.model, channels, classes)
    if args.pretrained:  # downloaded into the torch hub cache, unless there already
        common.fetch_pretrained(args.model)
        raw_model, note = common.load_pretrained(raw_model, args.model, channels, classes)
        print(note)
    if args.weights:  # any head size or channel count: what matches by name and shape is loaded
        raw_model.load_state_dict(common.load_weights(raw_model, args, channels, classes))
    if args.freeze_backbone:
        common.freeze_backbone(raw_model, args.model, channels, classes)
    raw_model.to(device, memory_format=memory_format)
    if args.compile:
        raw_model.compile()  # in place: parameter names (and checkpoints) keep no _orig_mod. prefix
    output_device = args.output_device if args.output_device is not None else device.index
    if args.gather_outputs:  # the classic way: all outputs gathered on output_device, the loss computed there
        model = nn.DataParallel(raw_model, gpus, output_device)

        def forward(x, y):
            out = model(x)
            y = y.to(out.device)
            return F.cross_entropy(out.float(), y, reduction="sum"), (out.argmax(1) == y).sum()
    else:  # each replica computes its own loss; only the per-GPU sums are gathered
        model = nn.DataParallel(ModelWithLoss(raw_model), gpus, output_device)

        def forward(x, y):
            loss_sum, correct = model(x, y)
            return loss_sum.sum(), correct.sum()
    return raw_model, model, forward


def resume(args, raw_model, optimizer, scheduler, out_dir, global_batch, gpus):  # [dp]
    """A checkpoint of any script of this collection, written with any number of processes. Returns the progress it
    saved, or None for a fresh start."""
    ckpt = common.find_checkpoint(args.resume, out_dir, raw_model, args.freeze_backbone, global_batch)
    if ckpt and "sharded" in ckpt:
        raise common.UsageError(f"{ckpt['sharded']} is a sharded checkpoint: dp_train.py reads last.pt files. "
                                f"Convert it: python -c \"import common; common.sharded_to_file('{ckpt['sharded']}', "
                                "'last.pt')\"")
    if ckpt:
        options = StateDictOptions(full_state_dict=True)  # name-keyed, as every script of this collection writes it
        set_model_state_dict(raw_model, ckpt["model"], options=options)
        set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"], options=options)
        scheduler.load_state_dict(ckpt["scheduler"])
        # dropout and the like draw from the CPU's and each GPU's generators: as they were, to go on as if never stopped
        common.restore_rng(ckpt, 0, 1, args.seed, [torch.device("cuda", g) for g in gpus])  # [dp]
    return ckpt


def train_step(forward, x, y, optimizer, scheduler, args):
    """One optimizer step over --grad-accum micro-batches; returns its loss and, with --clip-grad, the gradients'
    norm before clipping, on the device (no host sync)."""
    step_loss = torch.zeros((), device=optimizer.param_groups[0]["params"][0].device)  # [dp] x may be on the CPU
    # [dp] one process: no gradients to synchronize, no no_sync()
    for xm, ym in zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum)):  # [dp]
        loss = forward(xm, ym)[0] / len(ym) / args.grad_accum  # [dp] the mean over the whole micro-batch
        loss.backward()  # [dp] DataParallel adds up the replicas' gradients on the first GPU
        step_loss += loss.detach()
    norm = common.clip_grad_norm(optimizer, args.clip_grad) if args.clip_grad else None  # of the summed gradients
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, norm


def train_one_epoch(model, forward, loader, optimizer, scheduler, progress, args, device, memory_format, checkpoint,
                    watch):
    """One pass over this rank's part of the data (what is left of it, when resumed mid-epoch); returns the mean
    loss over its steps and the ranks."""
    common.train_mode(model, args.freeze_backbone)  # a frozen backbone's BatchNorm stays in eval mode
    loader.batches.skip = progress.step_in_epoch  # a resumed epoch skips the batches it had already trained on
    bar = common.progress_bar(progress, True)  # [dp] one process: it shows its progress
    for x, y in progress.timed(loader):  # counts the time spent waiting for data
        x = loader.normalize(x.to(device, non_blocking=True))  # [dp] image files come as uint8: made float on GPU 0
        x = x.contiguous(memory_format=memory_format)  # [dp] DataParallel scatters the batch to the GPUs itself
        progress.step_done(*train_step(forward, x, y, optimizer, scheduler, args))  # [dp]
        stopping = watch.step_done(progress.step)  # a SIGUSR1/SIGTERM on any rank, known to all at this step
        bar.update()
        if progress.due(args.log_every) or progress.due(args.save_every) or progress.epoch_done or stopping:
            check_finite(progress.first_bad)  # all ranks agree on it, so all stop together
            bar.set_postfix(loss=f"{progress.last_loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                            samples_per_s=f"{progress.samples_per_s():.0f}", **progress.waiting())
        if progress.epoch_done:
            break
        if progress.due(args.save_every) or stopping:
            checkpoint()
        if stopping:  # every rank has saved: the run ends here, and --resume auto continues from this step
            raise common.Stopped(stopping, progress.step)
    bar.close()
    progress.end_epoch()
    return mean_over_ranks(progress.loss_sum) / progress.step_in_epoch


@torch.no_grad()
def evaluate(forward, model, loader, device, memory_format):  # [dp]
    """Loss and accuracy over the whole validation set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x = loader.normalize(x.to(device, non_blocking=True))  # [dp]
        loss_sum, correct = forward(x.contiguous(memory_format=memory_format), y)
        totals[0] += loss_sum.to(device)
        totals[1] += correct.to(device)
        totals[2] += len(y)
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}


def check_finite(first_bad):  # [dp]
    if first_bad.item() != common.NEVER:
        raise common.NonFinite(f"loss is NaN/inf at step {first_bad.item() + 1}: stopped, the last checkpoint is older")


def mean_over_ranks(t):  # [dp] one process: nothing to reduce (the same name as in the DDP scripts, for comparing)
    return t.item()


def save(out_dir, raw_model, optimizer, scheduler, progress, args, gpus):  # [dp]
    """One process writes the whole training state:
    plain names and whole tensors, loadable by any script, any number of processes, with or without a GPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
    model_state, optim_state = get_state_dict(raw_model, optimizer, options=options)
    state = progress.state(mean_over_ranks(progress.loss_sum))
    rngs = [common.rng_state([torch.device("cuda", g) for g in gpus])]  # [dp] one process, its GPUs' generators too
    # [dp] one process: it writes
    common.save_atomic({"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(),  # [dp]
                        **state, "rng": rngs, "args": vars(args), "world_size": 1}, os.path.join(out_dir, "last.pt"))


def main(args):
    common.validate(args)
    gpus, device = setup_devices(args)  # [dp]
    world_size, master = 1, True  # [dp] one process: DataParallel's GPUs are not ranks
    watch = common.Watch(None, 0, args.step_timeout)  # [dp] SIGUSR1 (time limit near), SIGTERM: save, then stop
    out_dir = args.out_dir or os.path.join("runs", os.path.splitext(os.path.basename(__file__))[0])
    if args.ckpt_format == "dcp":  # [dp] one process holds everything: nothing to shard
        raise common.UsageError("--ckpt-format dcp is for the multi-process scripts: dp_train.py writes last.pt")
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    train_set, sampler, train_loader, val_loader = build_data(args, gpus, device)  # [dp]
    raw_model, model, forward = build_model(args, train_set, device, memory_format, gpus)  # [dp]
    optimizer, scheduler = common.make_optimizer(args, raw_model, len(train_loader))
    global_batch = args.batch_size * args.grad_accum * max(1, len(gpus))  # [dp]
    # one process claims --out-dir (no other live run, no last.pt replaced unasked), held until it ends
    out_lock = common.claim_out_dir(out_dir, args)  # noqa: F841  [dp]
    saved = resume(args, raw_model, optimizer, scheduler, out_dir, global_batch, gpus)  # [dp]
    progress = common.Progress(len(train_loader), global_batch, args.max_steps, device, saved)
    checkpoint = functools.partial(save, out_dir, raw_model, optimizer, scheduler, progress, args, gpus)  # [dp]
    if progress.step >= (args.max_steps or math.inf):  # --max-steps is a budget: a resume may find it spent
        if master:
            print(f"already at step {progress.step} of --max-steps {args.max_steps}: nothing to train")
        return
    writer = common.start_output(out_dir, progress, args.tensorboard) if master else None
    if master:
        where = f"GPUs {gpus}" if gpus else "no GPU, training on the CPU (DataParallel simply calls the model)"  # [dp]
        print(f"dp: {where}, global batch {global_batch}"  # [dp]
              + (f", resuming at step {progress.step}" if progress.step else ""))

    for epoch in range(progress.epoch, args.epochs):
        # set_epoch reshuffles: the same new order on every rank. Forget it and every epoch repeats epoch 0's order
        sampler.set_epoch(epoch)
        progress.start_epoch(epoch)
        train_loss = train_one_epoch(model, forward, train_loader, optimizer, scheduler, progress, args,  # [dp]
                                     device, memory_format, checkpoint, watch)
        # [dp] no BatchNorm statistics to broadcast: one process holds the only copy of the model
        t1 = time.time()
        val = evaluate(forward, model, val_loader, device, memory_format)  # [dp] on every GPU
        if master:
            row = {"train_loss": train_loss, **val, "lr": scheduler.get_last_lr()[0], "eval_time_s": time.time() - t1}
            peak = [common.peak_memory_mb(torch.device("cuda", g)) for g in gpus]  # [dp] every GPU's
            common.log_epoch(out_dir, writer, progress, {**row, "world_size": world_size, "gpus": gpus,  # [dp]
                                                         "peak_mem_mb": peak or common.peak_memory_mb(device)})
        checkpoint()
        if progress.step == args.max_steps:
            break
    # [dp] one process writes last.pt: no sharded checkpoint in the background to wait for


if __name__ == "__main__":  # [dp] one process: no launcher, no process group
    parser = common.get_parser(__doc__)
    parser.add_argument("--gpus", help="comma-separated GPU numbers to use, e.g. 0,1, counted among the visible ones "
                        "(CUDA_VISIBLE_DEVICES); default: all visible")
    parser.add_argument("--output-device", type=int,
                        help="GPU that receives the gathered outputs (default: the first of --gpus)")
    parser.add_argument("--gather-outputs", action="store_true",
                        help="the classic way: gather all outputs on one GPU and compute the loss there (more memory "
                        "on it)")
    args = parser.parse_args()
    # SIGTERM before main() hands it to common.Watch (which saves, then stops): unwind through `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # and SIGUSR1, which would kill it: there is nothing to save yet
    try:
        main(args)
    except (common.UsageError, common.NonFinite, common.Stopped) as e:
        # leaving anyway: a launcher's SIGTERM (torchrun's, once a first copy has exited) must not cut this short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if common.launcher_rank() == 0:  # started by mistake as several copies: one line, once
            print(e if isinstance(e, common.Stopped) else f"error: {e}", file=sys.stderr)
        else:
            time.sleep(0.5)  # and the first copy says why before the others exit
        sys.exit(common.exit_code(e))  # the table in docs/failures.md
