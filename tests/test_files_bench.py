"""benchmarks/files.py, the file path end to end: a smoke run (a few images, one repeat) that checks it runs and
writes its rows; it times nothing worth reading."""
import json
import sys

import pytest

from processes import TIMEOUT, command


@pytest.mark.full
def test_files_benchmark_smoke_run(tmp_path):
    out = tmp_path / "files.json"
    p = command([sys.executable, "benchmarks/files.py", "--train", "8", "--val", "4", "--batch-size", "4",
                 "--repeats", "1", "--json", out], timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"plain", "script"}, rows
    assert rows["plain"]["ratio_to_plain"] == 1.0 and len(rows["plain"]["images_per_s_runs"]) == 2
    assert len(rows["script"]["ratio_runs"]) == 1 and rows["script"]["images_per_s"] > 0
    assert "plain" in p.stdout and "script" in p.stdout
