"""The scripts are deliberate copies of each other, so that each reads alone. This test keeps the copies honest.

Every step (top-level function) that a script shares with ddp_launch_train.py, and its `__main__` block, must do the
same, statement by statement (code, not comments or docstrings), except in the statements tagged with the script's
own marker, a comment holding `[amp]`, `[spawn]`, `[fsdp]` or `[dp]`:
- a tagged statement is the script's own: it may be added, or replace one statement of the reference in its place;
- a tagged comment on a line of its own lets the statements of the reference around it go, replaced by the script's
  tagged ones or by none (it says why they are not needed there);
- a tagged `def` (or `if __name__` line) makes the whole function the script's own;
- a tagged `with` makes only the wrapper the script's own: the statements inside it are still compared;
- a tagged `if`/`for`/`while`/`try` makes the whole block the script's own.
So a statement dropped from one script (say its `run.agreement.step_done(loss)`) or changed without a tag fails here."""
import ast
import copy
import difflib
import io
import os
import tokenize

import pytest

from processes import ROOT, command

REFERENCE = "ddp_launch_train.py"
TAGS = {"ddp_amp_train.py": "[amp]", "ddp_spawn_train.py": "[spawn]", "fsdp_train.py": "[fsdp]", "dp_train.py": "[dp]"}
STEPS = ["build_data", "build_model", "resume", "train_step", "train_one_epoch", "evaluate", "save", "main",
         "evaluate_and_log", "announce"]
BLOCKS = ("body", "orelse", "handlers", "finalbody")


def comments(source):
    """{line number: comment text} of a source file."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


DROP = "# (a tagged comment: the reference's statements here may go)"


def flatten(nodes, tagged, notes, depth=0, end=None):
    """[(depth, code, is_tagged)] for these statements, a compound one as its header followed by its blocks; a
    tagged comment line of its own (in `notes`, line numbers) as DROP, where it stands, up to line `end` (a function
    body's: after its last statement)."""
    out, previous = [], nodes[0].lineno - 1 if nodes else 0
    for node in nodes:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        out += [(depth, DROP, True) for n in notes if previous < n < first]
        previous = node.end_lineno
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue  # a docstring
        blocks = [(field, getattr(node, field)) for field in BLOCKS if getattr(node, field, None)]
        if not blocks:  # a simple statement: tagged if any of its lines is
            out.append((depth, ast.unparse(node), tagged(node.lineno, node.end_lineno)))
            continue
        header = copy.copy(node)
        for field, _ in blocks:
            setattr(header, field, [])
        is_tagged = tagged(node.lineno, node.body[0].lineno - 1)
        if is_tagged and not isinstance(node, (ast.With, ast.AsyncWith)):
            out.append((depth, ast.unparse(node), True))  # the whole block is the script's own
            continue
        inner = depth if is_tagged else depth + 1  # a tagged `with`: its statements compared at the wrapper's depth
        out.append((depth, ast.unparse(header).splitlines()[-1], is_tagged))
        for field, block in blocks:
            if field != "body":
                out.append((depth, f"{field}:", False))
            out += flatten(block, tagged, notes, inner)
    return out + [(depth, DROP, True) for n in notes if end is not None and previous < n <= end]


def steps(script, source=None):
    """{function name: its flattened statements, or None if its def line is tagged}, '__main__' for the main block."""
    source = source if source is not None else open(os.path.join(ROOT, script)).read()
    marks = comments(source)
    tag = TAGS.get(script)

    def tagged(first, last):
        return bool(tag) and any(tag in marks.get(n, "") for n in range(first, last + 1))
    lines = source.splitlines()
    notes = [n for n, text in marks.items() if tag and tag in text and lines[n - 1].lstrip().startswith("#")]
    found, body = {}, ast.parse(source).body
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.FunctionDef):
            name = node.name
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            name = "__main__"
        else:
            continue
        own = tagged(node.lineno, node.body[0].lineno - 1)
        # a function's last lines may be a tagged comment, indented as its body, saying why the reference's go
        end = max([n for n in notes if n < (after.lineno if after else len(lines) + 1)
                   and len(lines[n - 1]) - len(lines[n - 1].lstrip()) > node.col_offset], default=None)
        found[name] = None if own else flatten(node.body, tagged, notes, end=end)
    return found


def drift(script, source=None):
    """What differs from the reference without a tag, as readable lines (empty if nothing)."""
    ref, mine = steps(REFERENCE), steps(script, source)
    problems = []
    for name in ref:
        if name not in mine or mine[name] is None:
            continue
        a = [f"{'    ' * d}{code}" for d, code, _ in ref[name]]
        b = [f"{'    ' * d}{code}" for d, code, _ in mine[name]]
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
            if op == "equal":
                continue
            untagged = [b[j] for j in range(j1, j2) if not mine[name][j][2]]
            statements = [b[j] for j in range(j1, j2) if mine[name][j][1] != DROP]
            if untagged:
                problems += [f"{name}: not in {REFERENCE} and not tagged {TAGS[script]}: {line.strip()}"
                             for line in untagged]
                problems += [f"{name}: instead of: {line.strip()}" for line in a[i1:i2]]
            elif i2 - i1 > len(statements) == j2 - j1:  # more statements gone than tagged ones came, and no DROP
                problems += [f"{name}: dropped: {line.strip()}" for line in a[i1 + len(statements):i2]]
    return problems


@pytest.mark.floor
def test_every_script_names_the_same_steps():
    for script in [REFERENCE, *TAGS]:
        names = steps(script)
        missing = [s for s in STEPS if s not in names]
        assert not missing, f"{script} lacks {missing}"
        assert "setup_distributed" in names or script == "dp_train.py", script
    reference = open(os.path.join(ROOT, REFERENCE)).read()
    assert not any(tag in reference for tag in TAGS.values()), "the reference carries no tags"


@pytest.mark.floor
@pytest.mark.parametrize("script", TAGS)
def test_scripts_differ_only_in_tagged_lines(script):
    problems = drift(script)
    assert not problems, "\n".join(problems)


def own_steps_in_readme():
    """{script: the steps docs/core.md says are its own, not compared}, from its sentence on tests/test_drift.py."""
    import re
    text = " ".join(open(os.path.join(ROOT, "docs", "core.md")).read().split())
    sentence = text[text.index("for every step but a script's own"):].split(" A checkpoint")[0]
    found = {}
    for script, names in re.findall(r"`(\w+\.py)`'s (.*?)(?:;|\(|$)", sentence):
        found[script] = sorted(n for n in re.findall(r"`(\w+)`", names) if n in STEPS + ["setup_distributed"])
    return found


@pytest.mark.floor
def test_the_readme_names_exactly_the_steps_left_uncompared():
    """docs/core.md says which steps tests/test_drift.py does not compare (a script's own, its `def` tagged): that is
    exactly what steps() finds, so that the sentence cannot go stale."""
    ref, said = steps(REFERENCE), own_steps_in_readme()
    for script in TAGS:
        mine = steps(script)
        own = sorted(n for n in ref if n in STEPS + ["setup_distributed"] and mine.get(n, "absent") is None)
        assert own == said.get(script, []), (script, own, said)


BREAKAGES = {  # what a script must not lose: the start of the lines that go
    # the agreement of all ranks on a NaN/inf loss and on a stop signal (failsafe.Agreement.check)
    "agreement.check": ["        run.agreement.step_done(loss)"],
    "set_epoch": ["    run.sampler.set_epoch(epoch)"],
    "buffer broadcast": ["            for buffer in run.raw_model.buffers():",
                         "                dist.broadcast(buffer, src=0)"],
}


@pytest.mark.floor
@pytest.mark.parametrize("script", TAGS)
@pytest.mark.parametrize("what", BREAKAGES)
def test_drift_is_caught(script, what):
    """The test above fails when a script drops any of these (dp_train.py has no buffers to broadcast: one
    process)."""
    reference = open(os.path.join(ROOT, REFERENCE)).read().splitlines()
    assert [line for line in reference if line.startswith(tuple(BREAKAGES[what]))] == BREAKAGES[what], \
        f"{REFERENCE} no longer holds these lines as they are written here: {BREAKAGES[what]}"
    lines = open(os.path.join(ROOT, script)).read().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(tuple(BREAKAGES[what]))]
    if script == "dp_train.py" and what == "buffer broadcast":
        assert kept == lines
        return
    assert len(lines) - len(kept) == len(BREAKAGES[what]), f"{script}: not found, or found twice"
    dropped = [p for p in drift(script, "".join(kept)) if "dropped" in p]
    assert [p.split("dropped: ")[1] for p in dropped] == [line.strip() for line in BREAKAGES[what]], dropped


def launcher_scripts():
    """Every script that a launcher starts (torchrun, srun, the old torch.distributed.launch), present or future."""
    return sorted(f for f in os.listdir(ROOT)
                  if f.endswith("_train.py") and "common.launcher_env()" in open(os.path.join(ROOT, f)).read())


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
    import sys
    scripts = launcher_scripts()
    assert {"ddp_launch_train.py", "ddp_amp_train.py", "fsdp_train.py"} <= set(scripts)
    p = command([sys.executable, "-c", PARSE_ONLY, *scripts])
    assert p.returncode == 0, p.stderr[-3000:]
    parsed = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(parsed) == 2 * len(scripts)
    for argv, local_rank, usage in parsed:
        assert local_rank == 3 and "--epochs" in usage and "--local" not in usage, argv
