"""Running a launcher (torchrun, mp.spawn's parent, srun) while a test watches it, and hooks that make the moments a
test acts in exact: a rank that waits at a given step, or stops answering there, a checkpoint save that waits
half-written, a sharded save that waits after writing its part, slow steps. The hooks are tests/site/sitecustomize.py on
PYTHONPATH, so that they reach every Python process of a run (torchrun's workers, mp.spawn's children, srun's tasks).
They patch only torch's and Python's own functions (an optimizer step hook, torch.save, DCP's
FileSystemWriter.write_data, signal.signal, sys.exit, os._exit), never the scripts' code: they mean the same whatever
common.py does inside.

Every hook leaves a mark, a file in the folder TEST_HOOKS names, and those that wait go on once the test creates the
file `go-pause`, `go-save` or `go-dcp` there (Hooks.go):

    steps-rank<r>          optimizer steps taken so far by rank r (this process's: a resumed run counts from 0)
    paused-rank<r>         rank r waits after its optimizer step TEST_PAUSE_AT ("step", or "rank:step" for that rank
                           alone; the file holds its pid)
    handled-<SIG>-<pid>    process pid has taken signal SIG: its Python handler is running
    exit-rank<r>           rank r, having trained, called sys.exit or os._exit: the status it asked for
    mp-tempdir-rank<r>     rank r's multiprocessing temporary folder (pymp-*) as it asked for its exit ("": none)
    teardown-rank<r>       rank r, having trained, went through the interpreter's teardown (not left by os._exit)
    group-threads-rank<r>  rank r, as it asked for its exit: how many of the threads that init_process_group started
                           are still running, and how many it started ("3 3"): a process group's destructor ends them
    saving-rank<r>         the TEST_STALL_SAVE-th checkpoint that rank r writes with torch.save is half on disk (JSON:
                           path, bytes written, bytes in all, pid): the other half follows `go-save`
    stalled-rank<r>        rank r's part of a sharded (DCP) save, from the TEST_STALL_DCP-th on, is written, but
                           write_data has not returned: the save is incomplete (ckpt-<step>.tmp) until
                           `go-dcp`, after which no save waits
    evaluating-rank<r>     rank r evaluates (TEST_EVAL_S): a batch's loss is being summed
    hung-rank<r>           rank r stops answering after its optimizer step TEST_HANG_AT ("rank:step"): an hour's
                           sleep, which a signal's Python handler does not end (the file holds its pid)
    <pid>.json in TEST_SEE_DIR   what that process saw while it trained: the dtype each Conv2d and Linear returned,
                           torch's threads and the CPUs of its affinity mask at the first such call, its rank
Each optimizer step takes TEST_STEP_S seconds more (a slow model), each evaluation batch TEST_EVAL_S (a long
evaluation: the scripts' loss summed over a batch, reduction="sum", is the evaluation's). The TEST_FAIL_SAVE-th
checkpoint that a process writes with torch.save fails, as on a full disk; the TEST_FAIL_METRICS-th row appended to
metrics.jsonl, as over a disk quota ("n"), or as on a disk that fills up mid-row ("n:short": half of it written).
"""
import os
import signal
from pathlib import Path

SITE = Path(__file__).resolve().parent / "site"  # sitecustomize.py: the hooks themselves


class Hooks:
    """The hooks (see the module's docstring) for the processes a test starts with `env`, and their marks."""

    def __init__(self, tmp_path, **settings):
        """settings: pause_at=step (or "rank:step"), stall_save=n, fail_save=n, fail_metrics=n or "n:short",
        stall_dcp=n, hang_at="rank:step", step_s=seconds, eval_s=seconds, see_dir=folder."""
        self.dir = Path(tmp_path) / "marks"
        self.dir.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
        self.env = {"PYTHONPATH": path, "TEST_HOOKS": str(self.dir),
                    **{f"TEST_{k.upper()}": str(v) for k, v in settings.items()}}

    def ranks(self, kind):
        """{rank: the text of its mark} for marks `<kind>-rank<r>`."""
        return {int(p.name.rsplit("rank", 1)[1]): p.read_text() for p in self.dir.glob(f"{kind}-rank*")}

    def steps(self):
        """{rank: the optimizer steps it took}."""
        return {r: int(text) for r, text in self.ranks("steps").items()}

    def paused(self):
        """{rank: pid} of the ranks waiting at TEST_PAUSE_AT."""
        return {r: int(text) for r, text in self.ranks("paused").items()}

    def evaluating(self):
        """The ranks evaluating (TEST_EVAL_S): they summed a batch's loss."""
        return sorted(self.ranks("evaluating"))

    def exits(self):
        """{rank: the status it asked sys.exit or os._exit for} (its own, unless a signal killed it first)."""
        return {r: int(text) for r, text in self.ranks("exit").items()}

    def group_threads(self):
        """{rank: (how many of the threads that init_process_group started still ran as it asked for its exit, how
        many it started)}: fewer than it started, its process group's destructor had run."""
        return {r: tuple(int(n) for n in text.split()) for r, text in self.ranks("group-threads").items()}

    def handled(self, pid, sig):
        return (self.dir / f"handled-{signal.Signals(sig).name}-{pid}").exists()

    def go(self, *what):
        """What waits goes on: `what` of "pause", "save", "dcp" (default: all)."""
        for name in what or ("pause", "save", "dcp"):
            (self.dir / f"go-{name}").touch()
