"""Every script under benchmarks/ answers ``--help`` with its usage, on a machine without a GPU, and writes nothing: a
script that takes its arguments from ``sys.argv`` itself reads ``--help`` as its output folder and starts the run."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))  # globbed: a new script is held to it too


def run_help(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    """``script --help`` in the folder ``cwd`` (made here), as the shell scripts run it, with no GPU."""
    # the scripts import tokenselect and their neighbours in benchmarks/
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    cwd.mkdir()
    return subprocess.run([sys.executable, str(script), "--help"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def helped(request, tmp_path_factory) -> dict[Path, tuple[subprocess.CompletedProcess, Path]]:
    """The ``--help`` of every script this session's tests ask for, run a few at a time (each mostly waits on
    importing torch), and the folder it ran in: where a script that ran instead would write its relative OUT (e.g.
    ./--help)."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if getattr(item, "originalname", None) == "test_help_prints_the_usage_and_writes_nothing"]
    root = tmp_path_factory.mktemp("help")
    folders = [root / script.stem for script in scripts]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        results = list(pool.map(run_help, scripts, folders))
    return {script: (res, cwd) for script, res, cwd in zip(scripts, results, folders)}


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_help_prints_the_usage_and_writes_nothing(script, helped):
    res, cwd = helped[script]
    assert res.returncode == 0, res.stderr[-3000:]
    assert any(line.startswith("usage:") for line in res.stdout.splitlines()), res.stdout[-3000:]
    assert not any(cwd.iterdir()), sorted(p.name for p in cwd.iterdir())
    assert not (ROOT / "--help").exists() and not (ROOT / "benchmarks" / "--help").exists()
