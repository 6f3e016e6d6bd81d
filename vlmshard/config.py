"""Stage configs from YAML and command-line flags: flags override the file, the file overrides
the dataclass defaults. YAML keys are the dataclass field names (dashes or underscores)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_config(cls: type[T], flags: dict[str, Any], config_file: str | None = None) -> T:
    """Build ``cls`` from an optional YAML file and the flags the user actually passed."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if config_file:
        try:
            with open(config_file, encoding="utf-8") as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"cannot read config {config_file}: {e.strerror}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"config {config_file} must be a mapping of option: value")
        values = {k.replace("-", "_"): v for k, v in loaded.items()}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"config {config_file}: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(fields))}")
    values.update({k: v for k, v in flags.items() if k in fields})
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"missing required option(s): {', '.join(missing)} "
                         "(pass them as arguments or in the --config file)")
    return cls(**values)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from ``1GB``, ``512MiB``, ``2.5 GB`` or a plain integer (decimal units are powers
    of 1000, ``*iB`` of 1024, as ``du --si`` and ``du``)."""
    import re

    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if not m:
            raise ValueError(f"cannot read size {value!r}: use bytes or a number with KB, MB, GB, "
                             "TB (powers of 1000) or KiB, MiB, GiB, TiB")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    if n < 1:
        raise ValueError(f"size must be positive, got {value!r}")
    return n
