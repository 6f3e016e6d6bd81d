"""Every command line in README.md and docs/*.md is one a user can type, and every relative link
between the documents leads somewhere.

Commands are read from fenced ``bash``/``sh``/``shell``/``console`` blocks (a usage synopsis is
a ``text`` block), one per line after joining ``\\`` continuations, ``#`` comments dropped as the
shell drops them. Leading ``NAME=value`` assignments are dropped, and a ``vlmshard`` command run
through a wrapper (``srun ... vlmshard train ...``) is checked from ``vlmshard`` on. Placeholders
are substituted: a ``...`` or ``<name>`` word becomes ``X``. Then, without running anything:

- ``vlmshard ...``: parsed by the real parser (``vlmshard.cli.parse``: no unrecognized argument,
  every value of its type and choices) and built into the command's config (every required
  option present, the config's own checks passed; a ``--config`` file is read);
- ``python SCRIPT ...`` and ``accelerate launch SCRIPT ...``: the script exists and declares
  every ``--flag`` used (``python -c`` and ``python -m`` lines are Python's or the module's own
  and are not checked);
- ``make TARGET ...``: the Makefile has the target.

Lines that start with any other program (``pip``, ``ray``) are not ours to check. The demo's
commands run end to end in ``tests/test_run.py``.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shlex

import pytest

from helpers import REPO, parse_python
from vlmshard.cli import parse
from vlmshard.config import load_config

DOCS = ["README.md", *sorted(os.path.relpath(p, REPO)
                             for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3"}


def _blocks(text: str):
    """(info string, lines) of each fenced code block."""
    info, lines = None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, lines = line[3:].strip(), []
            else:
                yield info, lines
                info = None
        elif info is not None:
            lines.append(line)


def _commands(doc: str) -> list[tuple[str, list[str]]]:
    """(the line as written, its words with placeholders substituted) of each command."""
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        text = f.read()
    found = []
    for info, lines in _blocks(text):
        if info not in SHELL:
            continue
        for line in "\n".join(lines).replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
                words.pop(0)
            if not words:
                continue
            if words[0] not in ("vlmshard", *PYTHONS) and "vlmshard" in words:
                words = words[words.index("vlmshard"):]
            words = ["X" if w == "..." or re.fullmatch(r"<[^<>]+>", w) else w for w in words]
            found.append((line.strip(), words))
    return found


COMMANDS = [(doc, line, words) for doc in DOCS for line, words in _commands(doc)]


def test_the_documents_hold_commands():
    """The extraction finds what the README shows (a broken reader would pass everything)."""
    readme = [words[0] for doc, _, words in COMMANDS if doc == "README.md"]
    assert readme.count("vlmshard") >= 5 and "make" in readme
    assert {"preprocess", "pack", "write", "verify", "train", "simulate", "report"} <= {
        words[1] for _, _, words in COMMANDS if words[0] == "vlmshard"}


def _vlmshard(words: list[str]) -> None:
    try:
        args = parse(words[1:])
    except SystemExit as e:
        pytest.fail(f"the parser refused it (exit {e.code}; its message is above)")
    if words[1] == "train":
        from vlmshard.train.cli import continue_in_resumed

        continue_in_resumed(args)
    load_config(args.config_cls, {k: v for k, v in vars(args).items()
                                  if k not in ("parser", "config_cls", "func")})


@functools.lru_cache(maxsize=None)
def _script_flags(script: str) -> frozenset[str]:
    """The flags ``script`` declares (``add_argument("--x", ...)``), its own and those of the
    modules beside it that it imports (the examples' shared ``common.parser``): read from the
    source, since running ``--help`` would import torch and transformers for each."""
    path = os.path.join(REPO, script)
    paths, flags = [path], set()
    while paths:
        tree = parse_python(paths.pop())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                          and str(a.value).startswith("--")}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                beside = os.path.join(os.path.dirname(path), node.module + ".py")
                paths += [beside] if os.path.isfile(beside) else []
    return frozenset(flags)


def _script(words: list[str]) -> None:
    script = next(w for w in words[1:] if not w.startswith("-"))
    assert os.path.isfile(os.path.join(REPO, script)), f"{script} does not exist"
    used = {w.split("=")[0] for w in words[words.index(script) + 1:] if w.startswith("--")}
    unknown = sorted(used - _script_flags(script) - {"--help"})
    assert not unknown, f"{script} takes no {', '.join(unknown)}"


def _make(words: list[str]) -> None:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:
        targets = set(re.findall(r"^([\w.-]+):", f.read(), re.M))
    for target in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
        assert target in targets, f"the Makefile has no target {target}"


@pytest.mark.parametrize("doc,line,words", COMMANDS,
                         ids=[f"{doc}:{line[:60]}" for doc, line, _ in COMMANDS])
def test_a_documented_command_is_one_the_tools_take(doc, line, words, monkeypatch):
    monkeypatch.chdir(REPO)  # a --config path is the repository's
    if words[0] == "vlmshard":
        _vlmshard(words)
    elif words[0] in PYTHONS and words[1] not in ("-c", "-m"):
        _script(words)
    elif words[:2] == ["accelerate", "launch"]:
        _script(words[1:])
    elif words[0] == "make":
        _make(words)


# --- links -------------------------------------------------------------------------------------

LINKED = [*DOCS, "BENCHMARKS.md"]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    outside = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # a code block's # is a comment
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", outside, re.M)}


@pytest.mark.parametrize("doc", LINKED)
def test_relative_links_resolve(doc):
    path = os.path.join(REPO, doc)
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(where):
            broken.append(f"{target}: no such file")
        elif anchor and where.endswith(".md") and anchor not in _anchors(where):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{doc}: " + "; ".join(broken)
