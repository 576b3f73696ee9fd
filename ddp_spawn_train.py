"""DistributedDataParallel with torch.multiprocessing.spawn: one command starts all processes of this machine.

    python ddp_spawn_train.py                # one process per GPU, or 2 CPU processes where there is no GPU
    python ddp_spawn_train.py --nprocs 4

The parent picks a free port on 127.0.0.1 (unless MASTER_ADDR/MASTER_PORT are set), starts --nprocs children and
waits; a child that fails ends the others. For several machines, use ddp_launch_train.py with torchrun or srun.
"""
import contextlib
import datetime
import functools
import math
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import common


def check_setup(args):
    """(use_cuda, backend, nprocs), or a UsageError: checked in the parent, before any child starts."""
    common.validate(args)
    if common.launched_as_one_of_several():
        raise common.UsageError(f"ddp_spawn_train.py starts its own processes: start it with python, not "
                                f"{common.launched_as_one_of_several()} (under a launcher: ddp_launch_train.py)")
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    nprocs = args.nprocs or (torch.cuda.device_count() if use_cuda else 2)
    if nprocs < 1:
        raise common.UsageError(f"--nprocs must be at least 1, got {nprocs}")
    if backend == "nccl" and not use_cuda:
        raise common.UsageError("--backend nccl needs CUDA GPUs; use gloo on CPU")
    if backend == "nccl" and nprocs > torch.cuda.device_count():
        raise common.UsageError(f"--nprocs {nprocs} but {torch.cuda.device_count()} GPUs: "
                                "NCCL needs one GPU per process (gloo can share one)")
    if args.sync_bn and not use_cuda:
        raise common.UsageError("--sync-bn needs CUDA: SyncBatchNorm's forward accepts GPU tensors only")
    return use_cuda, backend, nprocs


def setup_distributed(rank, world_size, args):  # [spawn]
    """This child's device, then the process group, which every rank joins before anything else. The parent checked
    the flags and set MASTER_ADDR/MASTER_PORT; the rank is the child's number. Returns the device."""
    use_cuda, backend, _ = check_setup(args)
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_cpu_threads(world_size)
    common.set_fast_math(device, args.deterministic)
    if backend == "nccl":  # a timeout then dumps every rank's last collectives (common.nccl_flight_recorder)
        common.nccl_flight_recorder()
    timeout = datetime.timedelta(minutes=10)  # a dead peer ends the run with an error instead of a hang
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    return device


def build_data(args, rank, world_size, device):
    """Every rank draws the same global order and trains on its own part of each global batch; every validation
    sample is on exactly one rank. Returns (train_set, sampler, train_loader, val_loader)."""
    # rank 0 downloads and builds first, alone, so that N processes never write the same files at once; then the others
    train_set, val_set = common.on_rank0(lambda: common.load_data(args, download=True), rank) or common.load_data(args)
    # drop_last: every rank gets the same number of batches, so none waits in an all-reduce for a batch that never comes
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    train_loader = common.make_loader(train_set, sampler, args.batch_size * args.grad_accum, True, args.workers, device)
    # validation: every sample exactly once over all ranks (no padding duplicates, unlike DistributedSampler's)
    val_shard = range(rank, len(val_set), world_size)
    val_loader = common.make_loader(val_set, val_shard, args.batch_size, False, args.workers, device)
    if len(train_loader) == 0:
        raise common.UsageError(f"{len(train_set)} training samples are less than one global batch "
                                f"({args.batch_size * args.grad_accum * world_size})")
    return train_set, sampler, train_loader, val_loader


def build_model(args, train_set, device, memory_format, rank, local_rank):
    """The same model on every rank, weights read on rank 0 only, then wrapped: DDP broadcasts rank 0's weights.
    Returns (raw_model, model): the plain module (to save, to evaluate) and the wrapped one (to train)."""
    torch.manual_seed(args.seed)
    channels, classes = common.channels_and_classes(train_set)
    raw_model = common.make_model(args.model, channels, classes)
    if args.pretrained:  # one process per machine downloads them into the torch hub cache, then every rank reads them
        common.on_rank0(lambda: common.fetch_pretrained(args.model), local_rank)
        raw_model, note = common.load_pretrained(raw_model, args.model, channels, classes)
        if rank == 0:
            print(note)
    if args.weights:  # any head size or channel count: what matches by name and shape is loaded
        common.on_rank0(lambda: raw_model.load_state_dict(common.load_weights(raw_model, args, channels, classes)),
                        rank)
    if args.freeze_backbone:  # before DDP, which then leaves the frozen parameters out (no find_unused_parameters)
        common.freeze_backbone(raw_model, args.model, channels, classes)
    raw_model.to(device, memory_format=memory_format)
    if args.sync_bn:  # normalize over the global batch instead of each GPU's part of it
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if args.compile:
        model = torch.compile(model)
    return raw_model, model


def resume(args, raw_model, optimizer, scheduler, out_dir, global_batch, rank, device):
    """Rank 0 picks and reads the checkpoint; the others receive it (no shared filesystem needed). Returns the
    progress it saved, or None for a fresh start."""
    ckpt = common.on_rank0(lambda: common.find_checkpoint(args.resume, out_dir, raw_model, args.freeze_backbone,
                                                          global_batch), rank)
    meta = [{k: v for k, v in ckpt.items() if k not in ("model", "optimizer")} if ckpt else None]
    dist.broadcast_object_list(meta, src=0)
    if meta[0] and "sharded" in meta[0]:  # a ckpt-<step> folder: each rank reads what this run's layout holds
        common.load_sharded(meta[0]["sharded"], raw_model, optimizer)
    elif meta[0]:
        # two calls, not set_state_dict: given empty dicts on ranks > 0, that one skips the model there and hangs
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(raw_model, ckpt["model"] if rank == 0 else {}, options=options)
        set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"] if rank == 0 else {}, options=options)
    if meta[0]:
        scheduler.load_state_dict(meta[0]["scheduler"])
        # dropout and the like draw from each rank's generators: as they were, to go on as if never stopped
        common.restore_rng(meta[0], rank, dist.get_world_size(), args.seed, [device])
    return meta[0]


def train_step(model, x, y, optimizer, scheduler, args):
    """One optimizer step over --grad-accum micro-batches; returns its loss and, with --clip-grad, the gradients'
    norm before clipping, on the device (no host sync)."""
    step_loss = torch.zeros((), device=x.device)
    for micro, (xm, ym) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
        # no_sync: accumulate locally and all-reduce only once, with the last micro-batch of the step
        with model.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
            loss = F.cross_entropy(model(xm), ym) / args.grad_accum
            loss.backward()  # DDP averages the gradients over the ranks here, overlapped with the backward pass
        step_loss += loss.detach()
    norm = common.clip_grad_norm(optimizer, args.clip_grad) if args.clip_grad else None  # of the summed gradients
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, norm


def train_one_epoch(model, loader, optimizer, scheduler, progress, args, device, memory_format, checkpoint, watch):
    """One pass over this rank's part of the data (what is left of it, when resumed mid-epoch); returns the mean
    loss over its steps and the ranks."""
    common.train_mode(model, args.freeze_backbone)  # a frozen backbone's BatchNorm stays in eval mode
    loader.batches.skip = progress.step_in_epoch  # a resumed epoch skips the batches it had already trained on
    bar = common.progress_bar(progress, dist.get_rank() == 0)  # rank 0's: a tqdm bar, or plain lines in a log file
    for x, y in progress.timed(loader):  # counts the time spent waiting for data
        x, y = x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True)
        x = loader.normalize(x)  # image files come as uint8, 4x fewer bytes to copy: made float here, on the device
        progress.step_done(*train_step(model, x, y, optimizer, scheduler, args))
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


def check_finite(first_bad):
    """Every rank learns the first NaN/inf step of any rank: one all-reduce and host sync, every --log-every steps."""
    bad = first_bad.clone()
    dist.all_reduce(bad, op=dist.ReduceOp.MIN)
    if bad.item() != common.NEVER:
        raise common.NonFinite(f"loss is NaN/inf at step {int(bad.item()) + 1}: stopped, the last checkpoint is older")


def mean_over_ranks(t):
    t = t.clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device, memory_format):
    """Loss and accuracy over the whole validation set: each rank sums over its shard, then one all-reduce."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True)
        x = loader.normalize(x)
        out = model(x)
        totals[0] += F.cross_entropy(out.float(), y, reduction="sum")
        totals[1] += (out.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return {"val_loss": loss_sum / count, "val_acc": correct / count, "val_count": int(count)}


def save(out_dir, raw_model, optimizer, scheduler, progress, args, sharded):
    """Every rank joins (the state dicts may gather, the loss is averaged). --ckpt-format file: rank 0 writes the whole
    training state to last.pt: plain names and whole tensors, loadable by any script, any number of processes, with
    or without a GPU. dcp: a ckpt-<step> folder of every rank's part (common.ShardedCheckpoints), which any script
    reads back at any number of processes."""
    state = progress.state(mean_over_ranks(progress.loss_sum))
    rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(common.rng_state([progress.device]), rngs)  # every rank's random number generators
    meta = {"scheduler": scheduler.state_dict(), **state, "rng": rngs, "args": vars(args),
            "world_size": dist.get_world_size()}
    if sharded:  # --ckpt-format dcp: each rank writes the tensors it holds, nothing is gathered
        sharded.save(progress.step, *get_state_dict(raw_model, optimizer), meta)
        return
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU
    model_state, optim_state = get_state_dict(raw_model, optimizer, options=options)
    if dist.get_rank() == 0:
        common.save_atomic({"model": model_state, "optimizer": optim_state, **meta}, os.path.join(out_dir, "last.pt"))


def main(rank, world_size, args):
    common.validate(args)
    device, local_rank = setup_distributed(rank, world_size, args), rank  # [spawn] one machine: local rank = rank
    master = rank == 0  # only rank 0 prints and writes files
    # SIGUSR1 (the time limit is near) or SIGTERM (preemption): noted; every rank then saves at the same step, stops.
    # Agreed on over a gloo group of its own, which leaves the GPU alone (and takes CPU tensors, unlike NCCL)
    watch = common.Watch(dist.new_group(backend="gloo") if world_size > 1 else None, rank, args.step_timeout)
    out_dir = args.out_dir or os.path.join("runs", os.path.splitext(os.path.basename(__file__))[0])
    # --ckpt-format dcp: sharded checkpoints, each rank writing its own part (--async-save: in the background)
    sharded = common.ShardedCheckpoints(out_dir, args.async_save, watch) if args.ckpt_format == "dcp" else None
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    train_set, sampler, train_loader, val_loader = build_data(args, rank, world_size, device)
    raw_model, model = build_model(args, train_set, device, memory_format, rank, local_rank)
    optimizer, scheduler = common.make_optimizer(args, raw_model, len(train_loader))
    global_batch = args.batch_size * args.grad_accum * world_size
    # rank 0 claims --out-dir (no other live run, no last.pt replaced unasked), held until this process ends
    out_lock = common.on_rank0(lambda: common.claim_out_dir(out_dir, args), rank)  # noqa: F841
    saved = resume(args, raw_model, optimizer, scheduler, out_dir, global_batch, rank, device)
    progress = common.Progress(len(train_loader), global_batch, args.max_steps, device, saved)
    checkpoint = functools.partial(save, out_dir, raw_model, optimizer, scheduler, progress, args, sharded)
    if progress.step >= (args.max_steps or math.inf):  # --max-steps is a budget: a resume may find it spent
        if master:
            print(f"already at step {progress.step} of --max-steps {args.max_steps}: nothing to train")
        return
    writer = common.start_output(out_dir, progress, args.tensorboard) if master else None
    if master:
        print(f"ddp: {world_size} processes, backend {dist.get_backend()}, "
              f"device {device.type}, global batch {global_batch}"
              + (f", resuming at step {progress.step}" if progress.step else ""))

    for epoch in range(progress.epoch, args.epochs):
        # set_epoch reshuffles: the same new order on every rank. Forget it and every epoch repeats epoch 0's order
        sampler.set_epoch(epoch)
        progress.start_epoch(epoch)
        train_loss = train_one_epoch(model, train_loader, optimizer, scheduler, progress, args, device, memory_format,
                                     checkpoint, watch)
        # after training, ranks hold different BatchNorm running statistics: give everyone rank 0's (the saved ones)
        for buffer in raw_model.buffers():
            dist.broadcast(buffer, src=0)
        t1 = time.time()
        val = evaluate(raw_model, val_loader, device, memory_format)
        if master:
            row = {"train_loss": train_loss, **val, "lr": scheduler.get_last_lr()[0], "eval_time_s": time.time() - t1}
            common.log_epoch(out_dir, writer, progress, {**row, "world_size": world_size,
                                                         "peak_mem_mb": common.peak_memory_mb(device)})
        checkpoint()
        if progress.step == args.max_steps:
            break
    if sharded:  # the last save, if written in the background, finished
        sharded.wait()


def worker(rank, world_size, args):
    """The body of each child process."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # until common.Watch takes it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # and SIGUSR1, which would kill it: there is nothing to save yet
    try:
        with common.hangs_named():  # a collective timed out: one line, naming the ranks that never arrived
            main(rank, world_size, args)
    except (common.UsageError, common.NonFinite, common.Stopped, common.Hung) as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving anyway: the parent's SIGTERM must not cut this short
        if common.prints(e, rank):  # every rank raises the others alike: once
            print(e if isinstance(e, common.Stopped) else f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized() and not isinstance(e, (common.BadFile, common.Hung)):  # (their peers are not here)
            dist.barrier()  # let rank 0 print before spawn, seeing a child exit, ends the others
        sys.exit(common.exit_code(e))  # the table in docs/failures.md
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # [spawn]
    parser = common.get_parser(__doc__)
    parser.add_argument("--nprocs", type=int, help="number of processes (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--sync-bn", action="store_true",
                        help="SyncBatchNorm: BatchNorm statistics over the global batch (GPU tensors only)")
    args = parser.parse_args()
    try:
        _, _, nprocs = check_setup(args)
    except common.UsageError as e:
        # leaving anyway: a launcher's SIGTERM (torchrun's, once a first copy has exited) must not cut this short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if common.launcher_rank() == 0:  # started by mistake as several copies: one line, once
            print(f"error: {e}", file=sys.stderr)
        else:
            time.sleep(0.5)  # and the first copy says why before the others exit
        sys.exit(2)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free port, never a hard-coded one that another job may hold
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    children = mp.spawn(worker, args=(nprocs, args), nprocs=nprocs, join=False)

    def pass_on(signum, _):  # a scheduler signals the process it started, this one: the children save and stop
        for child in children.processes:
            if child.is_alive():
                os.kill(child.pid, signum)
    signal.signal(signal.SIGUSR1, pass_on)
    signal.signal(signal.SIGTERM, pass_on)  # (Ctrl-C reaches them all: they unwind, never left running as orphans)
    try:
        while not children.join():  # if one child fails, join ends the others and raises
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code not in (1, 2, 3, 143):  # the child said why already (143: stopped by SIGTERM); else: say so
            print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
    finally:
        for child in children.processes:
            if child.is_alive():
                child.terminate()
            child.join()
