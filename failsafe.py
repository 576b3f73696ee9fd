"""What a run does because it may stop or fail, carried beside common.py: copy it with it, and you
need not open it to adapt a model or data. common.py and the scripts call it at a few points, each
named for all it does.

It reads in the order a run may need it: the endings (each a line and an exit status); the refusals,
of a flag, a launch, a sample, an --out-dir or a checkpoint; the stop (its signals, the ranks'
agreement on them and on a NaN/inf loss, the timeouts, a lost or paused peer told apart from a
hang); the DataLoader workers, deaf to the stop signals with the helpers of their start method; and
the entry point, which turns an ending into its line and status, and the exit. Every interpreter or
torch internal the scripts touch is here, next to its upstream issue."""
import argparse
import contextlib
import datetime
import errno
import functools
import gc
import json
import multiprocessing
import multiprocessing.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import common


# ==== the endings: one line, printed once, and an exit status
class Ending(Exception):
    """Ends the run with one line, printed by rank `printer` (None: each rank that raises it;
    -1: none), and the exit status `code`."""

    def __init__(self, message, printer=0):
        super().__init__(message)
        self.printer = printer


class UsageError(Ending):
    code = 2  # the user's: a flag, a launch, a file, the data


class NanLoss(Ending):
    code = 1  # a NaN/inf loss on any rank: all stop at one step


class Hang(Ending):
    code = 3  # a rank or a worker stopped answering (--step-timeout)


class Failed(Ending):
    code = 1  # an error of the code's own, torch's or the user's: its traceback is its line


class Stopped(Ending):
    """A stop signal: exit 0 after SIGUSR1 (a requeue), else 128 + its number."""

    def __init__(self, signum, step=None, printer=0):
        how = "before training: nothing was saved" if step is None else \
            f"at step {step}, where last.pt was saved: --resume auto continues"
        # the user's Ctrl-C where a parent passed it on as SIGTERM (STOP.interrupted)
        interrupted = signum == signal.SIGTERM and STOP.interrupted and STOP.interrupted.value
        name = signal.Signals(signal.SIGINT if interrupted else signum).name
        super().__init__(f"stopped by {name} {how}", printer)
        self.code = 0 if signum == SIGUSR1 else 128 + signum


# ==== refusals: each one line, exit 2, before anything is written
class Parser(argparse.ArgumentParser):
    """The scripts' parser: its errors are one line (a flag of an extra not copied: naming its
    file); a script that starts its own processes refuses a launcher's."""
    one_process = None  # why a launcher is wrong (a script that starts its own processes)
    collectives = True  # dp_train.py: no process group

    def error(self, message):
        words = set(message.replace("=", " ").split())
        for name, flags in common.EXTRA_FLAGS.items():
            if message.startswith("unrecognized") and words & set(flags) and \
                    isinstance(common.extra(name), common.NotCopied):
                message += f" (a flag of train_extras/{name}.py: copy it and its __init__.py)"
        raise UsageError(f"{message} (see {self.prog} --help)")

    def parse_args(self, *a, **kw):
        """Also resolves --device (common.device_type)."""
        several = self.one_process and launched()  # (before the old launcher's --local-rank)
        if several:  # a launcher's processes, or its variables left in the shell: named, and
            told = " ".join(f"{n}={v}" for n, v in os.environ.items()  # said once a machine
                            if re.fullmatch(LAUNCH_VARIABLES, n))
            raise UsageError(f"{self.prog} {self.one_process}: start it with python, not "
                             f"{several[2]} (its environment has {told})",
                             printer=None if several[1] == 0 else 0)
        args = super().parse_args(*a, **kw)
        args.device = common.device_type(args.device, self.collectives)
        return args


# what a launcher sets to tell each process who it is: torchrun's; Open MPI's, MPICH's, srun's
LAUNCH_VARIABLES = r"(LOCAL_)?(RANK|WORLD_SIZE)|OMPI_COMM_WORLD_\w+|PMI_\w+|MPI_LOCAL\w+" \
    r"|SLURM_(PROC|LOCAL)ID"


def launched():
    """(rank, local rank, launcher's name) where a launcher started this process as one of several
    (or left its variables in the shell: "a launcher" where they do not add up), else None."""
    try:
        rank, world, local_rank, _, launcher = common.launcher_env()
    except UsageError:  # (its rank: 0, where no launcher's variable names another)
        ranks = r"RANK|OMPI_COMM_WORLD_RANK|PMI_RANK|SLURM_PROCID"
        return int(any(os.environ.get(n, "0") != "0" for n in ranks.split("|"))), 0, "a launcher"
    return (rank, local_rank, launcher) if world > 1 or "TORCHELASTIC_RUN_ID" in os.environ \
        else None


def check_launch(env):
    """Refuses torchrun's variables that do not add up (RANK without WORLD_SIZE, or the reverse),
    and another launcher's without train_extras/launchers.py: srun's, mpirun's, mpiexec's, a
    Kubernetes pod's (RANK without LOCAL_RANK)."""
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        raise UsageError("RANK and WORLD_SIZE go together: set both")
    if any(n in env for n in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "RANK")) \
            and "LOCAL_RANK" not in env:
        common.optional("launchers", "a launch by srun, mpirun, mpiexec or a Kubernetes pod "
                        "(RANK without LOCAL_RANK)")


def check_rendezvous(env, launcher, world):
    """Refuses several processes without MASTER_ADDR and MASTER_PORT, or on port 0 (torchrun
    --master_port=0 tells its workers 0 for the port it picked)."""
    if not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
        raise UsageError(f"{launcher}: {world} processes, but no MASTER_ADDR and MASTER_PORT: set "
                         "both, the same on every machine")
    if env["MASTER_PORT"] == "0":
        raise UsageError("MASTER_PORT=0 (torchrun --master_port=0): give a free port, or "
                         "--standalone")


def same_flags(args, allowed=("out_dir", "data_dir", "workers", "tensorboard", "local_rank")):
    """Refuses flags that differ from rank 0's (but the per-machine ones)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v for k, v in vars(args).items() if k not in allowed})
    for rank, flags in enumerate(everyone):
        for k, v in everyone[0].items():
            if flags.get(k) != v:
                raise UsageError(f"the ranks' flags differ: --{k.replace('_', '-')} is {v} on "
                                 f"rank 0, {flags.get(k)} on rank {rank}")


def check_sample(x, y):
    """Refuses a batch whose labels are not a tensor: a dict sample ({"input_ids", "label"}) was
    unpacked into its keys."""
    if not isinstance(y, torch.Tensor):
        raise UsageError(f"a batch unpacked to ({type(x).__name__}, {type(y).__name__}): a sample "
                         "must be a pair (x, label), x a tensor or a dict, list or tuple of them")


# ---- --out-dir: one run a folder, never replaced unasked
def check_out_dir(run):
    """Rank 0, before anything is built: refuses an unwritable --out-dir, or a run in it unasked
    (its checkpoints; any line of its metrics.jsonl, which is someone's data)."""
    args, out = run.args, run.out_dir
    own = resumes_own(args, out)
    if args.overwrite and args.resume and own:
        raise UsageError(f"--overwrite would delete the checkpoint that --resume {args.resume} "
                         "continues: drop one of the two")
    if not os.path.isdir(out):
        return
    try:
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise UsageError(f"--out-dir {out}: {e.strerror}") from None
    found = earlier_checkpoints(out)
    if found and args.resume and not (own or args.overwrite):  # a resume of another run's
        raise UsageError(f"{out} holds the {found[-1]} of another run, which this one would "
                         "replace: give another --out-dir, or --overwrite to replace it")
    if found and not args.overwrite:  # fsdp_train.py's folders alone, in a script of last.pt
        common.extra("sharded").refuse_folders_only(run, found)
    if found and not (args.resume or args.overwrite):  # never replaced unasked
        raise UsageError(f"{out} holds the {found[-1]} of an earlier run: --resume auto "
                         "continues it, --overwrite replaces it, or give another --out-dir")
    logged = [line for line, _ in metrics_lines(run) if line.strip()]
    if logged and not (found or args.overwrite):  # its checkpoints deleted, its log kept
        raise UsageError(f"{out} holds the metrics.jsonl of an earlier run ({len(logged)} rows), "
                         "which this one would replace: --overwrite replaces it, or give another "
                         "--out-dir")


def earlier_checkpoints(out):
    # last.pt, and fsdp_train.py's ckpt-<step> folders
    return sorted(n for n in os.listdir(out) if re.fullmatch(r"last\.pt|ckpt-\d+(\.tmp)?", n))


def resumes_own(args, out):
    # 'auto', or its folder, or its last.pt
    real = os.path.realpath(args.resume or "")
    return args.resume == "auto" or os.path.realpath(out) in (real, os.path.dirname(real))


def metrics_lines(run):
    """Rank 0: metrics.jsonl's lines, each with the row it holds where it is one of ours (a dict,
    an integer step, a number epoch), else None: another tool's line, a note, kept as it is."""
    path = common.metrics_file(run)
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return [(line, our_row(line)) for line in lines]


def our_row(line):
    """The row `line` holds, where it is one of ours (a dict, an integer step, a number epoch)."""
    with contextlib.suppress(ValueError):
        row = json.loads(line)
        if type(row) is dict and type(row.get("step")) is int and \
                type(row.get("epoch")) in (int, float):
            return row
    return None


def keep_covered_rows(run):
    """Rank 0, a resume: keeps in metrics.jsonl the rows of the epochs its checkpoint covers (a row
    at --max-steps mid-epoch goes: an unbroken run has none there), and every line that is not a
    row of ours; the file rewritten whole, aside then renamed, or not at all."""
    logged = metrics_lines(run)
    kept = [line for line, row in logged if not row or row["epoch"] <= run.position.epoch]
    if len(kept) < len(logged):
        path = common.metrics_file(run)
        with open(f"{path}.tmp", "w") as f:
            f.writelines(line + "\n" for line in kept)
        os.replace(f"{path}.tmp", path)


def drop_logged_row(run, ckpt):
    """Returns `ckpt`, without its row to evaluate if metrics.jsonl has it, or another run's."""
    row = ckpt.get("row") if ckpt else None
    if row and (row["step"] in [r["step"] for _, r in metrics_lines(run) if r] or
                not resumes_own(run.args, run.out_dir)):
        ckpt["row"] = None
    return ckpt


# ---- a checkpoint: whole, readable, and one that this run can continue
def refuse_unreadable(path):
    """Refuses a folder given as a checkpoint (sharded.py names a sharded one), and a checkpoint
    whose bytes changed after its save (a bad copy, a disk, a network filesystem): torch's zip
    format holds each record's CRC-32, which torch.load does not check. A file torch wrote
    without them (CRC 0: torch.serialization.set_crc32_options) is not refused for that."""
    if os.path.isdir(path):
        common.extra("sharded").refuse_folder(path)
        raise UsageError(f"--resume {path}: a folder that holds no checkpoint (no last.pt)")
    try:
        with zipfile.ZipFile(path) as z:  # (all CRCs 0: written without them)
            bad = any(record.CRC for record in z.infolist()) and z.testzip()
    except (zipfile.BadZipFile, OSError):
        return  # torch's legacy format, or not a checkpoint at all: torch.load says
    if bad:
        raise UsageError(f"{path} is damaged (its record {bad} does not match its CRC-32): its "
                         "bytes changed after it was saved (a bad copy, a disk, a network "
                         "filesystem); give another checkpoint")


def unreadable(path, e):
    return UsageError(f"{path} is not a readable checkpoint ({type(e).__name__}): missing, "
                      "truncated, or a pickled model (save its state_dict)?")


def check_fits(path, ckpt, shapes, run):
    """`ckpt` if this run can continue it exactly."""
    a, args = ckpt.get("args", {}), run.args
    frozen = a.get("freeze_backbone", False) != getattr(args, "freeze_backbone", False)
    if shapes != {k: v.shape for k, v in run.raw_model.state_dict().items()} or \
            "optimizer" not in ckpt or frozen:
        raise UsageError(f"{path} is not a training state of this model and flags (--model, "
                         "classes, channels, --freeze-backbone?): --weights takes weights")
    if a.get("optimizer", "sgd") != args.optimizer:  # its state would go into another optimizer's
        raise UsageError(f"{path} was trained with --optimizer {a.get('optimizer', 'sgd')}: to "
                         f"start {args.optimizer} from its weights, give it to --weights")
    if ckpt.get("global_batch") != run.global_batch:
        raise UsageError(f"{path} was trained with a global batch of {ckpt.get('global_batch')}, "
                         f"this run's is {run.global_batch}: keep --batch-size x processes x "
                         "--grad-accum")
    if ckpt.get("steps_per_epoch", run.steps_per_epoch) != run.steps_per_epoch:
        raise UsageError(f"{path} was trained with {ckpt['steps_per_epoch']} steps per epoch, "
                         f"this run has {run.steps_per_epoch}: the data changed; keep it, or use "
                         "--weights")
    saved, now = ckpt.get("data", common.data_of(run)), common.data_of(run)  # its samples
    for k in now:
        if saved.get(k) != now[k]:
            what = "training samples" if k == "samples" else "--" + k.replace("_", "-")
            raise UsageError(f"{path} was trained on other data ({what} {saved.get(k)}, this "
                             f"run's {now[k]}): keep them, or start from its weights with "
                             "--weights")
    return ckpt


def save_failed(path, e):
    """Returns the save's error line (a full disk inferred: torch says "unexpected pos")."""
    why = getattr(e, "strerror", None) or str(e).strip().split("\n")[0]
    with contextlib.suppress(OSError):
        if shutil.disk_usage(os.path.dirname(path) or ".").free < 2**20:
            why = os.strerror(errno.ENOSPC)
    return UsageError(f"could not save {path}: {why[:120]}. The previous checkpoint is whole")


def append_row(path, line, step):
    """Appends a metrics row to `path` whole: a write that fails (a full disk, a quota, the folder
    gone) is one line, and a row the disk cut short is taken back."""
    try:
        with open(path, "ab", buffering=0) as f:  # unbuffered: a failed write fails here
            end = f.tell()
            if f.write(line) != len(line):  # the disk filled up mid-row
                f.truncate(end)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        raise UsageError(f"could not write {path}: {e.strerror}; step {step} was saved") from None


# ==== the stop: a signal, agreed on by the ranks, acted on at one step
STOP_SIGNALS = [getattr(signal, n) for n in ("SIGUSR1", "SIGTERM", "SIGHUP", "SIGINT")
                if hasattr(signal, n)]
SIGUSR1 = getattr(signal, "SIGUSR1", None)  # (Windows: none)


class Stop:
    """The stop signals of this process. Its handler notes one (received); the ranks agree on it at
    their next check (Agreement.check sets agreed); the scripts save at that step, and the run
    ends there (end: the one place a Stopped is raised). A second Ctrl-C ends the run at once, a
    second SIGTERM does not (torchrun passes each on; SLURM signals every process)."""

    def __init__(self):
        self.received = self.agreed = self.window = self.joined = 0
        self.unfinished_saves = []  # finished before the run ends: sharded.py's, in the background
        self.continued, self.launcher = float("-inf"), None
        self.interrupted = None  # ddp_spawn_train.py's children: a Value, the parent's Ctrl-Cs

    def catch(self):
        """From now on, a stop signal saves and stops every rank at one step (unless ignored); so
        does the end of a launcher that watches this process (torchrun, mp.spawn's parent), if it
        leaves it training alone. A SIGCONT is noted: a pause (SIGSTOP, Ctrl-Z) then ended."""
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, self.note)
        if hasattr(signal, "SIGCONT"):
            signal.signal(signal.SIGCONT, lambda *_: setattr(self, "continued", time.monotonic()))
        if "TORCHELASTIC_RUN_ID" in os.environ or multiprocessing.parent_process():
            self.launcher = os.getppid()

    def note(self, signum, _):
        if signum == signal.SIGINT:
            signal.signal(signum, signal.SIG_DFL)
        self.received = max(self.received, signum)

    def poll(self):
        """The stop this process has to tell the ranks: a signal's, or SIGHUP's where its launcher
        is gone (killed: its workers, in sessions of their own, would train on with nobody to
        stop them, and beside a requeued job)."""
        if self.launcher and os.getppid() != self.launcher and not self.received:
            self.received = signal.SIGHUP
        return self.received

    def paused(self):
        """Whether a SIGCONT ended a pause of this process within the last collective's wait."""
        return time.monotonic() - self.continued < self.window + 30

    def end(self, step):
        """Ends the run at `step`, saved, where the ranks agreed on a stop."""
        if self.agreed:
            for finish in self.unfinished_saves:
                finish()
            raise Stopped(self.agreed, step)


STOP = Stop()


class Agreement:
    """What every rank learns at the same step, in one all-reduce at a check: the first step whose
    loss was NaN/inf on any rank (a NanLoss ending), a stop any rank has to tell (STOP.agreed), and
    the seconds since the last check, which set the next one's step. A check comes every
    --log-every steps, about every CHECK_S seconds, and where all ask (a save, the last step, the
    end of an evaluation)."""
    CHECK_S, NEVER = 2.0, 2.0**52  # the checks' cadence in seconds; "no NaN/inf step yet"

    def __init__(self, run):
        # the last check's (step, time): the start's, at first; the next check's step
        self.run, self.checked = run, (run.position.step, time.monotonic())
        self.next_check = run.position.step + 1
        self.first_bad = torch.tensor(self.NEVER, dtype=run.position.sums_dtype,
                                      device=run.device)

    def step_done(self, loss):
        """Notes a NaN/inf loss (on the device: no host sync), then checks where one is due."""
        position = self.run.position
        self.first_bad = torch.where(~torch.isfinite(loss) & (self.first_bad == self.NEVER),
                                     position.step, self.first_bad)
        if position.save_due or position.last or position.step >= self.next_check:
            self.check()

    def check(self):
        """One all-reduce (MAX) of three numbers: the first NaN/inf step, negated (the MAX of
        negatives is the earliest); the stop signal's number (SIGTERM's 15 over SIGUSR1's 10: told
        to stop and to requeue, it stops); the seconds since the last check (the slowest rank's,
        so that every rank sets the same next check: about CHECK_S s on, at the latest at the
        next --log-every step)."""
        position, every = self.run.position, self.run.args.log_every
        step, since = position.step, time.monotonic() - self.checked[1]
        told = torch.tensor([-self.first_bad.item(), STOP.poll(), since],
                            dtype=position.sums_dtype, device=self.run.device)
        if dist.is_initialized():
            dist.all_reduce(told, op=dist.ReduceOp.MAX)
        first_bad, agreed, since = told.tolist()
        STOP.agreed = int(agreed)
        if -first_bad < self.NEVER:
            raise NanLoss(f"loss is NaN/inf at step {-first_bad:.0f}: stopped, " + (
                "the last checkpoint is older" if position.has_checkpoint else "nothing was saved"))
        if self.checked[0] == step:  # again at this step (an evaluation's end)
            return
        per_step = max(since / (step - self.checked[0]), 1e-9)  # (the first's: with the start-up)
        every = min(every - step % every, max(1, int(self.CHECK_S / per_step)))
        self.next_check, self.checked = step + every, (step, time.monotonic())


@contextlib.contextmanager
def joining(seconds):
    """Around init_process_group and a first collective: the ranks join within `seconds` (its
    timeout), or each ends with one line (joining_failed), 10 s later at most: a store client
    that reached another program's port waits for an answer forever (torch's TCPStore has no
    timeout there). Joined, the start-up (data, downloads) has 10 minutes."""
    def give_up():
        print(f"error: {joining_failed('timed out')}", file=sys.stderr, flush=True)
        os._exit(UsageError.code)
    timer = threading.Timer(seconds + 10, give_up)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    STOP.joined = True
    set_timeout(600)


def set_timeout(seconds):
    """Each collective from now on waits at most `seconds`: the start-up's 10 minutes once the ranks
    joined, --step-timeout from the first step's check on (a rank that stops answering ends the
    run then, exit 3)."""
    STOP.window = seconds
    if dist.is_initialized():  # (torch 2.11: a private name)
        set_pg = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        set_pg(datetime.timedelta(seconds=seconds))


def peer_lost(why):
    """Whether an error says that a peer's process is gone (gloo's words, NCCL's)."""
    return re.search("connection (closed|reset) by peer|remote process exited", why.lower())


def joining_failed(why):
    """The line of a process group that did not form within --step-timeout: a launch mistake."""
    env = os.environ
    where = f"MASTER_ADDR={env.get('MASTER_ADDR')} MASTER_PORT={env.get('MASTER_PORT')}"
    if "EADDRINUSE" in why:  # rank 0 could not serve the store there
        return f"{where}: the port is taken by another program; give a free one"
    return (f"the ranks did not join within --step-timeout at {where}, WORLD_SIZE="
            f"{env.get('WORLD_SIZE')}: every rank needs the same WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT, a port no other program holds, and all must start")


# ==== DataLoader workers: deaf to the stop signals, ended by their trainer
class DeafWorkersLoader(DataLoader):
    """A DataLoader whose workers are deaf to stop signals from their first instruction, and so are
    the helpers that their start method starts with them: the fork server (Python 3.14's default
    on Linux) and the resource tracker. All inherit the signals blocked; killed by a job's stop
    signal, a helper would take the workers with it, and the save too. Each worker starts with
    init_worker."""

    def __iter__(self):  # (the workers start here)
        if not self.num_workers:
            return super().__iter__()
        self.worker_init_fn = functools.partial(init_worker, sockets_folder())
        return start_deaf(super().__iter__)


def start_deaf(start):
    """Returns start(), which starts processes: the resource tracker first, then them, deaf to the
    stop signals (start_resource_tracker, stop_signals_blocked)."""
    start_resource_tracker()
    with stop_signals_blocked():
        return start()


@contextlib.contextmanager
def stop_signals_blocked():
    """Blocks the stop signals in this thread: a process started meanwhile, by fork or by spawn,
    inherits them blocked (the mask survives exec). One that comes meanwhile is not lost: another
    thread takes it, or this one when unblocked."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def start_resource_tracker():
    """Starts multiprocessing's resource tracker (if not running) deaf to the stop signals, in a
    session of its own. This process's children share it, to unlink their semaphores if they
    cannot (sem.mp-* in /dev/shm, where workers start by forkserver or spawn). Killed by a job's
    stop signal, it would be started again, with a traceback for each semaphore it knew; by a
    SIGKILL to the trainer's process group (torchrun's, at the end of its grace period), it would
    leave them there until a reboot. A call of its own: Python 3.11 and older 3.12s unblock SIGINT
    and SIGTERM in the thread that starts it (python/cpython#127586). It starts through
    multiprocessing.util.spawnv_passfds, which has no session option: swapped for the call."""
    if hasattr(signal, "pthread_sigmask"):  # (Windows: no tracker)
        from multiprocessing import resource_tracker, util
        spawn, util.spawnv_passfds = util.spawnv_passfds, spawn_in_own_session
        try:
            with stop_signals_blocked():
                resource_tracker.ensure_running()
        finally:
            util.spawnv_passfds = spawn


# what lives until os._exit: the Popen of each process spawn_in_own_session started (freed, it
# would let subprocess reap the tracker, which multiprocessing waits for itself); the destroyed
# default process group, DDP's (run_and_exit says why)
KEPT = []


def spawn_in_own_session(path, args, passfds):
    """multiprocessing.util.spawnv_passfds's process (no other descriptor of this one: gloo's
    sockets stay here), in a session of its own."""
    helper = subprocess.Popen(args, executable=path, pass_fds=passfds, start_new_session=True)
    KEPT.append(helper)
    return helper.pid


def sockets_folder():
    """multiprocessing's temporary folder (pymp-*, a private name), where a worker's sockets go:
    made once, here, and shared by every worker (leave() removes it). In /tmp where TMPDIR is too
    deep for a socket's path (107 bytes; Python 3.14 checks characters, not bytes): clusters set
    deep ones, and each worker failed with "AF_UNIX path too long"."""
    config = multiprocessing.current_process()._config
    if "tempdir" not in config and len(os.fsencode(tempfile.gettempdir())) > 70:
        config["tempdir"] = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    return multiprocessing.util.get_temp_dir()


def init_worker(sockets, _):
    """A DataLoader worker's first step: it ignores the stop signals (its trainer saves, then ends
    it: Lightning-AI/pytorch-lightning#17899), puts its sockets in its trainer's folder
    (sockets_folder), and, started by a fork server, lets go of the server's end of a pipe that
    every process holds while the server is to run (so that its own children could start from it):
    held, it would keep the server, and so the worker, running after a trainer killed outright.
    The fork server's has no public name: where it is missing, skipped."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    multiprocessing.current_process()._config["tempdir"] = sockets
    server = fork_server()
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def fork_server():
    # multiprocessing's fork server of this process (a private name), if it has imported one
    return getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)


def end_workers():
    """Kills this process's daemon children, its DataLoader workers, which ignore SIGTERM. SIGCHLD's
    handler is reset first: the DataLoader would report the kills as its workers failing."""
    if hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def end_fork_server():
    """Ends the fork server that started this process's workers (Python 3.14's default, or
    workers.py's), once they are gone: its pipe from this process closed, the server ends; waited
    for up to 5 s, then killed (multiprocessing's own tears down what it preloaded, torch too,
    and would outlive the run)."""
    server = fork_server()
    pid = getattr(server, "_forkserver_pid", None)
    if not pid:
        return
    os.close(server._forkserver_alive_fd)
    with contextlib.suppress(ChildProcessError):
        for _ in range(50):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)


# ==== the entry point: main, then its ending's line and status, then the exit
def run_and_exit(main, parse_args):
    """Calls main(parse_args()), then leaves: an ending prints its one line, and its status is the
    process's."""
    code, ended, inherited = 0, False, mp_temp_dir()
    try:
        main(parse_args())
    except (Exception, KeyboardInterrupt) as e:  # (SystemExit passes: --help's)
        code, ended = end_with_its_line(ending(e)), True  # (no reference to e is left after)
    finally:
        end_workers()
        if dist.is_initialized():
            # kept until os._exit. Freed by leave()'s gc along with DDP's Reducer, which holds the
            # GIL, the group would wait for its gloo threads; one of them may be waiting for the
            # GIL to free the last collective's tensors. A deadlock (pytorch/pytorch#56297): 1 stop
            # in 80 on 2 busy cores, ended only by the launcher's SIGKILL
            KEPT.append(dist.group.WORLD)
            dist.destroy_process_group()
    leave(code, ended, inherited)


def ending(e):
    """Returns the Ending that exception `e` means: an Ending is its own; Ctrl-C before the first
    step, a stop with nothing saved; a timeout or a lost peer across a pause of the whole job, a
    line that blames nobody; one before the ranks joined, a launch mistake; any error after a stop
    signal (a peer that stopped first) the signal's status, silently, but after SIGUSR1, whose
    status 0 would hide a crash, and but a peer lost outside an agreed stop; a timeout (a
    collective, a worker) a Hang, and a lost peer; any other error its traceback, printed here,
    and exit 1."""
    why = str(e).strip().split("\n")[0]
    timeout, lost = re.search("timed out|timeout", why.lower()), peer_lost(why)
    if isinstance(e, Ending):
        return e
    if isinstance(e, KeyboardInterrupt):
        return Stopped(signal.SIGINT)
    if (timeout or lost) and STOP.paused():  # all the job paused: nobody to blame
        return Hang("a collective failed after this process was paused (SIGSTOP or Ctrl-Z, then "
                    "SIGCONT) longer than --step-timeout, which gloo and NCCL count too: nobody "
                    "froze, but the run ends here; --resume auto continues", printer=None)
    if (timeout or lost or "EADDRINUSE" in why) and not STOP.joined and launched():
        return UsageError(joining_failed(why), printer=None)
    if STOP.received not in (0, SIGUSR1) and (STOP.agreed or not lost):
        return Stopped(STOP.received, printer=-1)
    if timeout:
        return Hang(f"{why} (--step-timeout): a rank or a worker stopped answering", printer=None)
    if lost:  # (named by train_extras/hangs.py, where it is)
        said = re.sub(r"\[\S+:\d+\] |\. This is typically.*", "", why)  # gloo's source and advice
        return Hang(f"a peer's connection closed ({said}): a rank is gone", printer=None)
    traceback.print_exception(e)
    return Failed(why, printer=-1)


def end_with_its_line(e):
    """Returns ending `e`'s exit status, once this process has ignored SIGTERM from now on and ended
    its DataLoader workers (leaving anyway: neither a launcher's SIGTERM nor the DataLoader's check
    of its workers cuts the rest short), printed `e`'s line on its printer's rank (the rank its
    launcher names), and, where others must print or exit first, waited: before the process group,
    3 s (torchrun's SIGTERM would kill peers still starting: exit -15, not 2), else 0.5 s on ranks
    that print nothing (rank 0 says why before the others exit)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_workers()
    if e.printer != -1:  # (-1: said already, a traceback, or by a peer)
        printer = e.printer in (None, (launched() or [0])[0])
        if printer:
            print(e if isinstance(e, Stopped) else f"error: {e}", file=sys.stderr, flush=True)
        time.sleep(3 if not dist.is_initialized() and launched() else 0 if printer else 0.5)
    return e.code


def leave(code, ended, inherited):
    """Leaves the process by os._exit, not by the interpreter's teardown, where gloo's threads now
    and then hang or abort it (pytorch/pytorch#190489). Every file is closed by now. First: frees
    a DataLoader left mid-epoch (where an ending came); waits, up to 1 s, for each thread of a
    DataLoader's queues, which holds the queue's 2 named semaphores until it ends (else the
    resource tracker warns of them as leaked); ends the fork server; removes multiprocessing's own
    temporary folder (pymp-*, the fork server's socket), made here, which only its exit handler
    would."""
    if ended:
        gc.collect()
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(timeout=1)
    end_fork_server()
    if mp_temp_dir() not in (None, inherited):
        shutil.rmtree(mp_temp_dir(), ignore_errors=True)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def mp_temp_dir():
    # multiprocessing's pymp-* folder, inherited from a parent process or made here (private name)
    return multiprocessing.current_process()._config.get("tempdir")
