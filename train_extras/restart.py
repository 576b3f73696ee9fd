"""torchrun --max-restarts: the workers of each restart attempt meet on torchrun's store under a key
prefix of their own (ddp_launch_train.py uses this only when TORCHELASTIC_MAX_RESTARTS > 0)."""
import os
import time

import torch.distributed as dist



def torchrun_store(rank, world_size, timeout):
    """The agent's store (at MASTER_ADDR:MASTER_PORT), under a prefix that only this attempt uses.

    The agent's store outlives worker restarts, keys of earlier attempts included: meeting there
    without a prefix (the default env:// setup) often fails or hangs after a restart.
    TORCHELASTIC_RESTART_COUNT cannot be the prefix: each node's agent counts its own restarts, and
    after a restart across nodes the counts differ. So rank 0 draws a random prefix and hands it to
    each rank in answer to a random token of that rank: no key left by an earlier attempt can answer
    it. Upstream: pytorch/pytorch#135712 (the shared store and restarts), #108158 (restart counts
    differ per node); remove this when init_process_group alone survives tests/test_cluster.py's
    restarts. (MASTER_PORT=0, torchrun --master_port=0: refused before, by
    failsafe.check_rendezvous.)"""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    hello = dist.PrefixStore("hello", store)
    prefix = hand_out_prefix(hello, world_size, timeout) if rank == 0 \
        else ask_for_prefix(hello, rank)
    return dist.PrefixStore(prefix, store)


def hand_out_prefix(hello, world_size, timeout):
    """Rank 0: a fresh random prefix, given in answer to each rank's latest token until that rank
    confirms it."""
    prefix, last_token, joined = os.urandom(16).hex(), {}, set()
    deadline = time.monotonic() + timeout.total_seconds()
    while len(joined) < world_size - 1:
        for r in set(range(1, world_size)) - joined:
            if hello.check([f"{prefix}/{r}"]):
                joined.add(r)
            elif hello.check([f"token{r}"]) and \
                    (token := hello.get(f"token{r}")) != last_token.get(r):
                # a token of this attempt: no earlier key answers it
                hello.set(f"answer/{token.decode()}", prefix)
                last_token[r] = token
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(set(range(1, world_size)) - joined)} "
                               f"did not join in {timeout}")
        time.sleep(0.01)
    return prefix


def ask_for_prefix(hello, rank):
    """Ranks > 0: a random token, rank 0's answer to it (waited for up to the store's timeout), then
    confirmed."""
    token = os.urandom(16).hex()
    hello.set(f"token{rank}", token)
    prefix = hello.get(f"answer/{token}").decode()
    hello.set(f"{prefix}/{rank}", "")
    return prefix
