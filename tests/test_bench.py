"""benchmarks/bench.py end to end on CPU: a smoke run of every row (the bare loop, the four scripts at world size 1,
the two 2-process launches) and its JSON output. Nothing about speed is asserted: a shared machine's timings vary."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import LAUNCHER_PICKS_PORT, ROOT, clean_env

BENCH = os.path.join(ROOT, "benchmarks", "bench.py")
ROWS = {("bare", 1), ("dp_train.py", 1), ("ddp_launch_train.py", 1), ("ddp_spawn_train.py", 1), ("ddp_amp_train.py", 1),
        ("ddp_spawn_train.py", 2), ("torchrun ddp_launch_train.py", 2)}


def bench(*args, timeout=900):
    # small runs: one thread each (clean_env), no oversubscription in the 2-process rows
    return subprocess.run([sys.executable, BENCH, *args], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_smoke_run_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    p = bench("--device", "cpu", "--steps", "3", "--repeats", "1", "--batch-size", "8", "--timeout", "240",
              "--json", str(out))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert {(r["name"], r["world_size"]) for r in rows} == ROWS and len(rows) == len(ROWS)
    for r in rows:
        assert r["device"] == "cpu" and r["precision"] == "fp32" and r["global_batch"] == 8
        assert isinstance(r["ratio_to_bare"], float) and math.isfinite(r["ratio_to_bare"]) and r["ratio_to_bare"] > 0
        assert r["samples_per_s"] > 0 and r["startup_s"] > 0 and r["peak_mem_mb"] > 0
        assert (r["eval_s"] is None) == (r["name"] == "bare")
    # the bare loop ran first and after every script (in the listed order, the first repeat): each script's ratio is
    # over the mean of the bare runs around it, and each bare run in between is over the mean of its neighbours
    bare, scripts = rows[0], rows[1:]
    assert bare["name"] == "bare" and bare["ratio_to_bare"] == 1.0
    b = bare["samples_per_s_runs"]
    assert len(b) == len(scripts) + 1
    assert bare["ratio_runs"] == pytest.approx([y / ((x + z) / 2) for x, y, z in zip(b, b[1:], b[2:])])
    for i, r in enumerate(scripts):
        assert len(r["samples_per_s_runs"]) == 1 and r["ratio_runs"] == [r["ratio_to_bare"]]
        assert r["ratio_to_bare"] == pytest.approx(r["samples_per_s"] / ((b[i] + b[i + 1]) / 2))
    table = p.stdout.splitlines()
    assert all(any(line.startswith(name + " ") for line in table) for name, _ in ROWS), p.stdout  # one table row each


def test_the_verdict_says_when_the_machine_was_too_busy_to_decide():
    """The closing line judges the medians, and says when the bare loop against itself spread more than 0.05:
    then single ratios spread as far, and a median of a few repeats cannot tell 0.94 from 0.96."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def table(itself, *scripts):
        return [{"name": "bare", "world_size": 1, "ratio_to_bare": 1.0, "ratio_runs": itself}] + [
            {"name": n, "world_size": ws, "ratio_to_bare": x, "ratio_runs": [x]} for n, ws, x in scripts]
    quiet = bench.verdict(table([0.97, 1.04], ("a.py", 1, 0.96), ("b.py", 1, 0.99), ("two", 2, 0.70)))
    assert quiet == "world size 1, median ratio at least 0.95: met"
    low = bench.verdict(table([0.96], ("a.py", 1, 0.94), ("b.py", 1, 1.07)))
    assert low.startswith("world size 1, median ratio at least 0.95: NOT met: a.py;") and "above 1.05" in low
    assert "b.py" in low and "too busy" not in low
    busy = bench.verdict(table([0.80, 1.02, 1.26], ("a.py", 1, 0.93)))
    assert busy.splitlines()[1].startswith("but the bare loop against itself spread 0.80-1.26")
    assert "too busy" in bench.verdict(table([1.06], ("a.py", 1, 0.97)))
    assert "too busy" not in bench.verdict(table([], ("a.py", 1, 0.97)))  # one script: no bare run in between


def test_the_bare_loop_trains_on_the_scripts_data(tmp_path, monkeypatch):
    """The reference does the scripts' work: it builds their data with common.load_data on the flags the script rows
    get, and trains on every sample of it, one tensor index per batch (not on a few batches of randn, which made it
    slower than the scripts: see bare_loop)."""
    import argparse
    import importlib.util
    import torch
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from torch.utils.data import TensorDataset
    built, seen, load_data, get = [], [], bench.common.load_data, TensorDataset.__getitem__
    monkeypatch.setattr(bench.common, "load_data", lambda args, download=False: built.append(args) or load_data(args))
    monkeypatch.setattr(TensorDataset, "__getitem__", lambda ds, index: seen.append(index) or get(ds, index))
    a = argparse.Namespace(device="cpu", model="cnn", channels_last=False, compile=False, steps=3, batch_size=8,
                           val_size=None,
                           precision="fp32", shape=bench.DEFAULT_SHAPE, out_dir=str(tmp_path))
    threads = torch.get_num_threads()
    try:
        bench.bare_loop(a)
    finally:
        torch.set_num_threads(threads)
    script_args = bench.common.get_parser("").parse_args(bench.script_flags(a) + ["--batch-size", "8"])
    assert len(built) == 1 and vars(built[0]) == vars(script_args) and built[0].train_size == 24
    batches = [i for i in seen if not isinstance(i, int)]  # (channels_and_classes looks at sample 0)
    assert sorted(torch.cat(batches).tolist()) == list(range(24)) and all(len(i) == 8 for i in batches)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["samples_per_s"] > 0 and row["world_size"] == 1 and row["eval_time_s"] is None


def test_loader_benchmark_runs_every_pipeline(tmp_path):
    out = tmp_path / "loader.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "loader.py"), "--images", "8",
                        "--batch-size", "4", "--repeats", "1", "--workers", "1", "--json", str(out)], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"baseline", "scripts", "pretrained"} and rows["baseline"]["ratio_to_baseline"] == 1.0
    assert all(r["images_per_s"] > 0 and r["jpeg_kb"] > 10 and len(r["ratio_runs"]) == 1 for r in rows.values())


def test_bad_arguments_exit_before_running_anything():
    p = bench("--device", "cpu", "--steps", "1", timeout=120)
    assert p.returncode == 2 and "--steps must be at least 2" in p.stderr
    p = bench("--device", "cpu", "--batch-size", "7", timeout=120)  # 2-process rows need an even global batch
    assert p.returncode != 0 and "even --batch-size" in p.stderr


@pytest.mark.slow
def test_checkpoint_benchmark_times_every_format(tmp_path):
    """benchmarks/checkpoint.py under torchrun: a row per format, each rank's numbers, and the saves on disk."""
    out = tmp_path / "ckpt.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        *LAUNCHER_PICKS_PORT, os.path.join(ROOT, "benchmarks", "checkpoint.py"), "--model",
                        "cnn", "--repeats", "1", "--out-dir", str(tmp_path / "saves"), "--json", str(out)],
                       cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
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
        p = subprocess.run([sys.executable, SCALING, *args], cwd=ROOT, env=clean_env(), capture_output=True,
                           text=True, timeout=60)
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
