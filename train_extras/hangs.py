"""A collective that timed out names the ranks that never arrived (torch's error names neither
the collective nor the rank): the scripts' `with common.extra("hangs").named(run)` uses this where
the file is. Without it, every rank still ends, with torch's own timeout error and exit 3."""
import contextlib
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
        try:
            # the store the process group met on, under its key prefix (restart.py's attempts
            # included): torch has no public name for it (pytorch/pytorch#151960)
            store = dist.distributed_c10d._get_default_store()
            store.set(f"hung/{run.rank}", "")
            time.sleep(5)  # the other ranks' waits run out at about the same time
            arrived = [r for r in range(run.world_size) if store.check([f"hung/{r}"])]
        except Exception:  # noqa: BLE001 whatever the store raises: it went with rank 0
            raise common.Hang("a collective timed out, and the store is gone with rank 0, which "
                              "held it", printer=None) from None
        missing = ", ".join(str(r) for r in range(run.world_size) if r not in arrived)
        time.sleep(5 if run.rank == 0 else 0)  # rank 0's process holds the store: the others read
        raise common.Hang(f"a collective timed out: rank {missing} never arrived",
                          printer=min(arrived)) from None
