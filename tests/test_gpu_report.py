"""benchmarks/gpu_report.py, checked on the CPU: its dry run (both parts: tests/test_gpu.py on the CPU, and every
bench configuration, small), how it judges the targets, and its refusal without a GPU. So that the first minutes of
a GPU machine go to results, not to a typo."""
import ast
import importlib.util
import json
import os
import sys

import pytest
import torch

from processes import ROOT, command

REPORT = os.path.join(ROOT, "benchmarks", "gpu_report.py")
FLOOR = "2.11."  # the oldest supported torch (CI's floor leg)


def load_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_targets_are_judged_from_the_rows():
    judge = load_report().judge

    def row(config, name, speed, ratio=1.0, world_size=1, weights="met"):
        reference = name if "." not in name else "bare" if name == "dp_train.py" else "ddp-torchrun"
        return {"config_index": config, "name": name, "reference": reference, "samples_per_s": speed, "ratio": ratio,
                "world_size": world_size, **({"verdict": {"weights": weights}} if "." in name else {})}
    rows = [row(0, "ddp-torchrun", 1000), row(0, "dp_train.py", 960, 0.96), row(0, "ddp_amp_train.py", 990, 0.99),
            row(1, "ddp-torchrun", 2100), row(1, "ddp_amp_train.py", 2050), row(2, "ddp-torchrun", 5000),
            row(2, "ddp_launch_train.py", 4900), row(3, "ddp-torchrun", 6000), row(3, "ddp_launch_train.py", 5500),
            row(4, "ddp_launch_train.py", 3000, 0.97, 2), row(4, "fsdp_train.py", 2000, 0.98, 2)]
    scripts, amp, compiled, two = judge(rows)
    assert scripts["verdict"] == "met" and scripts["value"] == "lowest median 0.96 (dp_train.py x1)"
    assert amp["verdict"] == "met" and amp["value"].startswith("2.05x (the reference in bf16 + channels-last: 2.10x)")
    assert compiled["verdict"] == "met" and compiled["value"].startswith("1.12x eager (its reference: 1.20x)")
    assert two["verdict"] == "met" and two["value"] == "lowest median 0.97 (ddp_launch_train.py x2)"
    rows[1]["ratio"], rows[4]["samples_per_s"], rows[8]["samples_per_s"] = 0.94, 1700, 4800
    rows[10]["verdict"]["weights"] = "NOT met: fc.bias"
    assert [t["verdict"] for t in judge(rows)] == ["NOT met"] * 4
    assert judge(rows)[3]["value"].endswith("; weights not equal: fsdp_train.py x2")
    only_first = [row(0, "bare", 1000), row(0, "dp_train.py", 960, 0.96)]
    assert [t["verdict"] for t in judge(only_first)] == ["met"] + ["not measured"] * 3


def test_without_a_gpu_it_says_so_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = command([sys.executable, REPORT, "--part", "tests"])
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        "error: no CUDA GPU here: run this on a GPU machine, or --dry-run to check it on the CPU"]
    p = command([sys.executable, REPORT])
    assert p.returncode == 2 and "--part tests or --part bench" in p.stderr
    p = command([sys.executable, REPORT, "--dry-run", "--configs", "0,7"])
    assert p.returncode == 2 and "--configs: numbers from 0 to 4" in p.stderr


@pytest.mark.full
@pytest.mark.floor
@pytest.mark.skipif(not torch.__version__.startswith(FLOOR) and not os.environ.get("GPU_DRY_RUN"),
                    reason=f"the dry run proves the GPU tests and report on the oldest supported torch, {FLOOR}x "
                    "(CI's floor leg); GPU_DRY_RUN=1 runs it on this one")
def test_dry_run_runs_both_parts_on_the_cpu(tmp_path):
    """The report's two parts on the CPU, as they will run on a GPU (two pytest processes side by side, every bench
    configuration): every GPU test passes, or skips saying it needs a GPU; every configuration gives its rows and the
    three targets are judged (their values mean nothing here)."""
    p = command([sys.executable, REPORT, "--dry-run", "--out", tmp_path], timeout=1200)
    why = [line for line in (p.stdout + p.stderr).splitlines() if "FAILED" in line or "exited" in line]
    assert p.returncode == 0, "\n".join(why) + "\n" + p.stdout[-5000:] + p.stderr[-3000:]
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
    assert {r["config_index"] for r in bench["rows"]} == {0, 1, 2, 3, 4}
    assert [r["name"] for r in bench["rows"] if r["config_index"] == 0] == [
        "bare", "dp_train.py", "ddp-torchrun", "ddp_launch_train.py", "ddp_amp_train.py", "ddp-spawn",
        "ddp_spawn_train.py", "fsdp-torchrun", "fsdp_train.py"]
    assert {(r["name"], r["world_size"]) for r in bench["rows"] if r["config_index"] == 4} == {
        ("ddp-torchrun", 2), ("ddp_launch_train.py", 2), ("ddp_amp_train.py", 2), ("ddp-spawn", 2),
        ("ddp_spawn_train.py", 2), ("fsdp-torchrun", 2), ("fsdp_train.py", 2)}
    assert all(r["samples_per_s"] > 0 and r["repeats"] == 1 for r in bench["rows"])
    assert all(r["verdict"]["weights"] == "met" for r in bench["rows"] if "verdict" in r)
    assert [t["verdict"] in ("met", "NOT met") for t in bench["targets"]] == [True] * 4
    for name in ("tests", "bench"):
        assert "DRY RUN on the CPU" in (tmp_path / f"{name}.md").read_text().splitlines()[0]
    assert "where the" in p.stdout and "all:" in p.stdout
