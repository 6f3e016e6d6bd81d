"""``scripts/wheelhouse.py``: the wheels a GPU node without internet needs. Offline: the closure
is computed from this venv's installed metadata, as the script computes it, and nothing is
downloaded."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import subprocess
import sys

import pytest
from packaging.utils import canonicalize_name

from helpers import REPO, parse_python

SCRIPT = os.path.join(REPO, "scripts", "wheelhouse.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import wheelhouse  # noqa: E402

# The installed package's source folders (setup.cfg's package_dir).
FOLDERS = ("vlmshard", "preprocess", "packing", "shards", "train")
# Accelerators probed for (importlib.util.find_spec) and used only when a node has them.
OPTIONAL = {"flash_attn", "fla", "causal_conv1d", "liger_kernel"}
# What our last GPU run lacked: the BENCHMARKS.md recipe had forgotten some of these.
MUST = {"deepspeed", "webdataset", "braceexpand", "datasets", "dill", "multiprocess", "av",
        "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson", "tenacity",
        "transformers"}
TARGET = wheelhouse.Target("3.12", "manylinux_2_28_x86_64")
PINS = wheelhouse.read_pins(wheelhouse.CONSTRAINTS)
REQUIREMENTS = wheelhouse.read_install_requires()


def _imported_modules() -> set[str]:
    """Top-level names of the third-party modules the package's source imports: every import
    statement (those inside functions too) and every literal ``import_module``/``find_spec``."""
    found = set()
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(REPO, folder)):
            for name in (n for n in files if n.endswith(".py")):
                tree = parse_python(os.path.join(dirpath, name))
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        found |= {alias.name for alias in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.level == 0:
                        found.add(node.module)
                    elif (isinstance(node, ast.Call) and node.args
                          and isinstance(node.args[0], ast.Constant)
                          and getattr(node.func, "attr", getattr(node.func, "id", None))
                          in ("import_module", "find_spec")):
                        found.add(node.args[0].value)
    tops = {module.split(".")[0] for module in found}
    return {t for t in tops if t not in sys.stdlib_module_names and t != "vlmshard"}


def _uncovered(needed) -> set[str]:
    """Distributions whose modules the package imports but that are not in ``needed``."""
    providers = importlib.metadata.packages_distributions()
    missing = set()
    for module in _imported_modules() - OPTIONAL:
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        assert dists, f"{module} is imported, but no installed distribution provides it"
        if not dists & set(needed):
            missing |= dists
    return missing


def test_closure_covers_every_import_of_the_package():
    imported = _imported_modules()
    assert {"deepspeed", "webdataset", "av", "torch", "yaml", "PIL"} <= imported  # the scan works
    assert _uncovered(wheelhouse.closure(REQUIREMENTS, TARGET)) == set()


def test_a_dropped_requirement_leaves_its_imports_uncovered():
    """The check above can fail: without setup.cfg's webdataset the closure misses it."""
    dropped = [r for r in REQUIREMENTS if not r.startswith("webdataset")]
    assert len(dropped) == len(REQUIREMENTS) - 1
    needed = wheelhouse.closure(dropped, TARGET)
    assert _uncovered(needed) == {"webdataset"} and "braceexpand" not in needed


def test_closure_holds_what_the_last_gpu_run_lacked():
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS, freeze={})
    assert MUST <= set(todo.download)
    assert todo.download["transformers"] == PINS["transformers"]
    assert "ray" in todo.download and "pandas" in todo.download  # ray[data]'s extra is followed


def test_torch_and_its_cuda_packages_are_left_to_the_node():
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS, freeze={})
    assert "torch" in todo.provided
    assert not [n for n in todo.download if n in ("torch", "triton") or n.startswith(("nvidia-",
                                                                                       "cuda-"))]
    assert not {"sympy", "mpmath"} & set(todo.download)  # torch's own requirements, not ours


def test_freeze_skips_what_the_node_has_at_a_version_we_accept():
    freeze = {"webdataset": PINS["webdataset"], "transformers": wheelhouse.Version("4.40.0")}
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS, freeze)
    assert "webdataset" in todo.on_node and "webdataset" not in todo.download
    # setup.cfg asks transformers>=5.19,<6: the node's 4.40 stays, ours is installed over it
    assert "transformers" not in todo.on_node and "transformers" in todo.download
    # an older release than the pin that our specifier accepts is kept, one below it is not
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS,
                           {"transformers": wheelhouse.Version("5.19.0")})
    assert todo.on_node == {"transformers": wheelhouse.Version("5.19.0")}
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS,
                           {"transformers": wheelhouse.Version("5.17.0")})
    assert todo.on_node == {} and "transformers" in todo.download


def test_what_the_node_has_brings_no_requirements_of_our_pin():
    """The node's numba runs with its own llvmlite: ours (pinned for numba's pin) would break
    it."""
    todo = wheelhouse.plan(REQUIREMENTS, TARGET, PINS, {"numba": wheelhouse.Version("0.62.1")})
    assert "numba" in todo.on_node and "llvmlite" not in todo.download


def test_markers_are_evaluated_for_the_target():
    requirement = ["webdataset>=1.0; python_version < '3.12'"]
    assert wheelhouse.closure(requirement, wheelhouse.Target("3.12")) == {}
    assert "braceexpand" in wheelhouse.closure(requirement, wheelhouse.Target("3.11"))
    arm = ["webdataset>=1.0; platform_machine == 'aarch64'"]
    assert wheelhouse.closure(arm, wheelhouse.Target("3.12", "manylinux_2_28_x86_64")) == {}
    assert wheelhouse.closure(arm, wheelhouse.Target("3.12", "manylinux_2_28_aarch64"))


def test_target_takes_older_manylinux_wheels_too():
    platforms = TARGET.platforms
    assert platforms[0] == "manylinux_2_28_x86_64" and TARGET.abi == "cp312"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(platforms)


def test_a_needed_package_without_a_pin_is_an_error():
    with pytest.raises(wheelhouse.WheelhouseError, match="pip is needed but constraints.txt"):
        wheelhouse.plan(["pip"], TARGET, PINS, freeze={})


def test_freeze_file_is_read_as_pip_freeze_writes_it(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.11.0+cu130\nPyYAML==6.0.3\ntyping_extensions==4.15.0\n"
                      "-e git+https://example.com/x.git#egg=x\nfoo @ file:///tmp/foo.whl\n")
    pins = wheelhouse.read_pins(str(freeze))
    assert pins == {"torch": wheelhouse.Version("2.11.0+cu130"),
                    "pyyaml": wheelhouse.Version("6.0.3"),
                    "typing-extensions": wheelhouse.Version("4.15.0")}


@pytest.mark.parametrize("args, message", [
    (["--freeze", "no-such-freeze.txt"], "--freeze no-such-freeze.txt: no such file"),
    (["--platform", "win_amd64"], "--platform win_amd64: expected manylinux_2_GLIBC_ARCH"),
])
def test_errors_are_one_line_before_anything_is_downloaded(args, message, tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(tmp_path / "w")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "w").exists()


def test_help_explains_the_script(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: wheelhouse.py")
    assert "--freeze" in proc.stdout and "pip install --no-deps --no-index" in proc.stdout
