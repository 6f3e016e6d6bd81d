"""The packer's hot loops (``loops.py``), compiled by Numba ahead of time.

``vlmshard pack`` is a short command: importing Numba and setting up its JIT target costs about
a second each run, more than packing 18k samples takes, even with the JIT's on-disk cache. So
the loops are compiled once by Numba's ahead-of-time compiler (``numba.pycc``) into an extension
module cached per loop source, Numba version and Python, and later runs load that module with
NumPy alone. Where no C compiler is at hand, or once a Numba release drops ``pycc`` (pending
deprecation since 0.57, its replacement not yet released), the same loops run under
``numba.njit(cache=True)``.

The wrappers below give each loop the exact types its signature names (``loops.SIGNATURES``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import tempfile
import warnings
from types import SimpleNamespace

import numpy as np

from . import loops

log = logging.getLogger(__name__)


def greedy_groups(tiles, tokens, order, qv, qt) -> np.ndarray:
    """``loops.greedy_groups``: OmniBal's ISF grouping, the group number of each position."""
    return _compiled().greedy_groups(_i8(tiles), _i8(tokens), _i8(order), int(qv), int(qt))


def fill_bins(tiles, tokens, squares, qv, qt, mean_attn, n_bins) -> np.ndarray:
    """``loops.fill_bins``: worst-fit placement into ``n_bins`` micro-batches (-1: nowhere)."""
    return _compiled().fill_bins(_i8(tiles), _i8(tokens), np.asarray(squares, np.float64),
                                 int(qv), int(qt), float(mean_attn), int(n_bins))


def polish_steps(items, offsets, tiles, tokens, squares, ranks, micro_batches, qt,
                 rounds) -> int:
    """``loops.polish_steps``: swaps that even out each step's ranks, in place on ``items``."""
    if items.dtype != np.int64:  # a converted copy would be polished, not the caller's array
        raise TypeError(f"polish_steps works in place on int64 items, not {items.dtype}")
    return _compiled().polish_steps(items, _i8(offsets), _i8(tiles), _i8(tokens),
                                    np.asarray(squares, np.float64), int(ranks),
                                    int(micro_batches), int(qt), int(rounds))


def _i8(a) -> np.ndarray:
    return np.asarray(a, np.int64)


def cache_dir() -> str:
    """Where compiled kernels are kept: ``$VLMSHARD_KERNEL_CACHE``, else the user's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("VLMSHARD_KERNEL_CACHE") or os.path.join(base, "vlmshard", "kernels")


def module_name() -> str:
    """The extension's name: a digest of what its machine code depends on."""
    from importlib.metadata import version

    with open(loops.__file__, "rb") as f:
        source = f.read()
    key = b"\0".join([source, version("numba").encode(), sys.implementation.cache_tag.encode(),
                      sysconfig.get_platform().encode()])
    return "_packing_kernels_" + hashlib.sha256(key).hexdigest()[:16]


@functools.cache
def _compiled():
    name = module_name()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    path = os.path.join(cache_dir(), name + suffix)
    if not os.path.exists(path):
        try:
            _build(name, path)
        except Exception as e:  # the C compiler and distutils raise their own kinds
            log.warning("packing kernels: ahead-of-time build failed (%s); using Numba's JIT", e)
            return _jitted()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, path: str) -> None:
    """Compile ``loops`` with ``numba.pycc`` into ``path``, atomically: concurrent builders each
    write their own and the last rename wins, with identical code."""
    with warnings.catch_warnings():  # pending deprecation: the JIT is the way out (above)
        warnings.simplefilter("ignore")
        from numba.pycc import CC

    log.info("packing kernels: compiling ahead of time into %s (once)", path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    probes = logging.getLogger("compilers")  # setuptools logs each compiler probe at INFO
    level = probes.level
    probes.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
            cc = CC(name)
            cc.output_dir = tmp
            cc.verbose = False
            for fn, signature in loops.SIGNATURES.items():
                cc.export(fn, signature)(getattr(loops, fn))
            cc.compile()
            built = [f for f in os.listdir(tmp) if f.startswith(name)]
            if len(built) != 1:
                raise RuntimeError(f"numba.pycc wrote {built or 'nothing'} for {name}")
            os.replace(os.path.join(tmp, built[0]), path)  # tmp is beside path: one rename
    finally:
        probes.setLevel(level)


def _jitted() -> SimpleNamespace:
    from numba import njit

    return SimpleNamespace(**{fn: njit(signature, cache=True)(getattr(loops, fn))
                              for fn, signature in loops.SIGNATURES.items()})
