"""benchmarks/bench.py on CPU: a smoke run of every reference at world size 2 (each with its script, and the weights
checked equal), a planted script that takes one step fewer (the weight check must fail), and how the rows are judged.
Nothing about speed is asserted: a shared machine's timings vary."""
import importlib.util
import json
import os
import re
import sys

import pytest

from hooks import Hooks
from processes import LAUNCHER_PICKS_PORT, ROOT, command, torchrun

BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
SMOKE = ["--device", "cpu", "--steps", "3", "--repeats", "1", "--batch-size", "8", "--timeout", "240"]


def bench(*args, timeout=900):
    # small runs: one thread each (clean_env), no oversubscription in the 2-process rows
    return command([sys.executable, BENCH, *args], timeout=timeout)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full
def test_smoke_run_of_every_reference_with_its_script(tmp_path):
    """DDP under torchrun, DDP under mp.spawn and fully_shard under torchrun, 2 processes each, every one between two
    runs of its reference: the rows, the ratios over the neighbouring reference runs, and the weights equal."""
    out = tmp_path / "bench.json"
    p = bench(*SMOKE, "--world-sizes", "2", "--scripts", "ddp_launch_train.py", "ddp_spawn_train.py",
              "fsdp_train.py", "--json", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert [(r["name"], r["reference"], r["world_size"]) for r in rows] == [
        ("ddp-torchrun", "ddp-torchrun", 2), ("ddp_launch_train.py", "ddp-torchrun", 2),
        ("ddp-spawn", "ddp-spawn", 2), ("ddp_spawn_train.py", "ddp-spawn", 2),
        ("fsdp-torchrun", "fsdp-torchrun", 2), ("fsdp_train.py", "fsdp-torchrun", 2)]
    for ref, script in zip(rows[::2], rows[1::2]):
        b = ref["samples_per_s_runs"]
        assert len(b) == 2 and ref["weights_differ"] == [None]  # the reference before and after: the same weights
        assert script["ratio_runs"] == [pytest.approx(script["samples_per_s"] / ((b[0] + b[1]) / 2))]
        assert script["weights_differ"] == [None] and script["verdict"]["weights"] == "met"
        assert script["reference_samples_per_s"] == ref["samples_per_s"]
        for r in (ref, script):
            assert r["samples_per_s"] > 0 and r["startup_s"] > 0 and r["peak_mem_mb"] > 0 and r["threads"] >= 1
            assert r["global_batch"] == 8 and r["repeats"] == 1
        assert (script["eval_s"] is None, ref["eval_s"]) == (False, None)
    assert rows[1]["launch"] == "torchrun --nproc_per_node=2 ddp_launch_train.py"
    assert rows[3]["launch"] == "python ddp_spawn_train.py --nprocs 2"
    table = p.stdout.splitlines()
    assert sum(line.startswith(("DDP under", "fully_shard under", "torchrun", "python ")) for line in table) == 6
    assert re.search(r"^parity: ", p.stdout, re.M), p.stdout


# bench.py with the script rows' commands given --max-steps one short of the reference's
FEWER_STEPS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
groups = bench.groups
bench.groups = lambda a, threads: [
    (ref, [(*row[:2], row[2] + ["--max-steps", str(a.steps - 1)], *row[3:]) for row in rows])
    for ref, rows in groups(a, threads)]
bench.main(bench.parse_args(sys.argv[2:]))
"""


@pytest.mark.full
def test_the_weight_check_fails_when_a_script_takes_one_step_fewer():
    """dp_train.py against the bare loop, as it is (weights equal), then planted: the script's command gets
    --max-steps one short of the reference's. The benchmark must say the weights differ, and exit non-zero."""
    args = SMOKE + ["--world-sizes", "1", "--scripts", "dp_train.py"]
    p = bench(*args)
    assert p.returncode == 0 and "dp_train.py x1: " in p.stdout and "weights met" in p.stdout, p.stdout + p.stderr
    p = command([sys.executable, "-c", FEWER_STEPS, BENCH, *args], timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("weights differ from the reference's: dp_train.py"), p.stderr
    assert "weights NOT met: " in p.stdout


def test_each_row_is_judged_against_its_reference():
    """The four verdicts: speed (median ratio at least 0.95, decided only where the reference's own runs stay within
    5% of their median), memory (at most the reference's + 5%), start-up (at most 1.5 s more), weights (equal,
    decided only where the reference equals itself)."""
    judge = load_bench().judge
    ref = {"ratio_runs": [0.97, 1.0, 1.04], "peak_mem_mb": 1000.0, "startup_s": 3.0, "weights_differ": [None, None]}
    row = {"ratio": 0.95, "peak_mem_mb": 1050.0, "startup_s": 4.5, "weights_differ": [None]}
    assert judge(row, ref) == {"speed": "met", "memory": "met", "startup": "met", "weights": "met"}
    worse = {"ratio": 0.94, "peak_mem_mb": 1051.0, "startup_s": 4.6, "weights_differ": [None, "fc1.bias"]}
    assert judge(worse, ref) == {"speed": "NOT met", "memory": "NOT met", "startup": "NOT met",
                                 "weights": "NOT met: fc1.bias"}
    busy = {**ref, "ratio_runs": [0.94, 1.0], "weights_differ": ["conv1.weight"]}
    assert judge(row, busy)["speed"] == "undecided: the reference spread"
    assert judge(worse, busy)["weights"] == "undecided: the reference differs from itself"


@pytest.mark.full
def test_loader_benchmark_runs_every_pipeline(tmp_path):
    out = tmp_path / "loader.json"
    p = command([sys.executable, os.path.join(ROOT, "benchmarks", "loader.py"), "--images", "8", "--batch-size", "4",
                 "--repeats", "1", "--workers", "1", "--json", out], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"baseline", "scripts", "pretrained"} and rows["baseline"]["ratio_to_baseline"] == 1.0
    assert all(r["images_per_s"] > 0 and r["jpeg_kb"] > 10 and len(r["ratio_runs"]) == 1 for r in rows.values())


@pytest.mark.full
def test_bad_arguments_exit_before_running_anything():
    p = bench("--device", "cpu", "--steps", "1", timeout=120)
    assert p.returncode == 2 and "--steps must be at least 2" in p.stderr
    p = bench("--device", "cpu", "--batch-size", "7", timeout=120)  # 2-process rows need an even global batch
    assert p.returncode == 2 and "must divide over 2 processes" in p.stderr


@pytest.mark.full
def test_checkpoint_benchmark_times_every_format(tmp_path):
    """benchmarks/checkpoint.py under torchrun: a row per format, each rank's numbers, and the saves on disk; every
    rank leaves by os._exit, as the scripts do (the interpreter's teardown now and then aborts a process whose gloo
    threads DTensor's caches keep alive: pytorch/pytorch#190489)."""
    out, hooks = tmp_path / "ckpt.json", Hooks(tmp_path)
    p = command(torchrun("--nproc_per_node=2", *LAUNCHER_PICKS_PORT, os.path.join(ROOT, "benchmarks", "checkpoint.py"),
                         "--model", "cnn", "--repeats", "1", "--out-dir", tmp_path / "saves", "--json", out),
                env=hooks.env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert hooks.exits() == {0: 0, 1: 0} and not hooks.ranks("teardown"), (hooks.exits(), hooks.ranks("teardown"))
    rows = json.loads(out.read_text())
    assert [r["format"] for r in rows] == ["file", "dcp", "dcp --async-save"]
    for r in rows:
        assert r["world_size"] == 2 and len(r["runs"]) == 1 and len(r["rise_mib_per_rank"]) == 2
        assert 0 < r["blocked_s"] <= r["written_s"]
    assert os.listdir(tmp_path / "saves" / "file") == ["last.pt"]
    # one trained step, then saves at steps 2, 3 and 4: file, dcp, async
    assert os.listdir(tmp_path / "saves" / "dcp") == ["ckpt-3"]
    assert os.listdir(tmp_path / "saves" / "async") == ["ckpt-4"]


# ---- benchmarks/scaling.py: the figures docs/scaling.md publishes, reproduced by the commands it gives
SCALING = os.path.join(ROOT, "benchmarks", "scaling.py")
SCALING_DOC = os.path.join(ROOT, "docs", "scaling.md")
# the commands behind docs/scaling.md's three tables, in order: the H100 projection (its ```bash block), --check, and
# "--batch-per-gpu 32 --bandwidth 25 --bandwidth 50, otherwise as above"
SCALING_RUNS = [["--images-per-s-one-gpu", "2470", "--batch-per-gpu", "256", "--bandwidth", "450", "--bandwidth", "25",
                 "--bandwidth", "50"],
                ["--check"],
                ["--images-per-s-one-gpu", "2470", "--batch-per-gpu", "32", "--bandwidth", "25", "--bandwidth", "50"]]


def markdown_tables(text):
    """Each table of `text` (indented ones too): a list of rows, each a list of its cells' text."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def test_scaling_reproduces_every_published_figure():
    """Every cell of docs/scaling.md's tables is what benchmarks/scaling.py prints today for the command the doc
    gives (to the printed digit: 0.1 ms, one image/s, 0.1%, 0.01x), and the prose's step times are the projection's:
    a constant changed in scaling.py (parameters, bucket size, backward share, a reference's inputs) shows here."""
    doc = open(SCALING_DOC).read()
    block = re.search(r"```bash\n(.*?)```", doc, re.S).group(1).replace("\\\n", " ").split()
    assert block == ["python", "benchmarks/scaling.py", *SCALING_RUNS[0]]  # the first command: the doc's ```bash block
    published = markdown_tables(doc)
    assert len(published) == len(SCALING_RUNS)
    outputs = []
    for args, table in zip(SCALING_RUNS, published):
        p = command([sys.executable, SCALING, *args], timeout=60)
        assert p.returncode == 0, p.stderr
        projected = markdown_tables(p.stdout)
        assert len(projected) == 1, p.stdout
        assert projected[0][0] == table[0]  # the same columns
        for ours, theirs in zip(projected[0], table):
            assert ours == theirs, f"scaling.py {' '.join(args)}: {ours}\n  but docs/scaling.md has {theirs}"
        assert len(projected[0]) == len(table)
        outputs.append(p.stdout)
    # "A step computes for 103.6 ms, 69.1 ms of it backward": the first run's own header line
    compute, backward = re.search(r"A step computes for ([\d.]+) ms, ([\d.]+) ms of it backward", doc).groups()
    assert f"compute {compute} ms per step, backward {backward} ms" in outputs[0], outputs[0]


def test_scaling_check_is_within_its_stated_error_of_the_published_figures():
    """Each reference of docs/scaling.md's --check table: scaling.py's projection (unrounded) over the published
    images/s per GPU (as the doc gives it, to one image/s) is the doc's `projected / published` (to 0.1%)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("scaling", SCALING)
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    head, _, *rows = markdown_tables(open(SCALING_DOC).read())[1]
    col = {name: i for i, name in enumerate(head)}
    assert len(rows) == len(scaling.REFERENCES) == 3
    for row in rows:
        name, stated = row[col["reference"]], float(row[col["projected / published"]].rstrip("%"))
        published = float(row[col["images/s per GPU: projected"] + 1].replace(",", ""))  # its 'published' beside
        _, one_gpu, batch, gpus, gb_per_s, *_ = next(r for r in scaling.REFERENCES if r[0] == name)
        assert (gpus, gb_per_s) == (int(row[col["GPUs"]]), float(row[col["GB/s"]]))
        _, per_gpu, _ = scaling.project(one_gpu, batch, gpus, gb_per_s)
        # the doc's published figure is rounded to one image/s, its error to 0.1%: within both roundings
        low, high = per_gpu / (published + 0.5) * 100 - 100, per_gpu / (published - 0.5) * 100 - 100
        assert low <= stated + 0.05 and stated - 0.05 <= high, f"{name}: projected {per_gpu:.1f}/s per GPU is " \
            f"{low:+.2f}% to {high:+.2f}% of the published {published:g}/s, not the stated {stated:+.1f}%"


def test_checkpoint_read_benchmark_times_the_check_and_the_load():
    """benchmarks/checkpoint_read.py: the file's size and both timings, each a number."""
    p = command([sys.executable, os.path.join(ROOT, "benchmarks", "checkpoint_read.py"), "--model", "resnet18",
                 "--repeats", 2], timeout=300)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^resnet18: last\.pt of \d+ MiB, 2 repeats", p.stdout, re.M), p.stdout
    for what in ("failsafe.refuse_unreadable:", "torch.load:"):
        assert re.search(rf"^{re.escape(what)} +[\d.]+, [\d.]+, [\d.]+$", p.stdout, re.M), p.stdout
