"""The built wheel is the product: it installs the one top-level name ``vlmshard`` and runs the
pipeline from any folder, with no source tree in sight."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from helpers import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """Built from a copy of the source without build outputs: setuptools reuses ``build/lib``,
    whose stale modules would hide a package missing from setup.cfg."""
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", ".wheelhouse", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)], check=True,
                   capture_output=True)
    return glob.glob(str(out / "vlmshard-*.whl"))[0]


def test_wheel_holds_only_the_vlmshard_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"vlmshard"}
    for stage in ("preprocess", "packing", "shards", "train", "report", "simulate"):
        assert f"vlmshard/{stage}/__init__.py" in names
    # every module of the source tree is in it (a subpackage missing from setup.cfg is not)
    roots = {"vlmshard": "vlmshard", "preprocess": "vlmshard/preprocess",
             "packing": "vlmshard/packing", "shards": "vlmshard/shards", "train": "vlmshard/train"}
    sources = {os.path.join(roots[root], os.path.relpath(path, os.path.join(REPO, root)))
               for root in roots
               for path in glob.glob(os.path.join(REPO, root, "**", "*.py"), recursive=True)}
    assert sorted(sources - set(names)) == []
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["vlmshard"]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs(wheel, tmp_path, demo):
    """A fresh venv sees this venv's dependencies (a plain path entry: their own .pth hooks,
    the editable install's among them, are not run) and the wheel's vlmshard alone, installed
    by the test's pip (``--python``: the venv has none). Its shards are verified quickly: the
    installed code runs each stage, and the full check is the source tree's tests'."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                    "--no-deps", wheel], check=True, capture_output=True)
    where = subprocess.run(
        [python, "-c", "import importlib.metadata as m, vlmshard.packing.plan as p; "
                       "print(p.__file__); print(m.distribution('vlmshard').read_text("
                       "'top_level.txt').split())"],
        capture_output=True, text=True, check=True, cwd=tmp_path).stdout.splitlines()
    assert where[0].startswith(site) and where[1] == "['vlmshard']"
    config = tmp_path / "run.yaml"
    config.write_text(f"out: {tmp_path / 'out'}\n"
                      f"preprocess: {{inputs: [{demo.meta}], keep_tokens: true, part_size: 64,"
                      " max_seq_len: 8192}\n"
                      "pack: {dp: 2}\nwrite: {shard_bytes: 64MB}\nverify: {quick: true}\n")
    proc = subprocess.run([str(venv / "bin" / "vlmshard"), "run", "--config", str(config)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[5/5] report" in proc.stdout and (tmp_path / "out" / "report.html").exists()


def test_constraints_pin_every_requirement_within_its_range():
    """``make`` installs with ``-c constraints.txt``: every requirement of setup.cfg (and the dev
    extra) is pinned there to one version its own range admits, and the pins are the
    installed versions this suite runs on."""
    import configparser
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    lines = (setup["options"]["install_requires"] + setup["options.extras_require"]["dev"])
    requirements = [Requirement(line) for line in lines.splitlines()
                    if line.strip() and not line.strip().startswith("#")]
    pins = {}
    with open(os.path.join(REPO, "constraints.txt")) as f:
        for line in f:
            if "==" in line and not line.startswith("#"):
                name, pinned = line.split(";")[0].strip().split("==")
                pins[canonicalize_name(name)] = pinned
    assert pins["torch"] == "2.13.0"
    for req in requirements:
        pinned = pins[canonicalize_name(req.name)]
        assert req.specifier.contains(pinned, prereleases=True), (req, pinned)
        assert version(req.name).split("+")[0] == pinned, req.name
