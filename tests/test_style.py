"""The house style, checked: ruff with ``pyproject.toml``'s settings (pyflakes' rules: unused
imports and names, undefined names; lines of at most 100 columns) over every tracked file it
reads; and in the product packages, no module docstring over 25 lines (the longer explanation
lives in docs/) and no function over 80 lines."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRODUCT = ("preprocess", "packing", "shards", "train", "report", "simulate", "demo", "vlmshard")
MAX_DOCSTRING_LINES = 25
MAX_FUNCTION_LINES = 80


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", REPO],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _product_modules():
    """(path relative to the repository, parsed module) of every product module."""
    for folder in PRODUCT:
        for path in sorted(pathlib.Path(REPO, folder).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_module_docstring_is_over_25_lines():
    """A module's docstring says what the module is for and points to where its design is
    explained."""
    long = [f"{path}: {_lines(tree.body[0])} lines" for path, tree in _product_modules()
            if ast.get_docstring(tree, clean=False) is not None
            and _lines(tree.body[0]) > MAX_DOCSTRING_LINES]
    assert not long, "module docstrings over 25 lines (move the detail to docs/):\n" + \
        "\n".join(long)


def test_no_function_is_over_80_lines():
    long = [f"{path}:{node.name} (line {node.lineno}): {_lines(node)} lines"
            for path, tree in _product_modules() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _lines(node) > MAX_FUNCTION_LINES]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
