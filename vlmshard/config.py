"""Typed stage configs: each option is defined once, as a dataclass field, and that definition
makes its command-line flag, its YAML key, its type check and its help.

A field is declared with :func:`option` (default, help, and how the flag looks). The command
line (:func:`add_options`) and YAML files (:func:`load_config`, :func:`load_section`) both go
through the same pydantic type check, field by field, so ``lr: 3e-4`` (which YAML reads as a
string) arrives as the float 0.0003, and a wrong value is one line naming the key, the type it
needs and the file. Precedence: flags the user passed > the ``--config`` file > field defaults.

Why pydantic and argparse rather than a CLI generator such as jsonargparse or tyro: jsonargparse
spells flags with underscores (``--max_seq_len``) and prints multi-line union errors; tyro reads
no YAML, so a second validator would check the config files anyway. pydantic's lax mode is the
one type check both sources need, and argparse keeps ``--help`` fast (no import of the stage's
heavy modules) and the flags users already type.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union

from .errors import ConfigError

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None,
           metavar: str | None = None, positional: bool = False, cli: bool = True,
           default_text: str | None = None) -> Any:
    """A config field.

    help: what the option does, without its default (the help text appends it).
    factory: a default factory, for mutable defaults.
    metavar: the value's name in ``--help``, when the type's does not say it (``PATH``).
    positional: a positional argument on the command line (a list: any number of them).
    cli: False for options only a YAML file can set (nested mappings).
    default_text: what a ``None`` default means (``the CPUs this process may use``).
    """
    metadata = {"help": help, "metavar": metavar, "positional": positional, "cli": cli,
                "default_text": default_text}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# --- the type check ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def _adapter(annotation: Any):
    from pydantic import TypeAdapter

    return TypeAdapter(annotation)


def check_value(cls: type, name: str, value: Any, where: str) -> Any:
    """``value`` converted to field ``name``'s type, or a one-line :class:`ConfigError`."""
    annotation = _hints(cls)[name]
    if _conforms(value, annotation):
        return value  # most values already are (flags are parsed typed): no pydantic import
    from pydantic import ValidationError

    try:
        return _adapter(annotation).validate_python(value)
    except ValidationError as e:
        raise ConfigError(f"{where}: {name}: expected {type_name(annotation)}, got "
                          f"{value!r}") from e


def _conforms(value: Any, annotation: Any) -> bool:
    """Whether ``value`` already has exactly the declared type (nothing to convert)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return type(value) is list and all(_conforms(v, args[0]) for v in value)
    if origin is dict or annotation is dict:
        return type(value) is dict and all(_conforms(v, args[1]) for v in value.values()) \
            if args else type(value) is dict
    if annotation is type(None):
        return value is None
    return type(value) is annotation


def type_name(annotation: Any) -> str:
    """A type as a user reads it: ``int``, ``int or null``, ``one of local, ray``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin is dict or annotation is dict:
        return "a mapping"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


# --- building configs ----------------------------------------------------------------------------


def read_yaml_mapping(path: str) -> dict[str, Any]:
    """A YAML file's top-level mapping, with ``-`` in keys read as ``_``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(f"config {path} is not valid YAML{where}: "
                          f"{f'{context}: ' if context else ''}{problem}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping of option: value")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


def load_section(cls: type[T], values: dict[str, Any], where: str, **given: Any) -> T:
    """``cls`` from a mapping (a YAML file or a section of one), every value type-checked;
    ``given`` are values the caller supplies (``vlmshard run`` connects the stages' paths)."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of option: value, got {values!r}")
    clash = sorted({str(k).replace("-", "_") for k in values} & set(given))
    if clash:
        raise ConfigError(f"{where}: {', '.join(clash)} cannot be set here (it is connected "
                          "for you)")
    values = {**_checked(cls, values, where, hidden=set(given)), **given}
    _require(cls, values, where)
    try:
        return cls(**values)
    except ConfigError as e:  # the config's own check (__post_init__): name the section
        raise ConfigError(f"{where}: {e}") from e


def load_config(cls: type[T], args: argparse.Namespace | dict[str, Any]) -> T:
    """``cls`` from parsed arguments (:func:`add_options` made the parser): the ``--config``
    file's values, overridden by the flags the user passed."""
    flags = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    config_file = flags.pop("config", None)
    names = {f.name for f in dataclasses.fields(cls)}
    where = f"config {config_file}" if config_file else "options"
    values = _checked(cls, read_yaml_mapping(config_file), where) if config_file else {}
    values.update({k: check_value(cls, k, v, _flag_name(cls, k)) for k, v in flags.items()
                   if k in names})
    where = (f"{where} (pass them on the command line or in --config)" if config_file
             else "pass them on the command line or in a --config file")
    _require(cls, values, where, as_typed=True)
    return cls(**values)


def _require(cls: type, values: dict[str, Any], where: str, as_typed: bool = False) -> None:
    """A one-line error naming the required fields ``values`` lacks: as the user types them on
    the command line (``as_typed``: ``--out``, a positional ``SHARDS``), else as YAML keys.
    Once every required field is there, the dataclass checks its values in ``__post_init__``."""
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if not missing:
        return
    if not as_typed:
        raise ConfigError(f"missing required option(s) {', '.join(missing)}: {where}")
    positional = [_flag_name(cls, n) for n in missing if _field(cls, n).metadata.get("positional")]
    flags = [_flag_name(cls, n) for n in missing if not _field(cls, n).metadata.get("positional")]
    parts = ([f"missing required argument {', '.join(positional)}"] if positional else []) \
        + ([f"missing required option(s) {', '.join(flags)}"] if flags else [])
    raise ConfigError(f"{'; '.join(parts)}: {where}")


def _checked(cls: type, values: dict[str, Any], where: str, hidden: set[str] = frozenset()
             ) -> dict[str, Any]:
    """Every value of a mapping type-checked, keys with ``-`` read as ``_``; unknown keys fail."""
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(n for n in sorted(names) if n not in hidden)}")
    return {k: check_value(cls, k, v, where) for k, v in values.items()}


# --- the command line ----------------------------------------------------------------------------


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls`` (plus ``--config``), from the fields' own definitions.

    Flags default to *absent* so that only what the user typed overrides the config file; the
    values are strings here and are type-checked by :func:`load_config`.
    """
    parser.add_argument("--config", metavar="YAML",
                        help="YAML file with any of these options, keys as the flags without "
                             "'--' (flags override it)")
    hints = _hints(cls)
    own = cls.__dict__.get("__annotations__", {})  # a stage's own options first, shared ones after
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        meta = f.metadata
        if not meta.get("cli", True) or "help" not in meta:
            continue
        annotation = hints[f.name]
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": _help(f)}
        inner = _strip_optional(annotation)
        if typing.get_origin(inner) is Literal:
            kwargs["choices"] = [str(a) for a in typing.get_args(inner)]
            if len(", ".join(kwargs["choices"])) > _INLINE_CHOICES:  # listed in the help instead
                kwargs["metavar"] = _metavar(f.name, inner)
                kwargs["help"] += f"; one of: {', '.join(kwargs['choices'])}"
        elif inner is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = _metavar(f.name, inner)
        if inner in (int, float):  # parsed here, so the value arrives typed
            kwargs["type"] = inner
        if typing.get_origin(inner) in (list, tuple):  # one value per word: INPUT [INPUT ...]
            item = typing.get_args(inner)[0]
            kwargs["nargs"] = "*" if meta["positional"] else "+"
            kwargs["metavar"] = _metavar(f.name.removesuffix("s"), item)
            if item in (int, float):
                kwargs["type"] = item
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
        if meta["positional"]:
            kwargs.setdefault("nargs", "?")  # optional here: --config may give it
            parser.add_argument(f.name, **kwargs)
        else:
            parser.add_argument(_flag_name(cls, f.name), dest=f.name, **kwargs)


# Longer lists of choices would make the usage line wider than a terminal.
_INLINE_CHOICES = 50


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _flag_name(cls: type, name: str) -> str:
    """How the user typed option ``name``: ``--max-seq-len``, or ``INPUTS`` for a positional."""
    field = _field(cls, name)
    return name.upper() if field.metadata.get("positional") else "--" + name.replace("_", "-")


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if required and not f.metadata.get("positional"):
        return f"{text} (required)"
    if f.metadata.get("default_text"):
        return f"{text} (default: {f.metadata['default_text']})"
    if f.default is not dataclasses.MISSING and f.default is not None \
            and not isinstance(f.default, bool):
        return f"{text} (default: {f.default})"
    return text


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _metavar(name: str, annotation: Any) -> str:
    if annotation in (int, float):
        return "N" if annotation is int else "X"
    return name.upper()


# --- values with units ----------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str) -> int:
    """Bytes from ``1GB``, ``512MiB``, ``2.5 GB`` or a plain integer (decimal units are powers
    of 1000, ``*iB`` of 1024, as ``du --si`` and ``du``)."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if not m:
            raise ConfigError(f"cannot read size {value!r}: use bytes or a number with KB, MB, "
                              "GB, TB (powers of 1000) or KiB, MiB, GiB, TiB")
        n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2) or ""])
    if n < 1:
        raise ConfigError(f"size must be positive, got {value!r}")
    return n
