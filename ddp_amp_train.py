"""DDP with native mixed precision (torch.autocast + torch.amp.GradScaler), replacing NVIDIA Apex.

    torchrun --nproc_per_node=4 ddp_amp_train.py                        # bf16 (default)
    torchrun --nproc_per_node=4 ddp_amp_train.py --precision fp16       # fp16 with loss scaling
    python ddp_amp_train.py --precision fp32                            # one process, no autocast

bf16 keeps fp32's exponent range, so it needs no loss scaling: the default on Ampere+ GPUs and on
CPU. fp16 (older GPUs) underflows small gradients unless the loss is scaled: GradScaler scales it,
skips steps whose gradients overflowed, and adapts the scale, which last.pt keeps (as Apex's
amp.state_dict() did). Launched like ddp_launch_train.py (torchrun, srun, or one process); each
[amp] comment marks a difference from it.
"""
import contextlib
import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

import common
import failsafe


@dataclasses.dataclass(slots=True)
class Run(common.Run):  # [amp] the run's fields, and mixed precision's
    autocast: torch.autocast = None  # the forward's precision
    scaler: torch.amp.GradScaler = None  # the fp16 loss scale (a no-op in bf16 and fp32)


def setup_distributed(args):
    """Finds this process's rank and device, then joins the process group: every rank, before all
    else."""
    # from the launcher's environment (torchrun, by hand; srun, mpirun: train_extras/launchers.py),
    # never a --local-rank flag
    rank, world_size, local_rank, local_world_size, launcher = common.launcher_env()
    # the device's (nccl on GPUs: "cuda:nccl,cpu:gloo", gloo for the CPU's object collectives)
    backend = common.pick_backend(args)
    if args.sync_bn and args.device == "cpu":
        raise failsafe.UsageError("--sync-bn needs a GPU: "
                                  "SyncBatchNorm's forward accepts no CPU tensors")
    if args.precision == "bf16" and args.device == "cuda" and \
            not torch.cuda.is_bf16_supported():  # [amp] pre-Ampere
        raise failsafe.UsageError("this GPU has no bf16: use --precision fp16")
    device = common.local_device(args.device, local_rank)  # made current: NCCL and friends use it
    common.set_threads_and_math(local_world_size, args.deterministic)
    # the ranks join within --step-timeout (a launch mistake: one line then); failsafe.joining then
    # gives the start-up (data, downloads) 10 minutes; from the first step on, --step-timeout again
    timeout, env = datetime.timedelta(seconds=args.step_timeout), os.environ
    store = None  # env://: rank 0's store (or torchrun's) at MASTER_ADDR:MASTER_PORT
    if world_size == 1:  # a lone process: no network, whatever MASTER_ADDR says
        store = dist.HashStore()
    elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and \
            int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:  # torchrun --max-restarts
        store = common.optional("restart", "torchrun --max-restarts").torchrun_store(
            rank, world_size, timeout)  # each attempt meets under a key prefix of its own
    with failsafe.joining(args.step_timeout):  # past it, one line (a launch mistake)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        failsafe.same_flags(args)  # one run: no rank trains with other flags than rank 0's
    return Run(args=args, rank=rank, world_size=world_size, local_rank=local_rank,  # [amp]
               device=device, launcher=launcher or "python")


def build_data(run):
    """Shards the data: every rank draws the same global order and trains on its part of each global
    batch (a new order every epoch: train_one_epoch's set_epoch); every validation sample is on
    one rank, once."""
    args = run.args
    # rank 0 first, the one that may download: N processes never write the same files at once
    run.train_set, val_set = common.load_data_rank0_first(args, run.rank)
    # drop_last: every rank gets the same number of batches, so none waits in an all-reduce for a
    # batch that never comes
    run.sampler = DistributedSampler(run.train_set, run.world_size, run.rank, shuffle=True,
                                     seed=args.seed, drop_last=True)
    run.steps_per_epoch = len(run.sampler) // (args.batch_size * args.grad_accum)
    if run.steps_per_epoch == 0:
        raise failsafe.UsageError(f"{len(run.train_set)} training samples are less than one global "
                                  f"batch ({args.batch_size * args.grad_accum * run.world_size})")
    val_batches = list(BatchSampler(range(run.rank, len(val_set), run.world_size),
                                    args.batch_size, False))
    run.val_loader = common.make_loader(val_set, val_batches, run)  # no padding duplicates


def build_model(run):
    """Builds one model on every rank, then wraps it: DDP broadcasts rank 0's weights (read there
    only, by --weights)."""
    args = run.args
    torch.manual_seed(args.seed)
    run.raw_model = common.make_model(args, run.train_set)
    run.raw_model = common.extra("finetune").prepare(run.raw_model, run)  # --weights and the like
    run.raw_model.to(run.device, memory_format=torch.channels_last if args.channels_last
                     else torch.preserve_format)
    if args.sync_bn:  # normalize over the global batch instead of each GPU's part of it
        run.raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(run.raw_model)
    run.model = DDP(run.raw_model,
                    device_ids=[run.device.index] if run.device.type == "cuda" else None,
                    gradient_as_bucket_view=True,  # gradients are views into its buckets: no copy
                    find_unused_parameters=args.find_unused_parameters)  # if some go unused: slower
    if args.compile:
        run.model = torch.compile(run.model)
    run.optimizer, run.scheduler = common.make_optimizer(args, run.raw_model, run.steps_per_epoch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16,
             "fp32": torch.float32}[args.precision]  # [amp]
    run.autocast = torch.autocast(run.device.type, dtype, enabled=args.precision != "fp32")  # [amp]
    run.scaler = torch.amp.GradScaler(run.device.type,
                                      enabled=args.precision == "fp16")  # [amp] only fp16 needs it


def resume(run):
    """Loads the checkpoint that rank 0 reads and checks, sent to the others (no shared filesystem
    needed); returns the position it saved, or None for a fresh start."""
    ckpt = common.on_rank0(lambda: common.checkpoint_to_resume(run), run.rank)
    # all but the tensors travel as one object; an optimizer state that holds no tensor (SGD
    # without momentum) travels with them: torch's broadcast of state dicts fails on it
    meta = [{k: v for k, v in ckpt.items() if k != "model" and (k != "optimizer" or not v["state"])}
            if ckpt else None]
    dist.broadcast_object_list(meta, src=0)
    if meta[0]:
        # two calls, not set_state_dict: given empty dicts on ranks > 0, that one skips the model
        # there and hangs
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        model_state, optimizer_state = {}, {}  # rank 0 sends them, the others receive
        if run.rank == 0:
            model_state, optimizer_state = ckpt["model"], ckpt["optimizer"]
        set_model_state_dict(run.raw_model, model_state, options=options)
        # an optimizer state that holds no tensor came with the meta, on every rank already
        tensorless = meta[0].get("optimizer")
        if tensorless:
            set_optimizer_state_dict(run.raw_model, run.optimizer, tensorless)
        else:
            set_optimizer_state_dict(run.raw_model, run.optimizer, optimizer_state, options=options)
        run.scheduler.load_state_dict(meta[0]["scheduler"])
        # dropout etc. draw from each rank's generators: as they were, to go on as if never stopped
        common.restore_rng(meta[0], run)
        if meta[0].get("scaler"):  # [amp] none from another script or precision: a fresh scale
            run.scaler.load_state_dict(meta[0]["scaler"])
    return meta[0]


def train_step(run, x, y):
    """Takes one optimizer step over --grad-accum micro-batches; returns its loss and, with
    --clip-grad, the gradients' norm before clipping, on the device (no host sync)."""
    step_loss, accum = torch.zeros((), device=run.device), run.args.grad_accum
    for micro, (xm, ym) in enumerate(zip(common.micro_batches(x, accum), y.chunk(accum))):
        # no_sync: accumulate locally; all-reduce only once, with the step's last micro-batch
        with run.model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            with run.autocast:  # [amp] matmuls/convs in 16 bits; reductions (softmax, loss) in fp32
                loss = F.cross_entropy(run.model(xm), ym) / accum
            run.scaler.scale(loss).backward()  # [amp] scaled: small fp16 gradients don't flush to 0
        step_loss += loss.detach()
    if run.args.clip_grad:  # [amp]
        run.scaler.unscale_(run.optimizer)  # [amp] true gradients are clipped, not the scaled ones
    norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.args.clip_grad) \
        if run.args.clip_grad else None
    run.scaler.step(run.optimizer)  # [amp] unscales; no step on an inf/NaN gradient (fp16 overflow)
    run.scaler.update()  # [amp]
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
    batches = list(BatchSampler(run.sampler, args.batch_size * args.grad_accum, drop_last=True))
    # resumed mid-epoch: skip the batches already done
    loader = common.make_loader(run.train_set, batches[position.step_in_epoch:], run)
    run.raw_model.train()
    for x, y in loader:
        # every rank has passed its start-up (its first step, whose check is a collective): from
        # here on a collective waits --step-timeout at most
        if position.step == position.start_step + 1:
            failsafe.set_timeout(args.step_timeout)
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


def mean_over_ranks(t):
    t = t.clone()  # a copy: the running sums go on
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def evaluate(run):
    """Returns the validation figures (loss, accuracy, count): each rank sums its shard of the
    unwrapped model's outputs (no DDP, no compile), then all-reduce."""
    run.raw_model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss sum, correct, count
    for x, y in run.val_loader:
        x, y = common.to_device(run, run.val_loader.dataset, x, y)
        with run.autocast:  # [amp] evaluated as trained
            out = run.raw_model(x)
        totals[0] += F.cross_entropy(out.float(), y, reduction="sum")
        totals[1] += (out.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)
    return common.validation_row(totals)


def save(run):
    """Saves: every rank joins (the sums are averaged, the random generators gathered); rank 0
    writes the training state to last.pt: plain names, whole tensors, every rank's generators. It
    loads in any script, at any number of processes, with or without a GPU, and into a plain model
    with weights_only=True."""
    sums = mean_over_ranks(run.position.sums).tolist()
    rngs = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(common.rng_state(run.device), rngs)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole, on rank 0's CPU
    model_state, optim_state = get_state_dict(run.raw_model, run.optimizer, options=options)
    state = {"model": model_state, "optimizer": optim_state,
             "scheduler": run.scheduler.state_dict(), **run.position.state(sums), "rng": rngs,
             "args": vars(run.args), "world_size": run.world_size,
             "scaler": run.scaler.state_dict()}  # [amp] the loss scale
    # rank 0 writes; if it fails (a full disk), every rank stops with its line: none waits for it.
    # A stop the ranks agreed on ends the run there, saved
    common.write_and_end_if_stopped(run, state)


def evaluate_and_log(run):
    """Evaluates, then logs rank 0's metrics row (a failed write stops every rank). A stop that
    came during the evaluation ends the run after it (common.log_and_end_if_stopped): the epoch was
    saved before it."""
    t1 = time.time()
    row = {**run.position.pending_row, **evaluate(run), "eval_time_s": time.time() - t1}
    common.log_and_end_if_stopped(run, row)


def announce(run):
    """Prints rank 0's first line: how the run is set up, and the step a resume starts at."""
    args = run.args  # [amp]
    print(f"ddp {args.precision}: {run.world_size} "  # [amp]
          f"process{'es' if run.world_size > 1 else ''}, backend {dist.get_backend()}, device "
          f"{run.device.type}, global batch {run.global_batch}, started by {run.launcher}"
          + (f", resuming at step {run.position.step}" if run.position.step else ""))


def main(args):
    common.extra("workers").fork_server(args)  # for DataLoader workers, before any thread
    run = setup_distributed(args)
    master = run.rank == 0  # only rank 0 prints and writes files
    run.out_dir = args.out_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(__file__))[0])
    common.on_rank0(lambda: failsafe.check_out_dir(run), run.rank)  # a used one: refused now
    run.global_batch = args.batch_size * args.grad_accum * run.world_size
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
            # after training, ranks hold different BatchNorm running statistics: give everyone
            # rank 0's (the saved ones)
            for buffer in run.raw_model.buffers():
                dist.broadcast(buffer, src=0)
            position.pending_row = run.progress.epoch_row(
                train_loss=train_loss, world_size=run.world_size,
                grad_norm=grad_norm if args.clip_grad else None)
            save(run)  # before the evaluation: a stop during it loses no training
            evaluate_and_log(run)


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.add_argument("--backend", choices=["gloo", "nccl", "xccl"],
                        help="default: the device's (torch's mapping)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="SyncBatchNorm: statistics over the global batch")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="a model that does not use every parameter in every step "
                             "(else DDP fails at step 2: 'Expected to have finished reduction')")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"],  # [amp]
                        help="bf16 (no loss scaling; Ampere+ GPUs, CPU), "
                             "fp16 (GradScaler; older GPUs) or fp32")
    failsafe.run_and_exit(main, parser.parse_args)
