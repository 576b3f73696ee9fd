"""benchmarks/gpu_report.py, checked on the CPU: its dry run (both parts: tests/test_gpu.py on the CPU, and every
bench configuration, small), how it judges the targets, and its refusal without a GPU. So that the first minutes of
a GPU machine go to results, not to a typo."""
import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, clean_env

REPORT = os.path.join(ROOT, "benchmarks", "gpu_report.py")
FLOOR = "2.11."  # the oldest supported torch (CI's floor leg)


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_targets_are_judged_from_the_rows():
    judge = load_report().judge

    def row(config, name, speed, ratio=1.0):
        return {"config_index": config, "name": name, "samples_per_s": speed, "ratio_to_bare": ratio}
    rows = [row(0, "bare", 1000), row(0, "dp_train.py", 960, 0.96), row(0, "ddp_amp_train.py", 990, 0.99),
            row(1, "bare", 2100), row(1, "ddp_amp_train.py", 2050), row(2, "bare", 5000),
            row(2, "ddp_launch_train.py", 4900), row(3, "bare", 6000), row(3, "ddp_launch_train.py", 5500)]
    scripts, amp, compiled = judge(rows)
    assert scripts["verdict"] == "met" and scripts["value"] == "lowest median 0.96 (dp_train.py)"
    assert amp["verdict"] == "met" and amp["value"].startswith("2.05x (the bare loop in bf16 + channels-last: 2.10x)")
    assert compiled["verdict"] == "met" and compiled["value"].startswith("1.12x eager (the bare loop: 1.20x)")
    rows[1]["ratio_to_bare"], rows[4]["samples_per_s"], rows[8]["samples_per_s"] = 0.94, 1700, 4800
    assert [t["verdict"] for t in judge(rows)] == ["NOT met"] * 3
    only_first = [row(0, "bare", 1000), row(0, "dp_train.py", 960, 0.96)]
    assert [t["verdict"] for t in judge(only_first)] == ["met", "not measured", "not measured"]


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, REPORT, "--part", "tests"], cwd=ROOT, env=clean_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: no CUDA GPU here: run this on a GPU machine, or --dry-run to check it on the CPU"]
    p = subprocess.run([sys.executable, REPORT], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "--part tests or --part bench" in p.stderr
    p = subprocess.run([sys.executable, REPORT, "--dry-run", "--configs", "0,7"], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--configs: numbers from 0 to 3" in p.stderr


@pytest.mark.slow
@pytest.mark.floor
@pytest.mark.skipif(not torch.__version__.startswith(FLOOR) and not os.environ.get("GPU_DRY_RUN"),
                    reason=f"the dry run proves the GPU tests and report on the oldest supported torch, {FLOOR}x "
                    "(CI's floor leg); GPU_DRY_RUN=1 runs it on this one")
def test_dry_run_runs_both_parts_on_the_cpu(tmp_path):
    """The report's two parts on the CPU, as they will run on a GPU (two pytest processes side by side, every bench
    configuration): every GPU test passes, or skips saying it needs a GPU; every configuration gives its rows and the
    three targets are judged (their values mean nothing here)."""
    p = subprocess.run([sys.executable, REPORT, "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=clean_env(),
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    tests = json.loads((tmp_path / "tests.json").read_text())
    assert tests["machine"]["dry_run"] and tests["exit_codes"] == [0, 0]
    names = {t["name"].split("[")[0] for t in tests["tests"]}
    defined = {f.name for f in ast.parse(open(os.path.join(ROOT, "tests", "test_gpu.py")).read()).body
               if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    assert names == defined  # every test ran in one of the two processes, none twice
    assert len(tests["tests"]) == len({t["name"] for t in tests["tests"]})
    skipped = [t for t in tests["tests"] if t["outcome"] == "skipped"]
    assert all("dry run on the CPU" in t["message"] for t in skipped), skipped
    assert {t["outcome"] for t in tests["tests"]} == {"passed", "skipped"}
    assert len({t["name"].split("[")[0] for t in skipped}) <= 5, skipped  # those that need a GPU's own features
    recorded = {k for t in tests["tests"] for k in t["recorded"]}
    assert {"val_acc", "val_acc_cpu", "fsdp_world_size", "param_bytes_rank0_of_2", "max_diff_cpu_gpu_cpu"} <= recorded
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert {r["config_index"] for r in bench["rows"]} == {0, 1, 2, 3}
    assert [r["name"] for r in bench["rows"] if r["config_index"] == 0] == [
        "bare", "dp_train.py", "ddp_launch_train.py", "ddp_spawn_train.py", "ddp_amp_train.py"]
    assert all(r["samples_per_s"] > 0 and r["repeats"] == 1 for r in bench["rows"])
    assert [t["verdict"] in ("met", "NOT met") for t in bench["targets"]] == [True] * 3
    for name in ("tests", "bench"):
        assert "DRY RUN on the CPU" in (tmp_path / f"{name}.md").read_text().splitlines()[0]
    assert "where the" in p.stdout and "all:" in p.stdout
