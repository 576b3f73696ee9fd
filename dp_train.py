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
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common

NEVER = 2**62  # "no step yet" for the first NaN/inf step

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


def main(args):
    # ---- setup: one process; DataParallel splits each batch over the GPUs in --gpus
    common.check_args(args)
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    # GPU numbers count the visible GPUs: with CUDA_VISIBLE_DEVICES=2,3, --gpus 0,1 means physical GPUs 2 and 3
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
    output_device = args.output_device if args.output_device is not None else device.index
    if use_cuda and output_device not in range(torch.cuda.device_count()):
        raise common.UsageError(f"--output-device {output_device} is not a GPU of this machine")
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_cpu_threads(1)
    common.set_fast_math(device, args.deterministic)
    world_size, master = 1, True  # one process: DataParallel's GPUs are not ranks
    out_dir = args.out_dir or os.path.join("runs", "dp_train")
    n = max(1, len(gpus))

    # ---- data: one loader; each batch holds --batch-size samples per GPU
    train_set, val_set = common.load_data(args, download=True)
    # the same global order as the DDP scripts (a one-replica DistributedSampler), so that all scripts agree
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, drop_last=True)
    global_batch = args.batch_size * n * args.grad_accum
    train_loader = common.make_loader(train_set, sampler, global_batch, True, args.workers, device)
    val_loader = common.make_loader(val_set, range(len(val_set)), args.batch_size * n, False, args.workers, device)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise common.UsageError(f"{len(train_set)} training samples are less than one global batch ({global_batch})")

    # ---- model
    torch.manual_seed(args.seed)
    raw_model = common.make_model(args.model, train_set.channels, train_set.classes)
    if args.pretrained:  # downloaded into the torch hub cache, unless there already
        common.fetch_pretrained(args.model)
        raw_model, note = common.load_pretrained(raw_model, args, train_set)
        print(note)
    if args.weights:  # any head size or channel count: what matches by name and shape is loaded
        raw_model.load_state_dict(common.load_weights(raw_model, args, train_set))
    if args.freeze_backbone:
        common.freeze_backbone(raw_model, args, train_set)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    raw_model.to(device, memory_format=memory_format)
    if args.compile:
        raw_model.compile()  # in place: parameter names (and checkpoints) keep no _orig_mod. prefix
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
    optimizer = common.make_optimizer(args, raw_model)
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, common.lr_schedule(round(args.warmup_epochs * steps_per_epoch), total_steps))

    # ---- resume: a checkpoint of any script of this collection, written with any number of processes
    ckpt = common.find_checkpoint(args.resume, out_dir, raw_model, args.freeze_backbone)
    meta = ckpt or {"epoch": 0, "step_in_epoch": 0, "loss_sum": 0.0}
    if ckpt:
        options = StateDictOptions(full_state_dict=True)  # name-keyed, as every script of this collection writes it
        set_model_state_dict(raw_model, ckpt["model"], options=options)
        set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"], options=options)
        scheduler.load_state_dict(meta["scheduler"])
    start_epoch, step_in_epoch = meta["epoch"], meta["step_in_epoch"]
    step = start_epoch * steps_per_epoch + step_in_epoch
    if master:
        os.makedirs(out_dir, exist_ok=True)
        common.append_metrics(out_dir, None, keep_until_epoch=start_epoch)  # a fresh run starts an empty file
        writer = common.tensorboard_writer(out_dir) if args.tensorboard else None
        print(f"dp: GPUs {gpus}" if gpus else "dp: no GPU, training on the CPU (DataParallel then simply calls the model)",
              f"global batch {global_batch}" + (f", resuming at step {step}" if step else ""), sep=", ")

    def save(epoch, step_in_epoch, loss_sum):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
        model_state, optim_state = get_state_dict(raw_model, optimizer, options=options)
        if master:
            common.save_atomic({"model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(),
                                "epoch": epoch, "step_in_epoch": step_in_epoch, "loss_sum": loss_sum,
                                "args": vars(args), "world_size": world_size}, os.path.join(out_dir, "last.pt"))

    # ---- train
    # the first step whose loss was NaN/inf, kept on the device: no host sync per step
    first_bad, step_t = torch.full((), NEVER, device=device), torch.full((), step, device=device)
    first_step_time = None
    for epoch in range(start_epoch, args.epochs):
        # set_epoch reshuffles. Forget it and every epoch repeats epoch 0's order
        sampler.set_epoch(epoch)
        train_loader.batches.skip = step_in_epoch  # a resumed epoch skips the batches it had already trained on
        common.train_mode(model, args.freeze_backbone)  # a frozen backbone's BatchNorm stays in eval mode
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # the sum of step losses, this epoch
        if master and epoch == start_epoch:  # a resumed epoch: what the saved part of it added
            loss_sum += meta["loss_sum"] * world_size
        bar = tqdm(total=steps_per_epoch, initial=step_in_epoch, disable=not master, desc=f"epoch {epoch + 1}",
                   leave=False, file=sys.stdout)
        t0 = None
        for x, y in train_loader:
            x = x.contiguous(memory_format=memory_format)  # DataParallel scatters the batch to the GPUs itself
            step_loss = torch.zeros((), device=device)
            for xm, ym in zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum)):
                loss = forward(xm, ym)[0] / len(ym) / args.grad_accum  # the mean over the whole micro-batch
                loss.backward()
                step_loss += loss.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            first_bad = torch.where(~torch.isfinite(step_loss) & (first_bad == NEVER), step_t, first_bad)
            step_t += 1
            loss_sum += step_loss
            step, step_in_epoch = step + 1, step_in_epoch + 1
            bar.update()
            if t0 is None:  # time the steady state: from the end of the epoch's first step on
                if use_cuda:
                    torch.cuda.synchronize()
                t0, t0_step = time.time(), step
                first_step_time = first_step_time or t0
            done = step_in_epoch == steps_per_epoch or step == args.max_steps
            if step % args.log_every == 0 or done or (args.save_every and step % args.save_every == 0):
                check_finite(first_bad)
                if master:
                    bar.set_postfix(loss=f"{step_loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                                    samples_per_s=f"{(step - t0_step) * global_batch / max(time.time() - t0, 1e-9):.0f}")
            if args.save_every and step % args.save_every == 0 and not done:
                save(epoch, step_in_epoch, mean_over_ranks(loss_sum))
            if done:
                break
        bar.close()
        if use_cuda:
            torch.cuda.synchronize()
        train_time = time.time() - t0
        train_loss = mean_over_ranks(loss_sum) / step_in_epoch

        # ---- eval
        t1 = time.time()
        val_loss, val_acc, val_count = evaluate(model, forward, val_loader, device, memory_format)
        eval_time = time.time() - t1

        # ---- save
        finished = step_in_epoch == steps_per_epoch
        if master:
            row = {"epoch": epoch + 1 if finished else epoch + step_in_epoch / steps_per_epoch, "step": step,
                   "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc, "val_count": val_count,
                   "lr": scheduler.get_last_lr()[0], "samples_per_s": (step - t0_step) * global_batch / max(train_time, 1e-9),
                   "epoch_time_s": train_time, "eval_time_s": eval_time, "first_step_time": first_step_time,
                   "world_size": world_size, "gpus": gpus,
                   "peak_mem_mb": [common.peak_memory_mb(torch.device("cuda", g)) for g in gpus] or common.peak_memory_mb(device)}
            common.append_metrics(out_dir, row)
            if writer:
                for k in ("train_loss", "val_loss", "val_acc", "lr", "samples_per_s"):
                    writer.add_scalar(k, row[k], step)
                writer.flush()  # each epoch visible now, and nothing lost at exit
            print(f"epoch {epoch + 1}  train_loss {train_loss:.4f}  val_loss {val_loss:.4f}  val_acc {val_acc:.4f}  "
                  f"lr {row['lr']:.2e}  {row['samples_per_s']:.0f} samples/s  {train_time:.1f}s")
        if finished:
            save(epoch + 1, 0, 0.0)
        else:  # stopped by --max-steps: a mid-epoch checkpoint
            save(epoch, step_in_epoch, train_loss * step_in_epoch)
        step_in_epoch = 0
        if step == args.max_steps:
            break


def mean_over_ranks(t):  # one process: nothing to reduce (the same name as in the DDP scripts, for diffing)
    return t.item()


def check_finite(first_bad):
    if first_bad.item() != NEVER:
        raise common.NonFinite(f"loss is NaN/inf at step {first_bad.item() + 1}: stopped, the last checkpoint is older")


@torch.no_grad()
def evaluate(model, forward, loader, device, memory_format):
    """Loss and accuracy over the whole validation set."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        loss_sum, correct = forward(x.contiguous(memory_format=memory_format), y)
        totals[0] += loss_sum.to(device)
        totals[1] += correct.to(device)
        totals[2] += len(y)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.add_argument("--gpus", help="comma-separated GPU numbers to use, e.g. 0,1, counted among the visible ones "
                        "(CUDA_VISIBLE_DEVICES); default: all visible")
    parser.add_argument("--output-device", type=int,
                        help="GPU that receives the gathered outputs (default: the first of --gpus)")
    parser.add_argument("--gather-outputs", action="store_true",
                        help="the classic way: gather all outputs on one GPU and compute the loss there (more memory on it)")
    args = parser.parse_args()
    try:
        main(args)
    except (common.UsageError, common.NonFinite) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, common.UsageError) else 1)
