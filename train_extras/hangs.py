"""A collective that timed out names the ranks that never arrived, and one whose peer's process
is gone (killed outright: its connection closed) names the ranks that are gone (torch's errors name
neither the collective nor the rank), but a rank that ended with a line of its own (bad input, an
error in the code): it marks that in the store as it ends, and the peers that lose it end silently.
The scripts' `with common.extra("hangs").named(run)` uses this where the file is. Without it, every
rank still ends, with torch's own error and exit 3."""
import contextlib
import os
import socket
import threading
import time

import torch.distributed as dist

import failsafe


@contextlib.contextmanager
def named(run):
    """Names the ranks that never arrived: each rank whose wait ran out marks itself in the store
    the ranks met on, waits for the others to, and reads which never did."""
    where = [None] * run.world_size  # each rank's machine, node and process, for a lost peer
    if run.world_size > 1:
        node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", socket.gethostname()))
        dist.all_gather_object(where, (socket.gethostname(), node, os.getpid()))
    try:
        yield
    except Exception as e:
        why = str(e).lower().replace("timeout", "timed out")
        lost = failsafe.peer_lost(why)  # a peer's process is gone (else: it stopped answering)
        if run.world_size == 1 or failsafe.STOP.paused() or lost and failsafe.STOP.agreed:
            raise  # (failsafe.ending's)
        if not isinstance(e, RuntimeError) or not (lost or "timed out" in why) \
                or "dataloader" in why:
            within(1, lambda: mark(run, "ended"))  # its own ending: a peer losing it says nothing
            raise
        what = "a peer's connection closed" if lost else "a collective timed out"
        arrived = within(10, lambda: mark_and_read(run))
        # a rank of this machine whose process runs is not gone (it may wait on another that is
        # still naming, or have been stopped by its own launcher); one elsewhere may be
        here = socket.gethostname()
        running = {r for r, (host, _, pid) in enumerate(where) if host == here and not gone(pid)}
        if arrived is None and not (lost and set(range(run.world_size)) - running):
            # gone with rank 0, or frozen with it (launched by hand, or by srun)
            raise failsafe.Hang(f"{what}, and the store does not answer: rank 0, whose process "
                                "holds it, is gone or frozen", printer=None) from None
        missing = [r for r in range(run.world_size) if r not in (arrived or [])
                   and not (lost and r in running)]
        ended = within(1, lambda: [r for r in missing if marked(run, "ended", r)])
        if lost and missing and ended == missing:  # each ended with its own line: said already
            raise failsafe.Failed(f"{what}: a peer ended", printer=-1) from None
        time.sleep(5 if run.rank == 0 else 0)  # rank 0's process holds the store: the others read
        nodes = len({node for _, node, _ in where}) > 1
        named = ", ".join(f"{r} (node {where[r][1]})" if nodes else str(r) for r in missing)
        verb = ("is gone" if len(missing) == 1 else "are gone") if lost else "never arrived"
        store = "" if arrived else ", and the store does not answer"  # (it went with them)
        raise failsafe.Hang(f"{what}{store}: rank{'s' * (len(missing) > 1)} {named} {verb}",
                          printer=min(set(range(run.world_size)) - set(missing))) from None


def gone(pid):
    """Whether process `pid` of this machine has ended (a zombie, not yet reaped, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(OSError):  # (no /proc: not Linux)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    return False


def mark_and_read(run):
    """Marks this rank in the store the ranks met on, and returns the ranks marked 5 s later; None
    if the store fails."""
    if not mark(run, "hung"):
        return None
    time.sleep(5)  # the other ranks' waits run out at about the same time
    marks = [marked(run, "hung", r) for r in range(run.world_size)]
    return None if None in marks else [r for r, m in enumerate(marks) if m]


def mark(run, what):
    """Marks this rank as `what` in the store the ranks met on, under its key prefix (restart.py's
    attempts included); False if the store fails. (torch has no public name for that store:
    pytorch/pytorch#151960)"""
    try:
        dist.distributed_c10d._get_default_store().set(f"{what}/{run.rank}", "")
        return True
    except Exception:  # noqa: BLE001 whatever the store raises: it went with rank 0
        return False


def marked(run, what, rank):
    """Whether `rank` marked itself as `what`; None if the store fails."""
    try:
        return dist.distributed_c10d._get_default_store().check([f"{what}/{rank}"])
    except Exception:  # noqa: BLE001 (as mark's)
        return None


def within(seconds, fn):
    """fn()'s result, or None if it has not returned within `seconds`: the store of a frozen process
    never answers, and a call waits for its socket's timeout, the start-up's 10 minutes."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None
