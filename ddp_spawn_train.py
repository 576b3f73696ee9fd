"""DDP with torch.multiprocessing.spawn: one command starts every process of this machine.

    python ddp_spawn_train.py  # one process per GPU, or 2 CPU processes where there is no GPU
    python ddp_spawn_train.py --nprocs 4

The parent checks the flags, picks a free port, starts --nprocs children and waits. Several
machines: use ddp_launch_train.py (torchrun, srun), which this script copies but for the lines
marked [spawn].
"""
import contextlib
import datetime
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

import common
import failsafe


def setup_distributed(args):  # [spawn]
    """Finds this child's rank (RANK: its number among the children) and device, then joins the
    process group: every rank, before all else (env://: rank 0 holds the store at MASTER_ADDR:PORT,
    which the parent set)."""
    rank, world_size = int(os.environ["RANK"]), args.nprocs
    device = common.local_device(args.device, rank)  # and made current: NCCL and friends use it
    common.set_threads_and_math(world_size, args.deterministic)
    # the ranks join within --step-timeout, then have 10 minutes for the start-up (data, downloads),
    # then --step-timeout again
    timeout = datetime.timedelta(seconds=args.step_timeout)
    with failsafe.joining(args.step_timeout):  # past it, one line
        dist.init_process_group(args.backend, rank=rank, world_size=world_size, timeout=timeout)
    return common.Run(args=args, rank=rank, world_size=world_size, local_rank=rank,
                      device=device, launcher="mp.spawn")


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
    return meta[0]


def train_step(run, x, y):
    """Takes one optimizer step over --grad-accum micro-batches; returns its loss and, with
    --clip-grad, the gradients' norm before clipping, on the device (no host sync)."""
    step_loss, accum = torch.zeros((), device=run.device), run.args.grad_accum
    for micro, (xm, ym) in enumerate(zip(common.micro_batches(x, accum), y.chunk(accum))):
        # no_sync: accumulate locally; all-reduce only once, with the step's last micro-batch
        with run.model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
            loss = F.cross_entropy(run.model(xm), ym) / accum
            loss.backward()  # the last micro-batch's: DDP's all-reduce overlaps it
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
             "args": vars(run.args), "world_size": run.world_size}
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
    print(f"ddp: {run.world_size} process{'es' if run.world_size > 1 else ''}, backend "
          f"{dist.get_backend()}, device {run.device.type}, global batch {run.global_batch}, "
          f"started by {run.launcher}"
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



def prepare(args):
    """Checks in the parent, before any child starts, and fills in --nprocs, --backend and
    MASTER_ADDR/PORT for them."""
    args.nprocs = args.nprocs or (torch.accelerator.device_count() if args.device != "cpu" else 2)
    args.backend = common.pick_backend(args)  # the device's: nccl on GPUs, gloo on the CPU
    if args.sync_bn and args.device == "cpu":
        raise failsafe.UsageError("--sync-bn needs a GPU: "
                                  "SyncBatchNorm's forward accepts no CPU tensors")
    args.out_dir = args.out_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(__file__))[0])
    run = common.Run(args=args, rank=0, world_size=args.nprocs, local_rank=0,
                     device=torch.device("cpu"), out_dir=args.out_dir)
    failsafe.check_out_dir(run)  # a used --out-dir, refused before the children start
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:  # a free port, never a hard-coded one that another job may hold
        s.bind(("", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))


def launch(args):
    """Starts the children from the parent, passes the stop signals on to them (a scheduler signals
    this process only) and waits. A child that fails ends the others (mp.spawn's join), and its exit
    status is the parent's. Ctrl-C, which a terminal sends to every process, only the parent takes:
    the first is a SIGTERM to the children, a second kills them."""
    prepare(args)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the children start ignoring it (pass_on below)
    failsafe.start_resource_tracker()  # the children's, deaf: a job's stop signal reaches it too
    interrupted = mp.get_context("spawn").Value("i", 0, lock=False)  # Ctrl-Cs so far
    children = mp.spawn(child, args=(args, interrupted), nprocs=args.nprocs, join=False)

    def pass_on(signum, _):
        if signum == signal.SIGINT:  # Ctrl-C: a SIGTERM to the children; a second: killed
            interrupted.value += 1
            signum = signal.SIGTERM if interrupted.value == 1 else getattr(signal, "SIGKILL", 15)
        for c in children.processes:
            if c.is_alive():
                os.kill(c.pid, signum)
    for signum in failsafe.STOP_SIGNALS:  # SIGUSR1, SIGTERM, SIGHUP, SIGINT (Windows: no SIGUSR1)
        signal.signal(signum, pass_on)
    try:
        # a child failed: the others' own way out first, then SIGTERM
        while not children.join(grace_period=10):
            pass
    except mp.ProcessExitedException as e:
        # the child said why (129, 143: stopped by a signal); else: say so
        if e.exit_code not in (1, 2, 3, 129, 143):
            print(f"error: {e}", file=sys.stderr, flush=True)
        if interrupted.value:  # Ctrl-C
            sys.exit(130)
        if e.exit_code < 0:  # killed by a signal
            sys.exit(1)
        sys.exit(e.exit_code)
    finally:  # Ctrl-C, or an error of the parent's own: no child left running
        for c in children.processes:
            if c.is_alive():
                c.terminate()
            c.join()


def child(rank, args, interrupted):
    """Runs child `rank` (in RANK for setup_distributed, as a launcher would set it)."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(args.nprocs)
    failsafe.STOP.interrupted = interrupted  # its stop line names Ctrl-C, not the SIGTERM for it
    failsafe.run_and_exit(main, lambda: args)


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.one_process = ("starts its own processes "  # [spawn]
                          "(under a launcher: ddp_launch_train.py)")
    parser.add_argument("--nprocs", type=common.number(int, 1),  # [spawn]
                        help="if not given: 1 per GPU, or 2 on CPU")
    parser.add_argument("--backend", choices=["gloo", "nccl", "xccl"],
                        help="default: the device's (torch's mapping)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="SyncBatchNorm: statistics over the global batch")
    parser.add_argument("--find-unused-parameters", action="store_true",
                        help="a model that does not use every parameter in every step "
                             "(else DDP fails at step 2: 'Expected to have finished reduction')")
    # [spawn] no launcher starts it: no --local-rank
    failsafe.run_and_exit(launch, parser.parse_args)  # [spawn] the parent: starts the children
