"""The scripts are deliberate copies of each other, so that each reads alone. This keeps them honest: outside
their launch-specific setup, ddp_spawn_train.py and ddp_amp_train.py may differ from ddp_launch_train.py only in
lines that are about their launch style or precision. A fix made in one script and not the others fails here."""
import ast
import difflib
import os

import pytest

from conftest import ROOT, clean_env

ALLOWED = {  # script: words that every line it changes (outside the setup section) must contain one of
    "ddp_spawn_train.py": ["ddp_spawn_train"],
    "ddp_amp_train.py": ["autocast", "scaler", "precision", "backward()", "optimizer.step()", "ddp_amp_train",
                         '"args": vars(args)', 'print(f"ddp'],
}
# fsdp_train.py adds sharding, memory accounting and padded evaluation; it may drop only these shared lines
FSDP_MAY_DROP = ["DDP", "weights", "rank)", "sync_bn", "SyncBatchNorm", 'print(f"ddp', "global_batch}", "first_step_time",
                 "micro", "no_sync", "loss = F.cross_entropy", "running statistics", "evaluate(", "peak_mem_mb",
                 "Loss and accuracy"]


def shared_part(script):
    """From the data section to the end of evaluate(): what every DDP script does the same way."""
    text = open(os.path.join(ROOT, script)).read()
    start = text.index("    # ---- data")
    end = min(i for i in (text.find("\ndef worker"), text.find("\nif __name__")) if i > 0)
    return [line.strip() for line in text[start:end].splitlines() if line.strip()]


def changed_lines(script):
    diff = difflib.unified_diff(shared_part("ddp_launch_train.py"), shared_part(script), n=0, lineterm="")
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.mark.floor
@pytest.mark.parametrize("script", ALLOWED)
def test_scripts_differ_only_in_launch_style(script):
    unexpected = [line for line in changed_lines(script) if not any(word in line for word in ALLOWED[script])]
    assert not unexpected, "\n".join(unexpected)


@pytest.mark.floor
def test_fsdp_keeps_the_shared_lines():
    dropped = [line for line in changed_lines("fsdp_train.py") if line.startswith("-")]
    unexpected = [line for line in dropped if not any(word in line for word in FSDP_MAY_DROP)]
    assert not unexpected, "\n".join(unexpected)


def function_source(script, name):
    text = open(os.path.join(ROOT, script)).read()
    return next(ast.get_source_segment(text, node) for node in ast.parse(text).body
                if isinstance(node, ast.FunctionDef) and node.name == name)


@pytest.mark.floor
def test_torchrun_scripts_read_the_launcher_alike():
    """launcher_env() lies before the compared part: its copies in the three torchrun scripts must be the same."""
    ref = function_source("ddp_launch_train.py", "launcher_env")
    for script in ("ddp_amp_train.py", "fsdp_train.py"):
        assert function_source(script, "launcher_env") == ref, f"{script}: launcher_env() differs"


def launcher_scripts():
    """Every script that a launcher starts (torchrun, srun, the old torch.distributed.launch), present or future."""
    return sorted(f for f in os.listdir(ROOT)
                  if f.endswith("_train.py") and "def launcher_env" in open(os.path.join(ROOT, f)).read())


PARSE_ONLY = """
import argparse, json, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(parser, *args, **kwargs):
    ns = parse(parser, *args, **kwargs)
    print(json.dumps([sys.argv, ns.local_rank, parser.format_help()]))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
for script in sys.argv[1:]:
    for form in ("--local-rank=3", "--local_rank=3"):
        sys.argv = [script, form, "--epochs", "1"]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            assert e.code == 0, sys.argv
"""


@pytest.mark.floor
def test_launcher_scripts_take_the_old_launchers_local_rank_without_listing_it():
    """torch.distributed.launch (without --use-env) puts --local-rank=N before the script's arguments; older
    versions wrote --local_rank=N. Both are accepted, and neither is shown among the script's own flags."""
    import json
    import subprocess
    import sys
    scripts = launcher_scripts()
    assert {"ddp_launch_train.py", "ddp_amp_train.py", "fsdp_train.py"} <= set(scripts)
    p = subprocess.run([sys.executable, "-c", PARSE_ONLY, *scripts], cwd=ROOT, env=clean_env(), capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    parsed = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(parsed) == 2 * len(scripts)
    for argv, local_rank, usage in parsed:
        assert local_rank == 3 and "--epochs" in usage and "--local" not in usage, argv
