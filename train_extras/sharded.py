"""Sharded checkpoints for fsdp_train.py (--ckpt-format dcp, --async-save): each save is a folder
ckpt-<step>, written by every rank with torch.distributed.checkpoint (DCP), each rank its own
shards, nothing gathered. It holds what a last.pt holds, under the same names (model, optimizer,
scheduler, position, rng, args, world_size), so that it converts to a last.pt and back, in one
process without a process group; and each rank's own buffers (buffers.<rank>: BatchNorm's
statistics mid-epoch, which FSDP leaves to differ), restored to each rank at the same world size:

    python -m train_extras.sharded runs/fsdp_train/ckpt-96 last.pt  # folder -> file
    python -m train_extras.sharded last.pt runs/fsdp_train/ckpt-96  # file -> folder

The file loads with weights_only=True. Each folder holds the CRC-32 of each of its files
(checksums.json), checked wherever it is read (a resume, the conversion): a folder whose bytes
changed after its save is refused in one line. A folder saved without it (before this file wrote
one) is read unchecked.
"""
import argparse
import gc
import os
import re
import shutil
import sys
import dataclasses
import json
import traceback
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import common
import failsafe

KEEP = 2  # the newest complete folders kept


def written(path):
    """When a checkpoint was completed: a folder's .metadata is the last file DCP writes."""
    return os.stat(os.path.join(path, ".metadata") if os.path.isdir(path) else path).st_mtime_ns


def folders(out_dir):
    """The complete ckpt-<step> folders in out_dir, oldest first (the oldest saves go first)."""
    found = [os.path.join(out_dir, n) for n in os.listdir(out_dir) if re.fullmatch(r"ckpt-\d+", n)]
    return sorted((p for p in found if os.path.isfile(os.path.join(p, ".metadata"))), key=written)


def step(path, run):
    """The optimizer step a checkpoint holds: a folder's from its name (ckpt-<step>), a last.pt's
    from its position (its tensors mapped, not read). Not the files' times, which a copy changes."""
    if os.path.isdir(path):
        return int(os.path.basename(path)[len("ckpt-"):])
    try:
        c = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return c["epoch"] * run.steps_per_epoch + c.get("samples_in_epoch", 0) // run.global_batch
    except Exception:  # unreadable: not taken (alone, common.checkpoint_to_resume says why)
        return -1


class Saver:
    """Every rank's saves. DCP is not atomic: it writes ckpt-<step>.tmp, renamed by rank 0 once
    complete; the newest KEEP folders stay. --async-save: DCP copies this rank's state to host
    memory and writes it in a thread while training goes on, its collectives on a gloo group of
    their own (on the training's they would interleave with its collectives). The next save, and
    the end of the run, wait for it first."""

    def __init__(self, run):
        self.out_dir, self.rank, self.pending = run.out_dir, run.rank, None
        self.group = dist.new_group(backend="gloo") if run.args.async_save else None
        failsafe.STOP.unfinished_saves.append(self.wait)  # a stop ends once this one is whole

    def save(self, run, sums, rngs, blocking=False):
        """Every rank; rank 0's state dict also holds the rest of a last.pt. `blocking` (or a stop
        the ranks agreed on, which then ends the run here): complete when it returns, even with
        --async-save."""
        self.wait()
        # this rank's shards
        state = dict(zip(("model", "optimizer"), get_state_dict(run.raw_model, run.optimizer)))
        # and this rank's own buffers, under its rank: FSDP does not make them equal (the model's
        # are rank 0's)
        state["buffers"] = {str(run.rank): dict(run.raw_model.named_buffers())}
        if run.rank == 0:
            state.update(scheduler=run.scheduler.state_dict(), **run.position.state(sums), rng=rngs,
                         args=vars(run.args), world_size=run.world_size)
        tmp = os.path.join(self.out_dir, f"ckpt-{run.position.step}.tmp")
        # what every rank holds alike (BatchNorm's statistics, which may differ mid-epoch):
        # rank 0's, as in last.pt
        planner = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        if self.group is None or blocking or failsafe.STOP.agreed:
            self.complete(lambda: dcp.save(state, checkpoint_id=tmp, planner=planner), tmp)
        else:
            self.pending = dcp.async_save(state, checkpoint_id=tmp, planner=planner,
                                          process_group=self.group), tmp
        common.write_and_end_if_stopped(run, None)

    def wait(self):  # the save in the background, if any, complete
        if self.pending:
            (future, tmp), self.pending = self.pending, None
            self.complete(future.result, tmp)

    def complete(self, write, tmp):
        """write() on every rank, then commit. A rank's write that fails (a full disk) fails it on
        every rank (DCP gathers the failures): one line, and no .tmp folder left."""
        try:
            write()
        except CheckpointException as e:
            # (before the rmtree)
            error = failsafe.save_failed(tmp[:-len(".tmp")], next(iter(e.failures.values()))[0])
            free_quietly(e)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from None
        # each rank's files' CRCs (their bytes still in memory, as a rule), written by rank 0
        mine = {n: checksum(os.path.join(tmp, n)) for n in os.listdir(tmp)
                if n.startswith(f"__{self.rank}_") or self.rank == 0 and n == ".metadata"}
        every = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, every)
        common.on_rank0(lambda: write_checksums(tmp, {k: v for d in every for k, v in d.items()}),
                        self.rank)  # a failed write stops every rank
        self.commit(tmp)

    def commit(self, tmp):
        """Rank 0, once DCP has returned there: every rank's part is written (rank 0, DCP's
        coordinator, writes the .metadata once every rank has reported)."""
        if self.rank == 0:
            # the same step saved again (a resumed run)
            shutil.rmtree(tmp[:-len(".tmp")], ignore_errors=True)
            os.replace(tmp, tmp[:-len(".tmp")])
            for old in folders(self.out_dir)[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)


CHECKSUMS = "checksums.json"


def write_checksums(tmp, crcs):
    """Rank 0: the folder's checksums, in it before it is renamed complete."""
    try:
        with open(os.path.join(tmp, CHECKSUMS), "w") as f:
            json.dump(crcs, f)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise failsafe.save_failed(tmp[:-len(".tmp")], e) from None


def checksum(path):
    """A file's CRC-32."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            crc = zlib.crc32(chunk, crc)
    return crc


def damaged(path, only=None, rank=0, world_size=1):
    """The files of folder `path` (those named `only`; this rank's share of them) whose bytes no
    longer match their CRC at the save: [] where none, or where the folder holds no checksums."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            saved = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        return [f"{CHECKSUMS} ({e})"]
    names = [n for n in sorted(saved) if only is None or n in only][rank::world_size]
    return [n for n in names if not os.path.isfile(os.path.join(path, n)) or
            checksum(os.path.join(path, n)) != saved[n]]


def refuse_damaged(path, found):
    if found:
        raise failsafe.UsageError(f"{path} is damaged: {', '.join(found[:3])} no longer match"
                                  f"{'es' * (len(found) == 1)} the checksum saved with it (its "
                                  "bytes changed after the save: a bad copy, a disk, a network "
                                  "filesystem); give another checkpoint")


def free_quietly(e):
    """Frees the streams of a failed DCP write, which its exceptions hold, with nothing printed:
    torch's NoCloseWriter flushes its file as it is freed, closed by then, and Python 3.13 and newer
    print the ValueError (pytorch/pytorch#194034: that flush)."""
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:
        for exception in [e, *(failure[0] for failure in e.failures.values())]:
            traceback.clear_frames(exception.__traceback__)
        gc.collect()
    finally:
        sys.unraisablehook = hook


def find(run):
    """Rank 0: the checkpoint to resume, as common.checkpoint_to_resume finds it, sharded folders
    too: what --resume names, or with 'auto' the highest step of last.pt and complete folders.
    Saves cut short go. (The script takes over --out-dir once it is accepted.)"""
    args, out_dir = run.args, run.out_dir
    found, last, path = [], os.path.join(out_dir, "last.pt"), args.resume
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            if re.fullmatch(r"ckpt-\d+\.tmp", name):
                print(f"{name}: a save cut short, removed", flush=True)
                shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
        found = folders(out_dir)
    if args.resume == "auto":
        path = max(found + [last] * os.path.exists(last), key=lambda p: step(p, run), default=None)
    if path and os.path.isdir(path):
        return failsafe.drop_logged_row(run, read(path, run))
    resume_file = argparse.Namespace(**{**vars(args), "resume": path or args.resume})  # auto: none
    return common.checkpoint_to_resume(dataclasses.replace(run, args=resume_file))


def refuse_folder(path):
    """Refuses a sharded checkpoint given to a script that reads only last.pt: one line that says
    how to make it one file (common.read_checkpoint)."""
    if os.path.exists(os.path.join(path, ".metadata")):
        raise failsafe.UsageError(f"{path} is a sharded checkpoint: make it one file with python "
                                  f"-m train_extras.sharded {path} last.pt")


def refuse_folders_only(run, found):
    """Rank 0: refuses an --out-dir that holds fsdp_train.py's ckpt-<step> folders and no last.pt
    (`found`: its checkpoints), in a script that reads last.pt alone (it has no --ckpt-format): a
    fresh run would replace them, --resume auto would start afresh beside them. The line names
    the conversion that makes them a last.pt (failsafe.check_out_dir)."""
    if found and "last.pt" not in found and not hasattr(run.args, "ckpt_format"):
        folder, last = os.path.join(run.out_dir, found[-1]), os.path.join(run.out_dir, "last.pt")
        raise failsafe.UsageError(f"{run.out_dir} holds no last.pt but the {found[-1]} of "
                                  f"fsdp_train.py: python -m train_extras.sharded {folder} {last} "
                                  "makes it a last.pt that --resume auto continues, --overwrite "
                                  "replaces it, or give another --out-dir")


def read(path, run):
    """Rank 0: a folder's metadata (all but the model and optimizer) with "sharded": its path,
    checked against this run as common.checkpoint_to_resume checks a last.pt."""
    refuse_damaged(path, damaged(path, only=[".metadata"]))  # the rest on every rank, in load
    saved = metadata(path)
    # {flattened name: its path in the state dict, e.g. ("model", "fc1.weight")}
    names = saved.planner_data
    meta, keys = {}, {p[0] for p in names.values()} - {"model", "optimizer", "buffers"}
    _load_state_dict(meta, storage_reader=FileSystemReader(path),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)  # rank 0 alone
    shapes = {names[k][1]: torch.Size(m.size) for k, m in saved.state_dict_metadata.items()
              if names[k][0] == "model"}
    has_optimizer = ("optimizer", "param_groups") in {p[:2] for p in names.values()}
    failsafe.check_fits(path, {**meta, "optimizer": None} if has_optimizer else meta, shapes, run)
    return {**meta, "sharded": path, "rank_buffers": "buffers" in {p[0] for p in names.values()}}


def metadata(path):
    """A complete folder's DCP metadata; one line if it is not one."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise failsafe.UsageError(f"{path} is not a complete sharded checkpoint (no .metadata): "
                                  "give another one")
    return FileSystemReader(path).read_metadata()


def load(meta, run):
    """Every rank: the model and optimizer, each rank reading what its shards hold in this run's
    layout (at any world size, HSDP or not); then the scheduler and random generators, as
    fsdp_train.resume does."""
    seen = [None] * run.world_size
    dist.all_gather_object(seen, os.path.isdir(meta["sharded"]))
    if not all(seen):
        missing = [r for r, s in enumerate(seen) if not s]
        raise failsafe.UsageError(f"{meta['sharded']} is not there for rank(s) {missing}: a "
                                  "sharded checkpoint must be on a filesystem that every rank sees")
    # its files checked, a share on each rank
    found = [None] * run.world_size
    dist.all_gather_object(found, damaged(meta["sharded"], None, run.rank, run.world_size))
    refuse_damaged(meta["sharded"], sorted(sum(found, [])))
    # filled in place
    state = dict(zip(("model", "optimizer"), get_state_dict(run.raw_model, run.optimizer)))
    dcp.load(state, checkpoint_id=meta["sharded"])
    set_state_dict(run.raw_model, run.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    if meta["rank_buffers"] and meta["world_size"] == run.world_size:
        # each rank's own buffers as it left them (a mid-epoch save): rank 0's came with the model
        dcp.load({"buffers": {str(run.rank): dict(run.raw_model.named_buffers())}},
                 checkpoint_id=meta["sharded"])
    run.scheduler.load_state_dict(meta["scheduler"])
    common.restore_rng(meta, run)


def to_file(src, dst):
    """A folder as one last.pt (format_utils.dcp_to_torch_save), in this process, which must hold
    all of it."""
    refuse_damaged(src, damaged(src))
    tmp, paths = f"{dst}.tmp{os.getpid()}", {p[:2] for p in metadata(src).planner_data.values()}
    try:
        dcp_to_torch_save(src, tmp)
        if ("optimizer", "param_groups") in paths and ("optimizer", "state") not in paths:
            # DCP keeps no empty dict: an optimizer without state (SGD without momentum) came back
            # without "state"
            ckpt = torch.load(tmp, weights_only=True)
            torch.save({**ckpt, "optimizer": {"state": {}, **ckpt["optimizer"]}}, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def to_folder(src, dst):
    """A last.pt as a folder, in this process: format_utils.torch_save_to_dcp, but read with
    weights_only=True (no code in the file runs)."""
    if os.path.exists(dst):
        raise failsafe.UsageError(f"{dst} exists: give a new folder")
    ckpt = common.read_checkpoint(src)
    dcp.save(ckpt, checkpoint_id=f"{dst}.tmp", no_dist=True)
    os.replace(f"{dst}.tmp", dst)


if __name__ == "__main__":
    # "torch.distributed is disabled ...": one process, as meant
    warnings.simplefilter("ignore", UserWarning)
    if len(sys.argv) != 3:
        sys.exit("usage: python -m train_extras.sharded FOLDER FILE, or FILE FOLDER "
                 "(see its docstring)")
    try:
        (to_file if os.path.isdir(sys.argv[1]) else to_folder)(*sys.argv[1:])
    except failsafe.UsageError as e:
        sys.exit(f"error: {e}")
