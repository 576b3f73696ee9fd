"""Fully sharded data parallel (FSDP2: torch.distributed.fsdp.fully_shard), one process per GPU,
started by a launcher that tells each process who it is.

    torchrun --nproc_per_node=4 fsdp_train.py      # one machine, 4 GPUs (or 4 CPU processes)
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST0 --nproc_per_node=8 fsdp_train.py
    srun --ntasks-per-node=8 python fsdp_train.py  # SLURM, inside an allocation
    python fsdp_train.py                           # one process

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; srun sets SLURM_PROCID,
SLURM_STEP_NUM_TASKS and SLURM_LOCALID. Each process trains on its part of every global batch, as
with DDP, but holds 1/N of the parameters, gradients and optimizer state: a block's parameters are
all-gathered just before its forward (and backward), its gradients reduce-scattered to the ranks
that own them, and each rank steps its own shard (docs/fsdp.md).
"""
import argparse
import collections
import dataclasses
import datetime
import math
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import BatchSampler, default_collate
from torch.utils.data.distributed import DistributedSampler

import common
import failsafe


@dataclasses.dataclass(slots=True)
class Run(common.Run):  # [fsdp] the run's fields, and FSDP's
    sharded: object = None  # --ckpt-format dcp's writer (train_extras/sharded.py), or None
    grad_bytes: int = 0  # this rank's part of the gradients, in bytes


def setup_distributed(args):
    """Finds this process's rank and device, then joins the process group: every rank, before all
    else."""
    # from the launcher's environment (torchrun, by hand; srun, mpirun: train_extras/launchers.py),
    # never a --local-rank flag
    rank, world_size, local_rank, local_world_size, launcher = common.launcher_env()
    # the device's (nccl on GPUs: "cuda:nccl,cpu:gloo", gloo for the CPU's object collectives)
    backend = common.pick_backend(args)
    if args.sync_bn:  # [fsdp] on any device
        raise failsafe.UsageError(
            "--sync-bn is not supported with FSDP (fully_shard does not handle SyncBatchNorm): "
            "use ddp_launch_train.py --sync-bn, or a model with GroupNorm/LayerNorm")
    if world_size % args.replicate:  # [fsdp]
        raise failsafe.UsageError(
            f"--replicate {args.replicate} does not divide the {world_size} processes into equal "
            "groups: give a divisor, such as the number of machines")
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
    return Run(args=args, rank=rank, world_size=world_size, local_rank=local_rank,  # [fsdp]
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
    """Builds one model on every rank, sharded in place: each rank keeps 1/N of every parameter."""
    args = run.args
    torch.manual_seed(args.seed)
    run.raw_model = common.make_model(args, run.train_set)
    run.raw_model = common.extra("finetune").prepare(run.raw_model, run)  # --weights and the like
    run.raw_model.to(run.device, memory_format=torch.channels_last if args.channels_last
                     else torch.preserve_format)
    if getattr(args, "weights", None):  # [fsdp] read on rank 0 only; FSDP2 does not broadcast it
        for t in run.raw_model.state_dict().values():
            dist.broadcast(t, 0)
    shard(run.raw_model, make_mesh(run), args.precision, args.reshard_after_forward)  # [fsdp]
    run.model = run.raw_model  # [fsdp] fully_shard works in place
    if args.compile:
        run.model = torch.compile(run.model)
    run.optimizer, run.scheduler = common.make_optimizer(args, run.raw_model, run.steps_per_epoch)


def make_mesh(run):
    """Returns the mesh. 1-D: each rank holds 1/N. HSDP (--replicate R): R copies, each sharded
    over N/R ranks (all-gathers on one machine's fast links), gradients all-reduced across them."""
    r = run.args.replicate
    if r == 1:
        return init_device_mesh(run.device.type, (run.world_size,))
    return init_device_mesh(run.device.type, (r, run.world_size // r),
                            mesh_dim_names=("replicate", "shard"))


def shard(model, mesh, precision, reshard_after_forward):
    """Applies fully_shard bottom-up: each top-level child with parameters of its own a group,
    all-gathered in one collective just before it runs (resnet: conv1, layer1..layer4, fc); then the
    root, for what is left. bf16: parameters gathered and computed in bfloat16, gradients reduced
    in fp32; each BatchNorm a group that computes in fp32 and hands bf16 on."""
    kw, bn = dict(mesh=mesh, reshard_after_forward=reshard_after_forward), \
        torch.nn.modules.batchnorm._BatchNorm
    bf16 = torch.bfloat16 if precision == "bf16" else None  # None: computed as they are, in fp32
    for m in model.modules():
        if bf16 and isinstance(m, bn):
            fully_shard(m, **kw, mp_policy=MixedPrecisionPolicy(
                torch.float32, torch.float32, output_dtype=bf16))
    mp = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32 if bf16 else None)
    # a parameter in two children (a language model's head tied to its embedding) stays with the
    # root: fully_shard refuses one parameter in two groups
    owners = collections.Counter(p for child in model.children() for p in child.parameters())
    for child in model.children():
        params = list(child.parameters())
        if params and all(owners[p] == 1 for p in params) and \
                not isinstance(child, (bn, torch.nn.LayerNorm, torch.nn.GroupNorm)):
            fully_shard(child, **kw, mp_policy=mp)
    fully_shard(model, **kw, mp_policy=mp)


def checkpoint_to_resume(run):
    """Rank 0: returns common.checkpoint_to_resume's, or train_extras/sharded.py's where there are
    ckpt-<step> folders (--ckpt-format dcp; --resume auto: the highest step of them and last.pt)."""
    out_dir = run.out_dir
    folders = os.path.isdir(out_dir) and \
        any(re.fullmatch(r"ckpt-\d+(\.tmp)?", n) for n in os.listdir(out_dir))
    resume = run.args.resume or ""
    if folders or os.path.isdir(resume) and not os.path.isfile(os.path.join(resume, "last.pt")):
        return common.optional("sharded", "a sharded checkpoint (ckpt-<step> folder)").find(run)
    return common.checkpoint_to_resume(run)


def resume(run):
    """Loads the checkpoint that rank 0 reads and checks, sent to the others (no shared filesystem
    needed); returns the position it saved, or None for a fresh start."""
    ckpt = common.on_rank0(lambda: checkpoint_to_resume(run),
                           run.rank)  # [fsdp] last.pt, or a ckpt-<step> folder's meta
    # all but the tensors travel as one object; an optimizer state that holds no tensor (SGD
    # without momentum) travels with them: torch's broadcast of state dicts fails on it
    meta = [{k: v for k, v in ckpt.items() if k != "model" and (k != "optimizer" or not v["state"])}
            if ckpt else None]
    dist.broadcast_object_list(meta, src=0)
    if meta[0] and "sharded" in meta[0]:  # [fsdp] a ckpt-<step> folder
        # each rank reads its part, in this run's layout
        common.optional("sharded", "a sharded checkpoint (ckpt-<step> folder)").load(meta[0], run)
        return meta[0]
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
    # [fsdp] every micro-batch reduce-scatters its gradients into the sharded .grad; FSDP's no_sync
    # (set_requires_gradient_sync(False)) would keep full-size gradients on every rank
    for xm, ym in zip(common.micro_batches(x, accum), y.chunk(accum)):  # [fsdp]
        loss = F.cross_entropy(run.model(xm).float(), ym) / accum  # bf16 logits: the loss in fp32
        loss.backward()
        step_loss += loss.detach()
    # between backward and zero_grad
    run.grad_bytes = local_bytes(
        p.grad for p in run.raw_model.parameters() if p.grad is not None)  # [fsdp]
    norm = clip_grad_norm(run.raw_model.parameters(), run.args.clip_grad) \
        if run.args.clip_grad else None  # [fsdp]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return step_loss, norm


def clip_grad_norm(params, max_norm):
    """Clips the gradients to a global norm (all ranks and shards) of max_norm; returns the norm
    before. A rank's is a DTensor's partial sum, which full_tensor() adds up (torch's
    clip_grad_norm_ returns the partial one: pytorch/pytorch#170862)."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


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
    pad_forwards(run)  # [fsdp] as many forwards as rank 0: under FSDP each one is a collective
    dist.all_reduce(totals)
    return common.validation_row(totals)


def pad_forwards(run):
    """Every forward all-gathers from every rank: a rank with a batch fewer than rank 0 (or none,
    with fewer samples than ranks) runs the missing forwards on one real sample, counted nowhere, or
    rank 0 would wait forever."""
    ds = run.val_loader.dataset
    batches = math.ceil(math.ceil(len(ds) / run.world_size) / run.args.batch_size)  # rank 0's
    for _ in range(len(run.val_loader), batches):
        x, y = default_collate([ds[0]])  # a batch of one sample, as the loader makes it
        run.raw_model(common.to_device(run, ds, x, y)[0])


def save(run, blocking=False):
    """Saves: every rank joins (the state dicts gather, the sums are averaged); rank 0 writes
    the training state to last.pt: plain names, whole tensors, every rank's random generators. It
    loads in any script, at any number of processes, on any device, with weights_only=True.
    --ckpt-format dcp: a ckpt-<step> folder of each rank's shards instead (train_extras/sharded.py;
    --async-save in the background)."""
    sums = mean_over_ranks(run.position.sums).tolist()
    rngs = [None] * run.world_size if run.rank == 0 else None
    dist.gather_object(common.rng_state(run.device), rngs)
    if run.sharded:  # [fsdp] --ckpt-format dcp: each rank writes the tensors it holds; no gather
        return run.sharded.save(run, sums, rngs, blocking)
    sharded = get_state_dict(run.raw_model, run.optimizer)  # [fsdp] no gather yet
    model_state, optim_state = common.nested(lambda t: gathered(t, run.rank), sharded)  # [fsdp]
    state = {"model": model_state, "optimizer": optim_state,
             "scheduler": run.scheduler.state_dict(), **run.position.state(sums), "rng": rngs,
             "args": vars(run.args), "world_size": run.world_size}
    # rank 0 writes; if it fails (a full disk), every rank stops with its line: none waits for it.
    # A stop the ranks agreed on ends the run there, saved
    common.write_and_end_if_stopped(run, state)


def gathered(t, rank):
    """Gathers a tensor of the state whole onto rank 0's CPU (None on the others): torch's
    full_state_dict gather crashes on CUDA tensors over gloo (pytorch/pytorch#152645)."""
    if isinstance(t, DTensor):
        group = t.device_mesh.get_group(t.device_mesh.ndim - 1)  # HSDP: the last one shards
        mine = t.to_local()
        rows = math.ceil(len(t) / group.size())  # each rank's, padded: the last's may be short
        padded = mine.new_zeros(rows, *t.shape[1:])
        padded[:len(mine)] = mine
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        dist.all_gather(parts, padded, group=group)
        t = torch.cat(parts)[:len(t)]
    if rank != 0:
        return None  # rank 0 alone writes
    return t.cpu()


def evaluate_and_log(run):
    """Evaluates, then logs rank 0's metrics row (a failed write stops every rank). A stop that
    came during the evaluation ends the run after it (common.log_and_end_if_stopped): the epoch was
    saved before it."""
    t1 = time.time()
    row = {**run.position.pending_row, **evaluate(run), "eval_time_s": time.time() - t1}
    common.log_and_end_if_stopped(run, row)


def local_bytes(tensors):
    """Returns the bytes this rank holds of these tensors (of a DTensor, its shard)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
               for t in tensors)


def held_bytes(run):
    """Returns what rank 0 holds, the largest shards, for metrics.jsonl (grads: train_step's)."""
    args, optim_state = run.args, run.optimizer.state.values()
    return {"param_bytes": local_bytes(run.raw_model.parameters()), "grad_bytes": run.grad_bytes,
            "optim_bytes": local_bytes(
                v for s in optim_state for v in s.values() if torch.is_tensor(v)),
            "precision": args.precision, "reshard_after_forward": args.reshard_after_forward,
            "replicate": args.replicate}


def announce(run):
    """Prints rank 0's first line: how the run is set up, and the step a resume starts at."""
    args, hsdp = run.args, ""  # [fsdp]
    if args.replicate > 1:  # [fsdp]
        hsdp = f"HSDP: {args.replicate} copies of {run.world_size // args.replicate} shards, "
    print(f"fsdp: {run.world_size} process{'es' if run.world_size > 1 else ''}, "  # [fsdp]
          f"backend {dist.get_backend()}, device {run.device.type}, global batch "
          f"{run.global_batch}, started by {run.launcher}, "
          f"{args.precision}, {'' if args.reshard_after_forward else 'no '}"
          f"reshard after forward, {hsdp}"
          f"{local_bytes(run.raw_model.parameters()) / 2**20:.1f} MiB of parameters per rank"
          + (f", resuming at step {run.position.step}" if run.position.step else ""))


def main(args):
    common.extra("workers").fork_server(args)  # for DataLoader workers, before any thread
    run = setup_distributed(args)
    master = run.rank == 0  # only rank 0 prints and writes files
    run.out_dir = args.out_dir or os.path.join(
        "runs", os.path.splitext(os.path.basename(__file__))[0])
    common.on_rank0(lambda: failsafe.check_out_dir(run), run.rank)  # a used one: refused now
    run.global_batch = args.batch_size * args.grad_accum * run.world_size
    run.sharded = (common.optional("sharded", "--ckpt-format dcp").Saver(run)  # [fsdp] each rank
                   if args.ckpt_format == "dcp" or args.async_save else None)  # writes its part
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
            position.pending_row.update(held_bytes(run))  # [fsdp] its shards' bytes, FSDP's flags
            # before the evaluation: a stop during it loses no training. With --async-save, the
            # last save (or a stop's) is whole before its row; an earlier one may fail after it
            save(run, blocking=position.step == end)  # [fsdp]
            evaluate_and_log(run)
        if run.sharded:  # [fsdp] the last save, if written in the background, complete
            run.sharded.wait()
        dist.barrier()  # [fsdp] no rank tears down its group while a peer may be in the last save


if __name__ == "__main__":
    parser = common.get_parser(__doc__)
    parser.add_argument("--ckpt-format", choices=["file", "dcp"], default="file",  # [fsdp]
                        help="dcp: sharded checkpoints, ckpt-<step> folders "
                        "(train_extras/sharded.py)")
    parser.add_argument("--async-save", action="store_true",  # [fsdp]
                        help="dcp checkpoints written in the background")
    parser.add_argument("--backend", choices=["gloo", "nccl", "xccl"],
                        help="default: the device's (torch's mapping)")
    parser.add_argument("--sync-bn", action="store_true",
                        help="not with FSDP: use ddp_launch_train.py")  # [fsdp]
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",  # [fsdp]
                        help="bf16: parameters gathered and computed in bfloat16, gradients "
                        "reduced in fp32 (no fp16: it would need a sharded GradScaler, and bf16 "
                        "has fp32's range)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,  # [fsdp]
                        default=True, help="free each block's gathered parameters after its "
                        "forward, gather again for its backward (least memory, ZeRO-3); --no-...: "
                        "kept until the backward, one all-gather fewer (ZeRO-2-like)")
    parser.add_argument("--replicate", type=common.number(int, 1), default=1, metavar="R",  # [fsdp]
                        help="HSDP: R copies of the model, each sharded over N/R ranks "
                        "(e.g. R = the machines)")
    failsafe.run_and_exit(main, parser.parse_args)
