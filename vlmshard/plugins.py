"""A user's own modules, named in an environment variable (comma-separated) and imported so that
they register what they define: families (``VLMSHARD_FAMILIES``) and container readers
(``VLMSHARD_READERS``). Every process a job starts inherits the variable."""

from __future__ import annotations

import importlib
import os

from .errors import ConfigError


def import_named_modules(variable: str, what: str) -> None:
    """Import each module ``$variable`` names; one that cannot be imported is a config error."""
    for module in filter(None, (m.strip() for m in os.environ.get(variable, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{variable}: cannot import {what} module {module!r}: {e}") from e
