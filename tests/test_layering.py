"""The package's shape: one top-level name, imports that flow one way, a CLI that starts light.

Imports are read from the source (every ``import`` statement, also those inside functions), so
a lazy upward import is caught as surely as a module-level one."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO, parse_python

# Lower layers never import higher ones, nor a sibling of their own layer: the shared helpers
# (layer 0, the torch-free cost code and the train-log reader among them) are below every stage;
# the model families (torch-free) sit below the stages that ask them, and the demo's data and
# model builders beside preprocess, which never needs them; shards and simulate both
# read plans; train reads shards, and report sets a training run against the simulator's replay
# of it (reading the run's log, not the trainer); the command line (cli, run) sits on top of
# everything.
TOP = 6
LAYERS = {
    "vlmshard.io": 0, "vlmshard.jobs": 0, "vlmshard.fleet": 0, "vlmshard.progress": 0,
    "vlmshard.config": 0, "vlmshard.model_sizes": 0, "vlmshard.errors": 0, "vlmshard.rejects": 0,
    "vlmshard.partition": 0, "vlmshard.run_log": 0, "vlmshard.stage": 0, "vlmshard.compat": 0,
    "vlmshard.plugins": 0, "vlmshard.process": 0,
    "vlmshard.hardware": 0, "vlmshard.recipe": 0,
    "vlmshard.families": 1, "vlmshard.demo": 2,
    "vlmshard.preprocess": 2, "vlmshard.packing": 3,
    "vlmshard.shards": 4, "vlmshard.simulate": 4,
    "vlmshard.train": 5, "vlmshard.report": 5,
    "vlmshard.run": TOP, "vlmshard.cli": TOP,
}
FOLDERS = {"preprocess": "vlmshard.preprocess", "packing": "vlmshard.packing",
           "shards": "vlmshard.shards", "train": "vlmshard.train", "report": "vlmshard.report",
           "simulate": "vlmshard.simulate", "demo": "vlmshard.demo", "vlmshard": "vlmshard"}


def _unit(module: str) -> str | None:
    """The layered unit a dotted module name belongs to (its longest prefix in LAYERS)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def _modules():
    """(module name, source path) of every module the distribution installs."""
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            rel = os.path.relpath(dirpath, os.path.join(REPO, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in files:
                if name.endswith(".py"):
                    stem = name[:-3]
                    yield (prefix if stem == "__init__" else f"{prefix}.{stem}",
                           os.path.join(dirpath, name))


def _imports(module: str, path: str, is_package: bool):
    """Absolute names of everything ``path`` imports."""
    tree = parse_python(path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target
            for alias in node.names:  # `from vlmshard import report` imports a unit too
                yield f"{target}.{alias.name}"


def test_imports_flow_one_way():
    problems = []
    for module, path in _modules():
        mine = _unit(module)
        if mine is None:
            if module != "vlmshard":  # vlmshard/__init__.py holds only the version
                problems.append(f"{module} has no layer in LAYERS")
            continue
        for target in _imports(module, path, path.endswith("__init__.py")):
            top = target.split(".")[0]
            if top in ("preprocess", "packing", "shards", "train", "report", "simulate", "demo"):
                problems.append(f"{module} imports the bare top-level {target}")
                continue
            theirs = _unit(target)
            if theirs is None or theirs == mine:
                continue
            if LAYERS[theirs] > LAYERS[mine] or (LAYERS[theirs] == LAYERS[mine] not in (0, TOP)):
                problems.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not problems, "\n".join(sorted(set(problems)))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next((e for e in edges if e not in index or e in stack), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif nxt in index:
                low[node] = min(low[node], index[nxt])
            else:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
    return found


def test_no_import_circles():
    """No module imports, through others, a module that imports it (lazy imports count: a
    circle hidden in a function still ties the modules together)."""
    modules = dict(_modules())
    graph = {m: {t for t in _imports(m, p, p.endswith("__init__.py")) if t in modules and t != m}
             for m, p in modules.items()}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _circles(graph), _circles(graph)


@pytest.mark.parametrize("unit", ["vlmshard.simulate", "vlmshard.report"])
def test_simulate_and_report_need_no_trainer(unit):
    """They read a run through vlmshard.run_log and cost it with vlmshard.partition, never
    through the trainer's modules, which import torch."""
    found = [f"{module} imports {target}" for module, path in _modules()
             if _unit(module) == unit
             for target in _imports(module, path, path.endswith("__init__.py"))
             if target == "vlmshard.train" or target.startswith("vlmshard.train.")]
    assert not found, "\n".join(sorted(set(found)))


# What makes or holds a process group: torch's group makers, and the types that hold groups
GROUP_MAKERS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
                "init_device_mesh", "DeviceMesh"}
GROUP_TYPES = re.compile(r"\b(ProcessGroup|DeviceMesh|Topology)\b")
GROUP_NAME = re.compile(r"group|mesh|topolog", re.IGNORECASE)
TOPOLOGY = "vlmshard.train.topology"


def _process_group_state(module: str, tree: ast.Module) -> list[str]:
    """Where ``tree`` makes a process group outside ``TOPOLOGY`` or keeps one at module level
    (``test_process_groups_come_from_the_topology`` says why)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and module != TOPOLOGY:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in GROUP_MAKERS:
                found.append(f"{module}:{node.lineno} calls {name} outside {TOPOLOGY}")
        if isinstance(node, ast.Global) and module.startswith("vlmshard.train."):
            found += [f"{module}:{node.lineno} rebinds the global {name}"
                      for name in node.names if GROUP_NAME.search(name)]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        annotation = getattr(node, "annotation", None)
        if annotation is not None and GROUP_TYPES.search(ast.unparse(annotation)):
            found.append(f"{module}:{node.lineno} holds a {ast.unparse(annotation)}")
        empty = node.value is None or isinstance(node.value, (ast.Dict, ast.List, ast.Set)) or (
            isinstance(node.value, ast.Constant) and node.value.value is None) or (
            isinstance(node.value, ast.Call) and ast.unparse(node.value.func) in (
                "dict", "list", "set", "defaultdict", "collections.defaultdict"))
        if module.startswith("vlmshard.train.") and empty:
            found += [f"{module}:{node.lineno} keeps {name} for groups at module level"
                      for name in names if GROUP_NAME.search(name)]
    return found


def test_process_groups_come_from_the_topology():
    """Every rank must make every process group, in the same order, from one layout; a group
    made elsewhere, or kept in a module's global state, is a second layout that can disagree
    with it (and outlives the run that made it). So, read from the source: only
    ``vlmshard.train.topology`` calls torch's group makers (``GROUP_MAKERS``); no module-level
    name anywhere is annotated as a ``ProcessGroup``, ``DeviceMesh`` or ``Topology``; and in
    the trainer no module-level name saying group, mesh or topology is bound to None or an
    empty container to fill later, nor rebound by ``global``. The groups live in the
    ``Topology`` the trainer builds and passes to whoever needs one."""
    held = ast.parse("_GROUPS: dict[int, ProcessGroup] = {}\n"
                     "def make():\n    global _MESH\n    _MESH = dist.new_group([0])\n")
    assert len(_process_group_state("vlmshard.train.x", held)) == 4
    found = [problem for module, path in _modules()
             for problem in _process_group_state(module, parse_python(path))]
    assert not found, "\n".join(found)


def test_modules_cite_only_documents_a_clone_has():
    """The design is ``docs/design.md`` in the repository, not a file beside the clone."""
    found = []
    for module, path in _modules():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found += [f"{module} cites {name}" for name in ("../shared", "DESIGN.md") if name in text]
    assert not found, "\n".join(found)
    assert os.path.isfile(os.path.join(REPO, "docs", "design.md"))


def test_only_a_familys_own_modules_name_it():
    """Everything about a family lives in its modules (``vlmshard/families/``, the trainer's
    ``train/models/``): a family's name or a model_type it serves written anywhere else is a
    fact the next family would have to be added to. Lists of families come from the registry.
    (A preset's name, ``internvl-chat-1.5``, is no family name.)"""
    from vlmshard.families import families

    names = {n for f in families().values() for n in (f.name, *f.model_types)}
    word = re.compile(r"(?<![\w-])(" + "|".join(sorted(names, key=len, reverse=True))
                      + r")(?![\w-])")
    found = []
    for module, path in _modules():
        if any(module == home or module.startswith(home + ".")
               for home in ("vlmshard.families", "vlmshard.train.models")):
            continue
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                found += [f"{os.path.relpath(path, REPO)}:{number}: {m.group(1)}"
                          for m in word.finditer(line)]
    assert not found, "\n".join(found)


def test_the_distribution_owns_only_the_vlmshard_name():
    dist = importlib.metadata.distribution("vlmshard")
    top = (dist.read_text("top_level.txt") or "").split()
    if not top:  # editable installs may not write top_level.txt: read the file list
        top = sorted({f.parts[0] for f in dist.files or [] if f.suffix == ".py"})
    assert top == ["vlmshard"]


@pytest.mark.parametrize("argv", [["--help"], ["pack", "--help"], ["preprocess", "--help"],
                                  ["write", "--help"], ["train", "--help"], ["report", "--help"],
                                  ["simulate", "--help"], ["run", "--help"]])
def test_help_imports_no_heavy_framework_and_fits_a_terminal(argv):
    code = ("import sys\nfrom vlmshard.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'deepspeed', 'ray', 'numba', 'webdataset', "
            "'transformers', 'matplotlib') if m in sys.modules)\n"
            "print('HEAVY', ','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True, env={**os.environ, "COLUMNS": "100"}).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("HEAVY")][-1]
    assert line == "HEAVY ", f"vlmshard {' '.join(argv)} imported {line[6:]}"
    # argparse wraps to COLUMNS what it formats; descriptions and long usage items it does not
    wide = [ln for ln in out.splitlines() if len(ln) > 100]
    assert not wide, f"vlmshard {' '.join(argv)}: lines over 100 columns:\n" + "\n".join(wide)
