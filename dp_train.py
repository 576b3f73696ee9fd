"""nn.DataParallel: one process drives all the GPUs it sees; each step splits the batch over them.

    python dp_train.py             # all visible GPUs, or the CPU where there is none
    python dp_train.py --gpus 0,1  # these GPUs only, numbered within CUDA_VISIBLE_DEVICES

The simplest way to use several GPUs, and the slowest: one process (one GIL) copies the model to
every GPU at every step and gathers the results on GPU 0, which holds more memory than the others.
Here each GPU computes its own loss, so only per-GPU loss sums are gathered (--gather-outputs: the
classic way). Prefer DDP (ddp_launch_train.py), which this script copies but for the lines marked
[dp]; a checkpoint of either resumes in the other.
"""
import dataclasses
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

import common
import failsafe


class ModelWithLoss(nn.Module):
    """The model and its loss as one module: each GPU's replica returns only its loss sum and
    correct count."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        y = y.to(out.device)  # --gather-outputs: the outputs came to --output-device
        return (F.cross_entropy(out.float(), y, reduction="sum")[None],
                (out.argmax(1) == y).sum()[None])


@dataclasses.dataclass(slots=True)
class Run(common.Run):  # [dp] the run's fields, and DataParallel's
    gpus: list = None  # the GPUs each batch is split over (none: the CPU or one other device)


def setup_devices(args):
    """Picks the GPUs this one process drives (none on a CPU machine) and the device its parameters
    live on: GPU numbers count the visible GPUs, so with CUDA_VISIBLE_DEVICES=2,3, --gpus 0,1 means
    physical GPUs 2 and 3."""
    use_cuda = args.device == "cuda"  # [dp] DataParallel drives GPUs; on mps, xpu: the one there is
    visible, env = torch.cuda.device_count() if use_cuda else 0, os.environ
    shown = f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})" \
        if "CUDA_VISIBLE_DEVICES" in env else ""
    try:
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(visible))
    except ValueError:
        raise failsafe.UsageError(f"--gpus {args.gpus}: give GPU numbers such as 0,1") from None
    if args.gpus and not use_cuda:
        raise failsafe.UsageError(f"--gpus {args.gpus}: no CUDA GPU is visible{shown}, "
                                  f"or --device {args.device}")
    if not all(0 <= g < visible for g in gpus):
        raise failsafe.UsageError(f"--gpus {args.gpus}: the visible GPUs{shown} are numbered "
                                  f"0 to {visible - 1}")
    if use_cuda and (args.output_device or 0) not in range(visible):
        raise failsafe.UsageError(f"--output-device {args.output_device} is not a visible "
                                  f"GPU{shown}")
    # its replicas would call the first GPU's compiled module, with its parameters
    if args.compile and len(gpus) > 1:
        raise failsafe.UsageError("--compile with DataParallel on several GPUs: give one (--gpus "
                                  "0), or use ddp_launch_train.py --compile, one process per GPU")
    # parameters live on the first GPU (copied to the others at every step), or on the one
    # device there is
    device = torch.device("cuda", gpus[0]) if use_cuda else common.local_device(args.device, 0)
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_threads_and_math(1, args.deterministic)
    # one process: rank 0 of 1, and no store (no collective to wait on: train_extras/hangs.py has
    # nothing to name)
    return Run(args=args, rank=0, world_size=1, local_rank=0, device=device, gpus=gpus)


def build_data(run):  # [dp]
    """Builds one loader, each step's batch --batch-size samples per GPU, in the same global order
    as the DDP scripts (a one-replica DistributedSampler): every script trains on the same
    batches."""
    args = run.args
    run.train_set, val_set = common.load_data(args, download=True)
    run.sampler = DistributedSampler(run.train_set, 1, 0, shuffle=True, seed=args.seed,
                                     drop_last=True)
    run.steps_per_epoch = len(run.sampler) // run.global_batch
    if run.steps_per_epoch == 0:
        raise failsafe.UsageError(f"{len(run.train_set)} training samples are less than one global "
                                  f"batch ({run.global_batch})")
    val_batches = list(BatchSampler(range(len(val_set)),
                                    args.batch_size * max(1, len(run.gpus)), False))
    run.val_loader = common.make_loader(val_set, val_batches, run)


def build_model(run):  # [dp]
    """Puts the model on the first GPU, in a DataParallel that copies it to every GPU at every
    step."""
    args = run.args
    torch.manual_seed(args.seed)
    run.raw_model = common.make_model(args, run.train_set)
    run.raw_model = common.extra("finetune").prepare(run.raw_model, run)  # --weights and the like
    run.raw_model.to(run.device, memory_format=torch.channels_last if args.channels_last
                     else torch.preserve_format)
    if args.compile:
        run.raw_model.compile()  # in place: no _orig_mod. prefix on parameter names or checkpoints
    # each GPU's replica computes its loss, only the sums are gathered; --gather-outputs: the
    # classic way, all outputs gathered on --output-device and the loss computed there. On the
    # CPU: the module itself, as DataParallel would
    model = run.raw_model if args.gather_outputs else ModelWithLoss(run.raw_model)
    model = nn.DataParallel(model, run.gpus, args.output_device) if run.gpus else model
    run.model = ModelWithLoss(model) if args.gather_outputs else model
    run.optimizer, run.scheduler = common.make_optimizer(args, run.raw_model, run.steps_per_epoch)


def resume(run):  # [dp]
    """Loads a last.pt of any script, written by any number of processes; returns the position it
    saved, or None (a fresh start)."""
    ckpt = common.checkpoint_to_resume(run)
    if ckpt:
        # name-keyed, as every script writes it; one process holds it whole, so no full_state_dict
        # (which fails on an optimizer state without tensors, as SGD's without momentum: "Expected
        # device to be set")
        set_model_state_dict(run.raw_model, ckpt["model"])
        set_optimizer_state_dict(run.raw_model, run.optimizer, ckpt["optimizer"])
        run.scheduler.load_state_dict(ckpt["scheduler"])
        # dropout and the like draw from the generators: as they were, to go on as if never stopped
        common.restore_rng(ckpt, run)
    return ckpt


def train_step(run, x, y):
    """Takes one optimizer step over --grad-accum micro-batches; returns its loss and, with
    --clip-grad, the gradients' norm before clipping, on the device (no host sync)."""
    step_loss, accum = torch.zeros((), device=run.device), run.args.grad_accum
    # [dp] one process: no gradients to synchronize, no no_sync()
    for xm, ym in zip(common.micro_batches(x, accum), y.chunk(accum)):  # [dp]
        # the mean over the whole micro-batch
        loss = run.model(xm, ym)[0].sum().to(run.device) / len(ym) / accum
        loss.backward()  # DataParallel adds up the replicas' gradients on the first GPU
        step_loss += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.args.clip_grad) \
        if run.args.clip_grad else None
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss, norm


def train_one_epoch(run, epoch):
    """Trains one pass over this rank's part of the data (what is left of it, when resumed
    mid-epoch); returns the mean loss and gradient norm over the epoch's steps (a resumed epoch's
    saved part included) and the ranks."""
    args, position = run.args, run.position
    # set_epoch reshuffles: the same new order on every rank. Forget it and every epoch repeats
    # epoch 0's order
    run.sampler.set_epoch(epoch)
    if callable(getattr(run.train_set, "set_epoch", None)):  # augmentation seeded per epoch
        run.train_set.set_epoch(epoch)
    batches = list(BatchSampler(run.sampler, run.global_batch,  # [dp] split over the GPUs later
                                drop_last=True))
    # resumed mid-epoch: skip the batches already done
    loader = common.make_loader(run.train_set, batches[position.step_in_epoch:], run)
    run.raw_model.train()
    for x, y in loader:
        if position.step == position.start_step + 1:  # as in the DDP scripts; here a no-op:
            failsafe.set_timeout(args.step_timeout)  # one process, no collective to wait on
        x, y = common.to_device(run, run.train_set, x, y)
        loss, norm = train_step(run, x, y)
        # in this order: the step counted (the epoch's end, a save due); then, at a check (every
        # --log-every steps or about 2 s, a save, the last step: one collective), every rank learns
        # of a NaN/inf loss on any rank (it ends the run here: NanLoss) or a stop signal; then the
        # bar, and rank 0's line every --log-every steps
        position.step_done(loss, norm)
        run.agreement.step_done(loss)
        run.progress.step_done(loss)
        if position.last:  # the epoch's end, or --max-steps: the caller saves (a stop then too)
            break
        # a stop the ranks agreed on: saved at this step, where the run ends (the save's last step,
        # common.write_and_end_if_stopped); --resume auto goes on from it
        if position.save_due or failsafe.STOP.agreed:
            save(run)
    run.progress.end_epoch()
    return mean_over_ranks(position.sums) / position.step_in_epoch


def mean_over_ranks(t):  # [dp] one process: nothing to average (named as DDP's, to compare)
    return t


@torch.no_grad()
def evaluate(run):  # [dp]
    """Returns loss and accuracy over the validation set, every batch split over the GPUs."""
    run.raw_model.eval()
    # loss sum, correct, count (MPS: float32)
    totals = torch.zeros(3, dtype=run.position.sums_dtype, device=run.device)
    for x, y in run.val_loader:
        x, y = common.to_device(run, run.val_loader.dataset, x, y)
        loss_sums, correct = run.model(x, y)  # one of each per GPU
        totals[0] += loss_sums.sum().to(run.device)
        totals[1] += correct.sum().to(run.device)
        totals[2] += len(y)
    return common.validation_row(totals)


def save(run):  # [dp]
    """Saves the whole training state to last.pt, as the DDP scripts write it (world size 1): plain
    names, whole tensors, the random generators. It loads in any script, at any number of processes,
    with or without a GPU."""
    # the state dicts, on the CPU
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(run.raw_model, run.optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state,
             "scheduler": run.scheduler.state_dict(),
             **run.position.state(run.position.sums.tolist()), "args": vars(run.args),
             "rng": [common.rng_state(run.device)], "world_size": 1}
    common.write_and_end_if_stopped(run, state)  # a stop ends the run there, saved


def evaluate_and_log(run):
    """Evaluates, then logs rank 0's metrics row (a failed write stops every rank). A stop that
    came during the evaluation ends the run after it (common.log_and_end_if_stopped): the epoch was
    saved before it."""
    t1 = time.time()
    row = {**run.position.pending_row, **evaluate(run), "eval_time_s": time.time() - t1}
    common.log_and_end_if_stopped(run, row)


def announce(run):
    """Prints rank 0's first line: how the run is set up, and the step a resume starts at."""
    print(f"dp: {f'GPUs {run.gpus}' if run.gpus else 'no GPU, training on the CPU'}, "  # [dp]
          f"global batch {run.global_batch}"
          + (f", resuming at step {run.position.step}" if run.position.step else ""))


def main(args):
    common.extra("workers").fork_server(args)  # for DataLoader workers, before any thread
    run = setup_devices(args)  # [dp]
    master = run.rank == 0  # one process: it prints and writes files
    run.out_dir = args.out_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(__file__))[0])
    common.on_rank0(lambda: failsafe.check_out_dir(run), run.rank)  # a used one: refused now
    run.global_batch = (args.batch_size * args.grad_accum  # [dp] --batch-size: per GPU
                        * max(1, len(run.gpus)))
    build_data(run)
    build_model(run)
    saved = resume(run)
    run.position = position = common.Position(run, saved)  # where training stands
    run.agreement, run.progress = failsafe.Agreement(run), common.Progress(run)
    end = min(args.epochs * run.steps_per_epoch, args.max_steps or float("inf"))
    if position.step >= end and not position.pending_row:  # a resume may find the run done
        if master:
            print(f"already at step {position.step} of {end} (--epochs {args.epochs}, "
                  f"--max-steps {args.max_steps}): nothing to train")
        return
    # this run's folder now: made; --overwrite deletes the earlier run in it; a resume keeps the
    # metrics rows its checkpoint covers
    common.on_rank0(lambda: common.take_over_out_dir(run), run.rank)
    if master:
        announce(run)
    with common.extra("hangs").named(run):  # a rank that stops answering: named
        # an epoch saved at its end, then stopped before its evaluation: that first
        if position.pending_row:
            evaluate_and_log(run)
        failsafe.STOP.catch()  # from here on, a stop signal saves and stops every rank at one step
        for epoch in range(position.epoch, args.epochs):
            if position.step >= end:  # --max-steps
                break
            position.start_epoch(epoch)
            run.progress.start_epoch()
            train_loss, grad_norm = train_one_epoch(run, epoch).tolist()
            # [dp] one process holds the model's only copy: no BatchNorm statistics to broadcast
            position.pending_row = run.progress.epoch_row(  # [dp]
                train_loss=train_loss, world_size=run.world_size, gpus=run.gpus,
                grad_norm=grad_norm if args.clip_grad else None)
            save(run)  # before the evaluation: a stop during it loses no training
            evaluate_and_log(run)


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.one_process = ("is one process that drives every GPU "  # [dp]
                          "(one process per GPU: ddp_launch_train.py)")
    parser.collectives = False  # [dp] no process group: it may train on MPS
    parser.add_argument("--gpus",  # [dp]
                        help="GPU numbers among the visible ones, e.g. 0,1; if not given, all")
    parser.add_argument("--output-device", type=int,
                        help="the GPU that gathers (if not given, the first)")  # [dp]
    parser.add_argument("--gather-outputs", action="store_true",
                        help="the classic way: loss on one GPU")  # [dp]
    # [dp] one process, no process group: no --backend, --sync-bn or launcher's --local-rank
    failsafe.run_and_exit(main, parser.parse_args)
