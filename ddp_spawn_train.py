"""DistributedDataParallel with torch.multiprocessing.spawn: one command starts all processes of this machine.

    python ddp_spawn_train.py                # one process per GPU, or 2 CPU processes where there is no GPU
    python ddp_spawn_train.py --nprocs 4

The parent picks a free port on 127.0.0.1 (unless MASTER_ADDR/MASTER_PORT are set), starts --nprocs children and
waits; a child that fails ends the others. For several machines, use ddp_launch_train.py with torchrun or srun.
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common

NEVER = 2**62  # "no step yet" for the first NaN/inf step

def check_setup(args):
    """(use_cuda, backend, nprocs), or a UsageError: checked in the parent, before any child starts."""
    common.check_args(args)
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
        raise common.UsageError("--sync-bn needs CUDA: SyncBatchNorm has no CPU implementation")
    return use_cuda, backend, nprocs


def main(rank, world_size, args):
    # ---- setup: pick this process's device, then join the process group (the parent set MASTER_ADDR/PORT)
    use_cuda, backend, _ = check_setup(args)
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_cpu_threads(world_size)
    common.set_fast_math(device, args.deterministic)
    timeout = datetime.timedelta(minutes=10)  # a dead peer ends the run with an error instead of a hang
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    master, local_rank = rank == 0, rank  # only rank 0 prints and writes files; one machine
    out_dir = args.out_dir or os.path.join("runs", "ddp_spawn_train")

    # ---- data: every rank draws the same global order and trains on its own part of each global batch
    # rank 0 downloads first, alone, so that N processes never write the same files at once
    common.on_rank0(lambda: common.load_data(args, download=True), rank)
    train_set, val_set = common.load_data(args)
    # drop_last: every rank gets the same number of batches, so none waits in an all-reduce for a batch that never comes
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    train_loader = common.make_loader(train_set, sampler, args.batch_size * args.grad_accum, True, args.workers, device)
    # validation: every sample exactly once over all ranks (no padding duplicates, unlike DistributedSampler's)
    val_shard = range(rank, len(val_set), world_size)
    val_loader = common.make_loader(val_set, val_shard, args.batch_size, False, args.workers, device)
    steps_per_epoch, global_batch = len(train_loader), args.batch_size * args.grad_accum * world_size
    if steps_per_epoch == 0:
        raise common.UsageError(f"{len(train_set)} training samples are less than one global batch ({global_batch})")

    # ---- model: build it the same on every rank, load weights on rank 0; DDP broadcasts rank 0's at wrapping
    torch.manual_seed(args.seed)
    raw_model = common.make_model(args.model, train_set.channels, train_set.classes)
    if args.pretrained:  # one process per machine downloads them into the torch hub cache, then every rank reads them
        common.on_rank0(lambda: common.fetch_pretrained(args.model), local_rank)
        raw_model, note = common.load_pretrained(raw_model, args, train_set)
        if master:
            print(note)
    if args.weights:  # any head size or channel count: what matches by name and shape is loaded
        common.on_rank0(lambda: raw_model.load_state_dict(common.load_weights(raw_model, args, train_set)), rank)
    if args.freeze_backbone:  # before DDP, which then leaves the frozen parameters out (no find_unused_parameters)
        common.freeze_backbone(raw_model, args, train_set)
    if args.sync_bn:  # normalize over the global batch instead of each GPU's part of it
        raw_model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(raw_model)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    raw_model.to(device, memory_format=memory_format)
    model = DDP(raw_model, device_ids=[device.index] if use_cuda else None, gradient_as_bucket_view=True)
    if args.compile:
        model = torch.compile(model)
    optimizer = common.make_optimizer(args, raw_model)
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, common.lr_schedule(round(args.warmup_epochs * steps_per_epoch), total_steps))

    # ---- resume: rank 0 picks and reads the checkpoint; the others receive it (no shared filesystem needed)
    ckpt = common.on_rank0(lambda: common.find_checkpoint(args.resume, out_dir, raw_model, args.freeze_backbone), rank)
    meta = [{k: v for k, v in ckpt.items() if k not in ("model", "optimizer")} if ckpt else None]
    dist.broadcast_object_list(meta, src=0)
    meta = meta[0] or {"epoch": 0, "step_in_epoch": 0, "loss_sum": 0.0}
    if "scheduler" in meta:
        # two calls, not set_state_dict: given empty dicts on ranks > 0, that one skips the model there and hangs
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(raw_model, ckpt["model"] if master else {}, options=options)
        set_optimizer_state_dict(raw_model, optimizer, ckpt["optimizer"] if master else {}, options=options)
        scheduler.load_state_dict(meta["scheduler"])
    del ckpt
    start_epoch, step_in_epoch = meta["epoch"], meta["step_in_epoch"]
    step = start_epoch * steps_per_epoch + step_in_epoch
    if master:
        os.makedirs(out_dir, exist_ok=True)
        common.append_metrics(out_dir, None, keep_until_epoch=start_epoch)  # a fresh run starts an empty file
        writer = common.tensorboard_writer(out_dir) if args.tensorboard else None
        print(f"ddp: {world_size} processes, backend {backend}, device {device.type}, global batch "
              f"{global_batch}" + (f", resuming at step {step}" if step else ""))

    def save(epoch, step_in_epoch, loss_sum):
        # every rank joins here (state dicts may gather); only rank 0 writes
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
        # set_epoch reshuffles: the same new order on every rank. Forget it and every epoch repeats epoch 0's order
        sampler.set_epoch(epoch)
        train_loader.batches.skip = step_in_epoch  # a resumed epoch skips the batches it had already trained on
        common.train_mode(model, args.freeze_backbone)  # a frozen backbone's BatchNorm stays in eval mode
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # this rank's sum of step losses, this epoch
        if master and epoch == start_epoch:  # a resumed epoch: what the saved part of it added, as if on this rank
            loss_sum += meta["loss_sum"] * world_size
        bar = tqdm(total=steps_per_epoch, initial=step_in_epoch, disable=not master, desc=f"epoch {epoch + 1}",
                   leave=False, file=sys.stdout)
        t0 = None
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True)
            step_loss = torch.zeros((), device=device)
            for micro, (xm, ym) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
                # no_sync: accumulate locally and all-reduce only once, with the last micro-batch of the step
                with model.no_sync() if micro < args.grad_accum - 1 else contextlib.nullcontext():
                    loss = F.cross_entropy(model(xm), ym) / args.grad_accum
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
                check_finite(first_bad, rank)  # all ranks agree on it, so all stop together
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
        # after training, ranks hold different BatchNorm running statistics: give everyone rank 0's (the saved ones)
        for buffer in raw_model.buffers():
            dist.broadcast(buffer, src=0)
        t1 = time.time()
        val_loss, val_acc, val_count = evaluate(raw_model, val_loader, device, memory_format)
        eval_time = time.time() - t1

        # ---- save
        finished = step_in_epoch == steps_per_epoch
        if master:
            row = {"epoch": epoch + 1 if finished else epoch + step_in_epoch / steps_per_epoch, "step": step,
                   "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc, "val_count": val_count,
                   "lr": scheduler.get_last_lr()[0], "samples_per_s": (step - t0_step) * global_batch / max(train_time, 1e-9),
                   "epoch_time_s": train_time, "eval_time_s": eval_time, "first_step_time": first_step_time,
                   "world_size": world_size, "peak_mem_mb": common.peak_memory_mb(device)}
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


def mean_over_ranks(t):
    t = t.clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def check_finite(first_bad, rank):
    """Every rank learns the first NaN/inf step of any rank: one all-reduce and host sync, every --log-every steps."""
    bad = first_bad.clone()
    dist.all_reduce(bad, op=dist.ReduceOp.MIN)
    if bad.item() != NEVER:
        raise common.NonFinite(f"loss is NaN/inf at step {int(bad.item()) + 1}: stopped, the last checkpoint is older")


@torch.no_grad()
def evaluate(model, loader, device, memory_format):
    """Loss and accuracy over the whole validation set: each rank sums over its shard, then one all-reduce."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True)
        out = model(x)
        totals[0] += F.cross_entropy(out.float(), y, reduction="sum")
        totals[1] += (out.argmax(1) == y).sum()
        totals[2] += len(y)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def worker(rank, world_size, args):
    """The body of each child process."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # unwind through `finally`
    try:
        main(rank, world_size, args)
    except (common.UsageError, common.NonFinite) as e:
        if rank == 0:  # every rank raises the same error; one line, once
            print(f"error: {e}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()  # let rank 0 print before spawn, seeing a child exit, ends the others
        sys.exit(2 if isinstance(e, common.UsageError) else 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.add_argument("--nprocs", type=int, help="number of processes (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--sync-bn", action="store_true",
                        help="SyncBatchNorm: BatchNorm statistics over the global batch (CUDA only)")
    args = parser.parse_args()
    try:
        _, _, nprocs = check_setup(args)
    except common.UsageError as e:
        sys.exit(f"error: {e}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # a free port, never a hard-coded one that another job may hold
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    children = mp.spawn(worker, args=(nprocs, args), nprocs=nprocs, join=False)
    # SIGTERM or Ctrl-C to this parent: end the children too, never leave them running as orphans
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        while not children.join():  # if one child fails, join ends the others and raises
            pass
    except mp.ProcessExitedException as e:
        if e.exit_code not in (1, 2):  # 1, 2: the child printed why already; else it was killed: say so
            print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code if e.exit_code and e.exit_code > 0 else 1)
    finally:
        for child in children.processes:
            if child.is_alive():
                child.terminate()
            child.join()
