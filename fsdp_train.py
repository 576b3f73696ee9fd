"""Fully sharded data parallel (FSDP2: torch.distributed.fsdp.fully_shard), one process per GPU, started by a launcher
that tells each process who it is.

    torchrun --nproc_per_node=4 fsdp_train.py                           # one machine, 4 GPUs (or 4 CPU processes)
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST0 --master_port=29500 --nproc_per_node=8 fsdp_train.py
    srun --ntasks-per-node=8 python fsdp_train.py                       # SLURM, inside an allocation
    python fsdp_train.py                                                # one process

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; srun sets SLURM_PROCID, SLURM_STEP_NUM_TASKS and
SLURM_LOCALID. Each process trains on its shard of every global batch, as with DDP, but holds only 1/N of the
parameters, gradients and optimizer state: each block's parameters are all-gathered just before its forward (and again
before its backward), its gradients reduce-scattered to the ranks that own them, and each rank steps the optimizer on
its own shard.
"""
import argparse
import datetime
import math
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import common

NEVER = 2**62  # "no step yet" for the first NaN/inf step


def launcher_env():
    """(rank, world_size, local_rank, local_world_size): from torchrun, from srun, or a lone process."""
    env = os.environ
    if "RANK" in env:  # torchrun, also torchrun inside an srun step
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", 1))
    if "SLURM_STEP_NUM_TASKS" in env:  # a task of srun. (sbatch's batch script also has SLURM_PROCID and
        # SLURM_NTASKS, but it is one process: waiting there for the other ranks would wait forever)
        tasks_per_node = [int(n) for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", env["SLURM_STEP_TASKS_PER_NODE"])
                          for n in [count] * int(times or 1)]
        env.setdefault("MASTER_ADDR", re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", env["SLURM_STEP_NODELIST"]).group(0).replace("[", ""))
        env.setdefault("MASTER_PORT", str(15000 + int(env["SLURM_JOB_ID"]) % 20000))  # the same on every node, per job
        return (int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"]),
                tasks_per_node[int(env["SLURM_NODEID"])])
    return 0, 1, 0, 1


def main(args, rank, world_size, local_rank, local_world_size):
    # ---- setup: pick this process's device, then join the process group
    common.check_args(args)
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    backend = args.backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise common.UsageError("--backend nccl needs CUDA GPUs; use gloo on CPU")
    if backend == "nccl" and local_world_size > torch.cuda.device_count():
        raise common.UsageError(f"{local_world_size} processes on this machine but {torch.cuda.device_count()} GPUs: "
                                "NCCL needs one GPU per process (gloo can share one)")
    if args.sync_bn:
        raise common.UsageError("--sync-bn is not supported with FSDP here (fully_shard does not handle SyncBatchNorm):"
                                " use ddp_launch_train.py --sync-bn, or a model with GroupNorm/LayerNorm")
    if args.precision == "fp16":
        raise common.UsageError("--precision fp16 is not supported: use bf16, which has fp32's range and needs no "
                                "GradScaler (fp16 under FSDP would need a sharded grad scaler)")
    if args.precision not in ("fp32", "bf16"):
        raise common.UsageError(f"unknown --precision {args.precision!r}: choose fp32 or bf16")
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    common.set_cpu_threads(local_world_size)
    common.set_fast_math(device, args.deterministic)
    timeout = datetime.timedelta(minutes=10)  # a dead peer ends the run with an error instead of a hang
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun: meet on its store, under a prefix fresh for every restart attempt (see common.torchrun_store)
        store = common.torchrun_store(rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif world_size == 1 and "MASTER_ADDR" not in os.environ:  # a lone process needs no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:  # srun, or any launcher that sets MASTER_ADDR/MASTER_PORT
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    master = rank == 0  # only rank 0 prints and writes files
    out_dir = args.out_dir or os.path.join("runs", "fsdp_train")

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

    # ---- model: build it the same on every rank, then shard it: each rank keeps its 1/N of every parameter
    torch.manual_seed(args.seed)
    raw_model = common.make_model(args.model, train_set.channels, train_set.classes)
    if args.pretrained:  # one process per machine downloads them into the torch hub cache, then every rank reads them
        common.on_rank0(lambda: common.fetch_pretrained(args.model), local_rank)
        raw_model, note = common.load_pretrained(raw_model, args, train_set)
        if master:
            print(note)
    # rank 0 reads the weights; FSDP2 does not broadcast at wrapping: set_model_state_dict sends them to every shard
    weights = None
    if args.weights:  # any head size or channel count: what matches by name and shape is loaded
        weights = common.on_rank0(lambda: common.load_weights(raw_model, args, train_set), rank)
    if args.freeze_backbone:  # before sharding: the sharded parameters keep requires_grad
        common.freeze_backbone(raw_model, args, train_set)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    raw_model.to(device, memory_format=memory_format)
    shard(raw_model, init_device_mesh(device.type, (world_size,)), args.precision, args.reshard_after_forward)
    if args.weights:
        set_model_state_dict(raw_model, weights if master else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del weights
    model = raw_model  # fully_shard works in place: raw_model is the sharded model
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
        print(f"fsdp: {world_size} processes, backend {backend}, device {device.type}, global batch "
              f"{global_batch}, {args.precision}, {'' if args.reshard_after_forward else 'no '}reshard after forward, "
              f"{local_bytes(raw_model.parameters()) / 2**20:.1f} MiB of parameters per rank"
              + (f", resuming at step {step}" if step else ""))

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
    first_step_time = grad_bytes = None
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
            for xm, ym in zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum)):
                # every micro-batch reduce-scatters its gradients into the sharded .grad, where they add up. Skipping
                # that (set_requires_gradient_sync(False), FSDP's no_sync) would save communication but keep
                # full-size gradients on every rank, which is what FSDP is here to avoid
                loss = F.cross_entropy(model(xm).float(), ym) / args.grad_accum  # bf16 logits: the loss in fp32
                loss.backward()
                step_loss += loss.detach()
            optimizer.step()
            scheduler.step()
            if grad_bytes is None:  # gradients exist from backward to zero_grad: measure them there, once
                grad_bytes = local_bytes(p.grad for p in raw_model.parameters() if p.grad is not None)
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
        # after training, ranks hold different BatchNorm running statistics: give everyone rank 0's (the saved ones).
        # FSDP2 shards parameters only: buffers stay whole on every rank and are never synchronized (DDP broadcasts
        # rank 0's at every forward)
        for buffer in raw_model.buffers():
            dist.broadcast(buffer, src=0)
        t1 = time.time()
        # rank 0 holds the most validation samples (ranks take every world_size-th one), so the most batches
        val_batches = math.ceil(len(range(0, len(val_set), world_size)) / args.batch_size)
        val_loss, val_acc, val_count = evaluate(raw_model, val_loader, device, memory_format, val_batches)
        eval_time = time.time() - t1

        # ---- save
        finished = step_in_epoch == steps_per_epoch
        if master:
            row = {"epoch": epoch + 1 if finished else epoch + step_in_epoch / steps_per_epoch, "step": step,
                   "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc, "val_count": val_count,
                   "lr": scheduler.get_last_lr()[0], "samples_per_s": (step - t0_step) * global_batch / max(train_time, 1e-9),
                   "epoch_time_s": train_time, "eval_time_s": eval_time, "first_step_time": first_step_time,
                   "world_size": world_size, "peak_mem_mb": common.peak_memory_mb(device),
                   # what rank 0 holds between steps; its shards are the largest (the first ranks get ceil(n/N) rows)
                   "param_bytes": local_bytes(raw_model.parameters()), "grad_bytes": grad_bytes,
                   "optim_bytes": local_bytes(v for state in optimizer.state.values() for v in state.values()
                                              if torch.is_tensor(v)),
                   "precision": args.precision, "reshard_after_forward": args.reshard_after_forward}
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
    # no rank tears its process group down while a peer may still be finishing the last all-gathers (of the save)
    dist.barrier()


def shard(model, mesh, precision, reshard_after_forward):
    """fully_shard bottom-up: each top-level child that holds parameters becomes a group of its own (cnn: conv1, conv2,
    fc1, fc2; resnet: conv1, layer1..layer4, fc), whose parameters are all-gathered in one collective just before it
    runs; then the root, whose group takes what is left.

    bf16: parameters are all-gathered and computed in bfloat16, gradients reduced in fp32. BatchNorm is the exception:
    each BatchNorm layer is a group of its own that computes in fp32 (its input is cast up, its weights stay fp32 like
    its running statistics) and hands bf16 on to the next layer. (torch 2.15's param_dtype_override_fn would keep the
    BatchNorm weights fp32 without a group each; it does not exist on 2.11-2.14.)"""
    mp = MixedPrecisionPolicy()
    if precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=fp32)
    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm, torch.nn.LayerNorm)
    for child in model.children():
        if next(child.parameters(), None) is not None and not isinstance(child, norms):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)


def local_bytes(tensors):
    """Bytes this rank holds of these tensors: of a DTensor (a sharded parameter, its gradient or optimizer state)
    only its local shard."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


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
def evaluate(model, loader, device, memory_format, batches):
    """Loss and accuracy over the whole validation set: each rank sums over its shard, then one all-reduce.

    Under FSDP every forward is a collective: each group all-gathers its parameters from all ranks. So every rank
    must run the same number of forwards, `batches`, or one would wait forever for a peer that has finished. Ranks
    take every world_size-th sample, so one may have a batch fewer than rank 0 (or none at all, with fewer samples
    than ranks): it runs the missing forwards on a dummy batch (one real sample) and leaves them out of the sums,
    so each sample is still counted exactly once, as with DDP."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    done = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True)
        out = model(x)
        totals[0] += F.cross_entropy(out.float(), y, reduction="sum")
        totals[1] += (out.argmax(1) == y).sum()
        totals[2] += len(y)
        done += 1
    if done < batches:
        dummy = next(iter(common.make_loader(loader.dataset, [0], 1, False, 0, device)))[0]
        dummy = dummy.to(device, memory_format=memory_format)
        for _ in range(done, batches):
            model(dummy)  # joins the other ranks' all-gathers; its output counts nowhere
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl on GPUs, gloo on CPU")
    parser.add_argument("--sync-bn", action="store_true",
                        help="not supported with FSDP: use ddp_launch_train.py --sync-bn")
    parser.add_argument("--precision", default="fp32",
                        help="fp32, or bf16: parameters all-gathered and computed in bfloat16, gradients reduced and "
                        "the optimizer stepped in fp32 (no GradScaler needed; fp16 is not offered)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="free each block's gathered parameters after its forward and all-gather them again for "
                        "its backward (default: least memory, ZeRO-3). --no-reshard-after-forward keeps them from "
                        "forward to backward (ZeRO-2-like): one all-gather fewer per block and step, for when the full "
                        "parameters fit next to the activations and communication is the bottleneck")
    # the deprecated `python -m torch.distributed.launch` (without --use-env) adds --local-rank=N before the script's
    # own arguments: accepted, not listed, and ignored; the rank comes from LOCAL_RANK, which it also sets
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rank, world_size, local_rank, local_world_size = launcher_env()
    # SIGTERM (SLURM preemption, torchrun stopping its workers): unwind like Ctrl-C, through `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        main(args, rank, world_size, local_rank, local_world_size)
    except (common.UsageError, common.NonFinite) as e:
        if rank == 0:  # every rank raises the same error; one line, once
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, common.UsageError) else 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A finished run leaves without the interpreter's teardown (errors left above, like in the other scripts).
    # DTensor's caches keep the device mesh, and through it the process group and gloo's worker threads, alive after
    # destroy_process_group; a worker still freeing the tensors of a finished collective while Python shuts down
    # aborts the process ("terminate called without an active exception", exit code -6: 1 in about 50 two-process
    # CPU runs). Every file is written and closed by now. Upstream: pytorch/pytorch#190489 (open; an atexit fix,
    # #179291, was abandoned); remove this once a finished run exits 0 in 100 of 100 runs without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
