"""A user's own modules, named in an environment variable (comma-separated) and imported so that
they register what they define: families (``VLMSHARD_FAMILIES``) and container readers
(``VLMSHARD_READERS``). Every process a job starts inherits the variable."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable

from .errors import ConfigError


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
            except BaseException:
                started = False
                raise

    return run_once
