"""One shape for every stage: ``run_<stage>(cfg) -> Result``, and one command-line runner.

A stage's result says once how it reads and how it is stored, so its command, ``--json`` and
``vlmshard run`` cannot word it differently: ``summary()`` is one line (what ``vlmshard run``
prints after the stage's name), ``text()`` what the stage's own command prints (the summary, or
a table; under ``-q`` the summary alone), ``to_json()`` what ``--json`` prints.
:func:`run_command` is every subcommand's body: config in, stage called, result printed, and any
:class:`~vlmshard.errors.VlmshardError` (or ``OSError``: a missing file, a full disk) turned into
one line on stderr and its exit status; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from importlib import import_module
from typing import Any, Callable, TypeVar

from .config import add_options, load_config
from .errors import VlmshardError
from .io import canonical_json

C = TypeVar("C")


class Result:
    """Base of the stage results (dataclasses, or a JSON mapping for the dict-shaped ones)."""

    def summary(self) -> str:
        """One line: what the stage did and where its output is."""
        raise NotImplementedError

    def text(self) -> str:
        """What the stage's command prints: the summary unless the stage has more to show."""
        return self.summary()

    def to_json(self) -> Any:
        """What ``--json`` prints; a dataclass's fields by default."""
        return dataclasses.asdict(self)

    @property
    def exit_status(self) -> int:
        """The command's exit status for a stage that ran to its end (verify: 1 on problems)."""
        return 0


def resolve(ref: str) -> Any:
    """The object a ``"module:name"`` reference names, imported when first needed (a stage's
    module may import torch; its command's ``--help`` must not)."""
    module, _, name = ref.partition(":")
    return getattr(import_module(module), name)


def stage_command(command: str, config_cls: type, stage: str
                  ) -> tuple[Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]:
    """A subcommand's ``add_arguments`` and ``main`` for the stage function ``stage``
    (``"module:run_<stage>"``) and its options ``config_cls``."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_stage_arguments(parser, config_cls)

    def main(args: argparse.Namespace) -> int:
        return run_command(command, config_cls, resolve(stage), args)

    return add_arguments, main


def add_stage_arguments(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """The config's options, ``--json``, which has this one meaning in every command, and the
    global options. The parser and the config class are recorded in the parsed arguments
    (``parser``, ``config_cls``): an unrecognized argument is reported with this command's usage,
    not the top-level one, and a command line can be checked without running it."""
    add_options(parser, config_cls)
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON on stdout instead of the summary")
    add_global_options(parser)
    parser.set_defaults(parser=parser, config_cls=config_cls)


# Options every command takes, before its name or after it: (flags, help).
GLOBAL_OPTIONS = ((("-v", "--verbose"), "debug logging"),
                  (("-q", "--quiet"), "the result's one line, warnings and errors only"),
                  (("--debug",), "on an error, print its traceback and the chain of its causes "
                                 "too"))


def add_global_options(parser: argparse.ArgumentParser, default: Any = argparse.SUPPRESS
                       ) -> None:
    """:data:`GLOBAL_OPTIONS` as flags. The top-level parser defaults them to False; a command's
    parser leaves them unset unless they are typed after the command's name (``SUPPRESS``), so
    it never resets one typed before it."""
    group = parser.add_argument_group("global options")
    for flags, help_text in GLOBAL_OPTIONS:
        group.add_argument(*flags, action="store_true", default=default, help=help_text)


def run_command(command: str, config_cls: type[C], stage: Callable[[C], Result],
                args: argparse.Namespace) -> int:
    """``vlmshard COMMAND``: load the config (``--config`` and flags), run the stage, print its
    text (its summary with ``-q``) or JSON; returns the exit status. Errors are one line,
    ``vlmshard COMMAND: error: ...``, after their traceback and causes with ``--debug``
    (``vlmshard --debug COMMAND``)."""
    as_json = vars(args).pop("json", False)
    debug = vars(args).pop("debug", False)
    quiet = vars(args).pop("quiet", False)
    try:
        result = stage(load_config(config_cls, args))
    except (VlmshardError, OSError) as e:
        if debug:
            traceback.print_exception(e, file=sys.stderr)
        print(f"vlmshard {command}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return getattr(e, "exit_status", 1)
    text = result.summary() if quiet else result.text()
    sys.stdout.write(canonical_json(result.to_json()) if as_json else text + "\n")
    return result.exit_status


def one_line(error: BaseException) -> str:
    """An error's message on one line (a message quoting a file's lines keeps them, joined); an
    operating system's error as the path and what is wrong with it, without its errno."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        paths = " -> ".join(str(p) for p in (error.filename, error.filename2) if p is not None)
        return f"{paths}: {error.strerror}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " | ".join(lines) or type(error).__name__
