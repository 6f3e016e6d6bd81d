"""Stage configs from YAML and command-line flags: flags override the file, the file overrides
the dataclass defaults. YAML keys are the dataclass field names (dashes or underscores)."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def load_config(cls: type[T], flags: dict[str, Any], config_file: str | None = None) -> T:
    """Build ``cls`` from an optional YAML file and the flags the user actually passed."""
    values: dict[str, Any] = {}
    if config_file:
        values = read_yaml_mapping(config_file)
        check_keys(cls, values, f"config {config_file}")
    values.update({k: v for k, v in flags.items() if k in _field_names(cls)})
    return from_mapping(cls, values, "pass them as arguments or in the --config file")


def read_yaml_mapping(path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping, with ``-`` in keys read as ``_``."""
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config {path} must be a mapping of option: value")
    return {k.replace("-", "_"): v for k, v in loaded.items()}


def check_keys(cls: type, values: dict[str, Any], where: str) -> None:
    unknown = sorted(set(values) - _field_names(cls))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_field_names(cls)))}")


def from_mapping(cls: type[T], values: dict[str, Any], hint: str) -> T:
    """``cls(**values)`` once every required field is there (``hint`` says where to add them)."""
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"missing required option(s): {', '.join(missing)} ({hint})")
    return cls(**values)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


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
