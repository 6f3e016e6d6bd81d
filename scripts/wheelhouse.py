#!/usr/bin/env python3
"""Every wheel a GPU node without internet needs to run vlmshard, in one folder.

A GPU node brings its own Python, torch (a CUDA build) and often more (transformers, numpy, ...).
This takes the dependency closure of vlmshard's install_requires (setup.cfg) on the node's Python
and platform, leaves out torch and its CUDA dependencies (torch, triton, nvidia-*, cuda-*), which
the node provides, and every package the node's `pip freeze` (--freeze) lists at a version our
requirements accept, and downloads the rest at constraints.txt's pins (a package PyPI has only as
an sdist, such as DeepSpeed, is built here: it must be pure Python), with the vlmshard wheel:

    python -m pip freeze > node-freeze.txt                      # on the node
    make wheelhouse FREEZE=node-freeze.txt                      # here, PyPI reachable
    python -m pip install --no-deps --no-index .wheelhouse/*.whl  # on the node, offline

The closure is read from the requirements of the distributions installed in this interpreter
(`make` installs them at constraints.txt's pins), markers evaluated for the node, so it needs no
network; only the downloads do. `python -m pip check` on the node afterwards names any package
the node had whose requirements a wheel from here no longer meets.
"""

from __future__ import annotations

import argparse
import configparser
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_CFG = os.path.join(REPO, "setup.cfg")
CONSTRAINTS = os.path.join(REPO, "constraints.txt")
# The node's torch brings these; their own requirements are not followed either.
PROVIDED_BY_NODE = re.compile(r"^(torch|triton|nvidia-.+|cuda-.+)$")
MANYLINUX = re.compile(r"^manylinux_2_(\d+)_(\w+)$")
OLD_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}  # glibc 2.x aliases


class WheelhouseError(Exception):
    """A problem the user fixes (a missing file, a package with no pin): printed without a
    traceback."""


@dataclass(frozen=True)
class Target:
    """The node's interpreter and platform, as pip's download options and PEP 508 markers see
    them."""

    python_version: str = "3.12"
    platform: str = "manylinux_2_28_x86_64"

    def __post_init__(self):
        if not re.fullmatch(r"3\.\d+", self.python_version):
            raise WheelhouseError(f"--python-version {self.python_version}: expected e.g. 3.12")
        if not MANYLINUX.match(self.platform):
            raise WheelhouseError(f"--platform {self.platform}: expected manylinux_2_GLIBC_ARCH, "
                                  "e.g. manylinux_2_28_x86_64")

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    @property
    def platforms(self) -> list[str]:
        """The platform and every older manylinux one: pip takes only the tags it is given."""
        glibc, arch = MANYLINUX.match(self.platform).groups()
        return ([f"manylinux_2_{minor}_{arch}" for minor in range(int(glibc), 4, -1)]
                + [f"{old}_{arch}" for minor, old in OLD_MANYLINUX.items() if minor <= int(glibc)])

    def environment(self, extra: str = "") -> dict[str, str]:
        """PEP 508 marker variables on the node, evaluating the extra ``extra``."""
        full = f"{self.python_version}.0"
        return {"python_version": self.python_version, "python_full_version": full,
                "implementation_name": "cpython", "implementation_version": full,
                "platform_python_implementation": "CPython", "os_name": "posix",
                "sys_platform": "linux", "platform_system": "Linux",
                "platform_machine": MANYLINUX.match(self.platform).group(2), "extra": extra}


@dataclass
class Plan:
    """What becomes of each distribution of the closure."""

    download: dict[str, Version] = field(default_factory=dict)   # name -> constraints.txt's pin
    on_node: dict[str, Version] = field(default_factory=dict)    # name -> the node's version
    provided: dict[str, SpecifierSet] = field(default_factory=dict)  # torch & co. -> our spec


def read_install_requires(setup_cfg: str = SETUP_CFG) -> list[str]:
    """setup.cfg's ``[options] install_requires``, one requirement string each."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg, encoding="utf-8")
    return [line.strip() for line in parser["options"]["install_requires"].splitlines()
            if line.strip()]


def read_pins(path: str) -> dict[str, Version]:
    """``name==version`` lines of a constraints or `pip freeze` file, by canonical name (comments,
    options such as ``-e`` and ``name @ url`` lines are skipped)."""
    pins = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line or line.startswith("-"):
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement:
                raise WheelhouseError(f"{path}: not a requirement: {line}") from None
            exact = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if exact:
                pins[canonicalize_name(req.name)] = Version(exact[0])
    return pins


def closure(requirements: list[str], target: Target,
            leaves: frozenset[str] = frozenset()) -> dict[str, SpecifierSet]:
    """Every distribution ``requirements`` need on ``target``, transitively, each with the
    specifiers of all its requirers together. Torch and its CUDA packages are in it, and the
    ``leaves`` (what the node has), but what they require is not followed: the node has that.
    Requirements are read from the distributions installed here."""
    specs: dict[str, SpecifierSet] = {}
    walked: dict[str, set[str]] = {}  # name -> the extras whose requirements were followed
    todo = [(Requirement(r), {""}) for r in requirements]  # (requirement, its requirer's extras)
    while todo:
        req, requirer_extras = todo.pop()
        if req.marker and not any(req.marker.evaluate(target.environment(e))
                                  for e in requirer_extras):
            continue
        name = canonicalize_name(req.name)
        specs[name] = specs.get(name, SpecifierSet()) & req.specifier
        new = ({""} | {canonicalize_name(e) for e in req.extras}) - walked.setdefault(name, set())
        if not new or name in leaves or PROVIDED_BY_NODE.match(name):
            continue
        walked[name] |= new
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            raise WheelhouseError(f"{name} is needed on the node but not installed here, so its "
                                  "requirements cannot be read: run `make .venv/.installed`"
                                  ) from None
        todo += [(Requirement(line), new) for line in declared]
    return specs


def plan(requirements: list[str], target: Target, pins: dict[str, Version],
         freeze: dict[str, Version]) -> Plan:
    """Which packages of the closure to download (at their pins), which the node already has at
    a version our requirements accept, and which its torch provides. What the node has is a leaf
    (its requirements are met there, and the ones of our pin, e.g. numba's llvmlite, may not fit
    the node's version); with fewer requirers, more of the node's versions may then fit."""
    on_node: dict[str, Version] = {}
    while True:
        needed = closure(requirements, target, frozenset(on_node))
        fits = {name: freeze[name] for name, spec in needed.items()
                if name in freeze and not PROVIDED_BY_NODE.match(name)
                and spec.contains(freeze[name], prereleases=True)}
        if fits == on_node:
            break
        on_node = fits
    result = Plan(on_node=dict(sorted(on_node.items())))
    for name, spec in sorted(needed.items()):
        if PROVIDED_BY_NODE.match(name):
            result.provided[name] = spec
        elif name in on_node:
            continue
        elif name not in pins:
            raise WheelhouseError(f"{name} is needed but constraints.txt pins no version of it: "
                                  "run `make constraints`")
        else:
            result.download[name] = pins[name]
    return result


def wheels_in(folder: str) -> dict[tuple[str, Version], str]:
    """(canonical name, version) -> path of each wheel in ``folder``."""
    wheels = {}
    for path in glob.glob(os.path.join(folder, "*.whl")):
        name, version, _, _ = parse_wheel_filename(os.path.basename(path))
        wheels[(name, version)] = path
    return wheels


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--quiet",
                           "--disable-pip-version-check"], capture_output=True, text=True)


def fetch(name: str, version: Version, target: Target, out: str) -> str:
    """Put ``name==version``'s wheel for ``target`` into ``out``; says how it came."""
    spec = f"{name}=={version}"
    platforms = [arg for platform in target.platforms for arg in ("--platform", platform)]
    download = pip("download", "--no-deps", "--only-binary=:all:", *platforms,
                   "--python-version", target.python_version, "--implementation", "cp",
                   "--abi", target.abi, "-c", CONSTRAINTS, "-d", out, spec)
    if download.returncode == 0:
        return "downloaded"
    build = pip("wheel", "--no-deps", "-c", CONSTRAINTS, "-w", out, spec)
    if build.returncode != 0:
        raise WheelhouseError(f"{spec}: no wheel for {target.abi} {target.platform}, and "
                              f"building one failed.\npip download: {download.stderr.strip()}\n"
                              f"pip wheel: {build.stderr.strip()[-3000:]}")
    path = wheels_in(out)[(name, version)]
    if any(tag.platform != "any" for tag in parse_wheel_filename(os.path.basename(path))[3]):
        os.remove(path)
        raise WheelhouseError(f"{spec}: PyPI has no wheel for {target.platform}, and the one it "
                              "builds here is not pure Python")
    return "built here (PyPI has only its sdist)"


def build_vlmshard(out: str) -> str:
    """The vlmshard wheel, built from a copy of the source without build outputs (setuptools
    would reuse ``build/lib``, stale modules included) or the output folder."""
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__")

    def ignore(folder, names):
        inside = {n for n in names
                  if os.path.realpath(os.path.join(folder, n)) == os.path.realpath(out)}
        return set(skip(folder, names)) | inside

    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "source")
        shutil.copytree(REPO, source, ignore=ignore)
        built = pip("wheel", "--no-deps", "--no-build-isolation", "-w", tmp, source)
        if built.returncode != 0:
            raise WheelhouseError(f"building the vlmshard wheel failed:\n{built.stderr.strip()}")
        [wheel] = glob.glob(os.path.join(tmp, "vlmshard-*.whl"))
        return shutil.move(wheel, os.path.join(out, os.path.basename(wheel)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="wheelhouse.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    defaults = Target()
    parser.add_argument("--python-version", default=defaults.python_version,
                        help="the node's Python, MAJOR.MINOR (default: %(default)s)")
    parser.add_argument("--platform", default=defaults.platform,
                        help="the node's wheel platform, manylinux_2_GLIBC_ARCH; wheels for older "
                             "glibc are taken too (default: %(default)s)")
    parser.add_argument("--freeze", metavar="FILE",
                        help="`pip freeze` of the node: a package listed at a version that our "
                             "requirements accept is not downloaded")
    parser.add_argument("--out", default=".wheelhouse", metavar="DIR",
                        help="where the wheels and requirements.txt go; wheels already there at "
                             "the wanted versions are kept, any others removed (default: "
                             "%(default)s)")
    return parser.parse_args(argv)


def build(todo: Plan, target: Target, freeze: dict[str, Version], out: str) -> None:
    """Fill ``out`` with the plan's wheels and vlmshard's, and list them in requirements.txt."""
    print(f"{len(todo.download)} packages for {target.abi} {target.platform} -> {out}; "
          f"the node has {len(todo.on_node)}: "
          + (", ".join(f"{n} {v}" for n, v in todo.on_node.items()) or "-"))
    for name, spec in todo.provided.items():
        if freeze and name not in freeze:
            print(f"warning: the node has no {name} (its freeze lists none)", file=sys.stderr)
        elif name in freeze and not spec.contains(freeze[name], prereleases=True):
            print(f"warning: the node's {name} {freeze[name]} does not meet our requirement "
                  f"{name}{spec}", file=sys.stderr)
    stale = [f"{name} {importlib.metadata.version(name)} (pinned {version})"
             for name, version in todo.download.items()
             if Version(importlib.metadata.version(name)) != version]
    if stale:
        print("warning: the closure was read from versions other than the pins (`make "
              f".venv/.installed` installs the pins): {', '.join(stale)}", file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    here = wheels_in(out)
    for (name, version), path in here.items():
        if todo.download.get(name) != version:
            os.remove(path)
    for i, (name, version) in enumerate(todo.download.items(), 1):
        how = "already here" if (name, version) in here else fetch(name, version, target, out)
        print(f"[{i}/{len(todo.download)}] {name}=={version}: {how}", flush=True)
    print(f"vlmshard: {os.path.basename(build_vlmshard(out))}")

    wheels = wheels_in(out)
    with open(os.path.join(out, "requirements.txt"), "w", encoding="utf-8") as f:
        f.write("# The wheels in this folder (scripts/wheelhouse.py); on the node:\n"
                "#   python -m pip install --no-deps --no-index DIR/*.whl\n")
        f.writelines(f"{name}=={version}\n" for name, version in sorted(wheels))
    total = sum(os.path.getsize(path) for path in wheels.values())
    print(f"{len(wheels)} wheels, {total / 1e6:.1f} MB in {out} (requirements.txt lists them); "
          f"left to the node: {', '.join(todo.provided) or '-'} (and what it requires)")
    print("install on the node (no index needed):")
    print(f"  python -m pip install --no-deps --no-index {out.rstrip('/')}/*.whl")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target = Target(args.python_version, args.platform)
        if args.freeze and not os.path.isfile(args.freeze):
            raise WheelhouseError(f"--freeze {args.freeze}: no such file (write it on the node: "
                                  "python -m pip freeze > FILE)")
        freeze = read_pins(args.freeze) if args.freeze else {}
        todo = plan(read_install_requires(), target, read_pins(CONSTRAINTS), freeze)
        build(todo, target, freeze, args.out)
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
