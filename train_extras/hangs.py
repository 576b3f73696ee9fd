"""A collective that timed out names the ranks that never arrived (torch's error names neither
the collective nor the rank): the scripts' `with common.extra("hangs").named(run)` uses this where
the file is. Without it, every rank still ends, with torch's own timeout error and exit 3."""
import contextlib
import threading
import time

import torch.distributed as dist

import common


@contextlib.contextmanager
def named(run):
    """Names the ranks that never arrived: each rank whose wait ran out marks itself in the store
    the ranks met on, waits for the others to, and reads which never did."""
    try:
        yield
    except RuntimeError as e:
        why = str(e).lower().replace("timeout", "timed out")
        if run.world_size == 1 or "timed out" not in why or "dataloader" in why:  # (a worker: no)
            raise
        arrived = within(10, lambda: mark_and_read(run))
        if arrived is None:  # gone with rank 0, or frozen with it (launched by hand, or by srun)
            raise common.Hang("a collective timed out, and the store does not answer: rank 0, "
                              "whose process holds it, is gone or frozen", printer=None) from None
        missing = ", ".join(str(r) for r in range(run.world_size) if r not in arrived)
        time.sleep(5 if run.rank == 0 else 0)  # rank 0's process holds the store: the others read
        raise common.Hang(f"a collective timed out: rank {missing} never arrived",
                          printer=min(arrived)) from None


def mark_and_read(run):
    """Marks this rank in the store the ranks met on, under its key prefix (restart.py's attempts
    included), and returns the ranks marked 5 s later; None if the store fails. (torch has no public
    name for that store: pytorch/pytorch#151960)"""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"hung/{run.rank}", "")
        time.sleep(5)  # the other ranks' waits run out at about the same time
        return [r for r in range(run.world_size) if store.check([f"hung/{r}"])]
    except Exception:  # noqa: BLE001 whatever the store raises: it went with rank 0
        return None


def within(seconds, fn):
    """fn()'s result, or None if it has not returned within `seconds`: the store of a frozen process
    never answers, and a call waits for its socket's timeout, the start-up's 10 minutes."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None
