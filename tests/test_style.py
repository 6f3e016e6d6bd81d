"""The house style, checked: ruff with ``pyproject.toml``'s settings (pyflakes' rules: unused
imports and names, undefined names; lines of at most 100 columns) over every tracked file it
reads."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", REPO],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
