"""Registries of things by name (families, container readers): the built-in ones first, then
those a user's own modules register, modules named in an environment variable (comma-separated:
``VLMSHARD_FAMILIES``, ``VLMSHARD_READERS``) and imported once per process. Every process a job
starts inherits the variable."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def import_named_modules(variable: str, what: str) -> None:
    """Import each module ``$variable`` names; one that cannot be imported is a config error."""
    for module in filter(None, (m.strip() for m in os.environ.get(variable, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{variable}: cannot import {what} module {module!r}: {e}") from e


def once(load: Callable[[], None]) -> Callable[[], None]:
    """``load`` run once per process, also when threads call it together (``functools.cache``
    would run it in each: a registry's built-ins registered twice). A call made while it runs,
    from inside it (a user's module registering), returns at once; a failed run is retried."""
    lock = threading.RLock()
    started = False

    @functools.wraps(load)
    def run_once() -> None:
        nonlocal started
        with lock:
            if started:
                return
            started = True
            try:
                load()
            except BaseException:  # anything, a bug included: load again next time, re-raised
                started = False
                raise

    return run_once


class Registry(Generic[T]):
    """Things of one kind by name. ``built_ins`` registers the built-in ones (through ``add``,
    with ``built_in=True``) before any other is added, so a user's name is refused or replaces
    one whatever order modules are imported in; ``load`` then imports the modules ``variable``
    names."""

    def __init__(self, what: str, variable: str, built_ins: Callable[[], None]) -> None:
        self.what, self.variable = what, variable
        self.items: dict[str, T] = {}
        self.built_in: set[str] = set()
        self._built_ins = once(built_ins)
        self.load = once(self._load)

    def _load(self) -> None:
        self._built_ins()
        import_named_modules(self.variable, self.what)

    def add(self, name: str, item: T, *, replace: bool = False, built_in: bool = False) -> T:
        """Register ``item`` as ``name``; a name registered already is refused unless
        ``replace``."""
        if not built_in:
            self._built_ins()
        if name in self.items and not replace:
            raise ConfigError(f"{self.what} {name!r} is registered already (by "
                              f"{type(self.items[name]).__module__}): give yours another name, "
                              "or register it with replace=True to replace that one")
        self.items[name] = item
        (self.built_in.add if built_in else self.built_in.discard)(name)
        return item

    def all(self) -> dict[str, T]:
        """Every registered item by name, the user's modules imported."""
        self.load()
        return self.items
