"""Every script under benchmarks/ answers ``--help`` with its usage, on a machine without a GPU, and writes nothing: a
script that takes its arguments from ``sys.argv`` itself reads ``--help`` as its output folder and starts the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))  # globbed: a new script is held to it too


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_help_prints_the_usage_and_writes_nothing(script, tmp_path):
    # the scripts import tokenselect and their neighbours in benchmarks/, as the shell scripts run them
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    cwd = tmp_path / "cwd"  # where a script that ran instead would write its relative OUT (e.g. ./--help)
    cwd.mkdir()
    res = subprocess.run([sys.executable, str(script), "--help"], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(line.startswith("usage:") for line in res.stdout.splitlines()), res.stdout[-3000:]
    assert not any(cwd.iterdir()), sorted(p.name for p in cwd.iterdir())
    assert not (ROOT / "--help").exists() and not (ROOT / "benchmarks" / "--help").exists()
