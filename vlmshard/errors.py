"""The project's errors: one base class, so the command line turns any of them into one line and
an exit status (``vlmshard.stage``), and nothing else (a bug) is hidden behind that line.

    VlmshardError          the message is one line naming the file, option or sample at fault
    ├── ConfigError        an option or config file is wrong: nothing ran
    ├── InputError         an input cannot be used at all (a source, a model folder, stats, a
    │   │                  plan, shards, a log); per-row faults are rejects, not errors
    │   └── Reject         one input row that becomes a reject record with a reason code
    │                      (``vlmshard.rejects``); preprocess catches it, so it never reaches
    │                      the command line
    └── JobError           a job that cannot go on (the folder is in use, a write that no
                           longer matches its plan, training processes that failed)

None derives from ``ValueError`` or ``RuntimeError``: a handler of those, around third-party
code, never swallows one of ours.
"""

from __future__ import annotations


class VlmshardError(Exception):
    """Any error of the project; ``exit_status`` is what the command line exits with."""

    exit_status = 1


class ConfigError(VlmshardError):
    """A config value or file is wrong; the message is one line naming key, type and source."""


class InputError(VlmshardError):
    """An input that cannot be used at all; the message names it and what is wrong."""


class JobError(VlmshardError):
    """A job that cannot go on; the message says why and what to do."""

