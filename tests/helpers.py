"""Helpers for tests: run the console command, compare output trees byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vlmshard(*args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Run the real console command in a subprocess, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "vlmshard.cli", *args], capture_output=True,
                          text=True, cwd=kwargs.pop("cwd", REPO), **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmshard {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every output file's bytes except preprocess.json (which holds timings)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel != "preprocess.json":
                with open(path, "rb") as f:
                    out[rel] = f.read()
    return out
