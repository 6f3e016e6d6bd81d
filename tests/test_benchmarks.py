"""Every benchmark script imports and answers ``--help`` (``make bench`` runs them; a script
broken by a moved module would otherwise be found only an hour into the benchmarks)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


def test_make_bench_runs_scripts_that_exist():
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        named = re.findall(r"benchmarks/(\w+\.py)", f.read())
    assert named and {os.path.join(REPO, "benchmarks", n) for n in named} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_benchmark_script_prints_its_usage(script, tmp_path):
    """Run from another folder, as ``python benchmarks/x.py`` would be from anywhere."""
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {os.path.basename(script)}"), proc.stdout
