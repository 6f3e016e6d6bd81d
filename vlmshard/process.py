"""What a vlmshard process does when it starts, whoever started it: the command line, a
training rank."""

from __future__ import annotations

import atexit
import gc
import logging
import os

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Read by Hugging Face's libraries when imported: their progress bars (writing a model folder, a
# dataset's parquet) are left out where INFO is
QUIET_PROGRESS = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


def skip_collection_at_exit() -> None:
    """Keep the objects alive at exit out of the interpreter's last garbage collections.

    Finalization collects every object the process made; after importing torch,
    ``transformers`` and DeepSpeed those are millions, 1–3 s of CPU a process here
    (BENCHMARKS.md), paid by each rank and by the command that checks and launches them.
    ``gc.freeze`` in an exit handler moves them to the permanent generation, which those
    collections pass over; the other exit handlers (flushing, closing) run as before. Once per
    process, however often it is called."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def set_up_logging(level: int | str) -> None:
    """Log records at ``level`` and above to stderr in one format, Python's warnings among
    them (``-q``: warnings and errors only, in the command and in every process it starts,
    which take :func:`log_level` from it). The level is set even where handlers exist already
    (a test's capture), so the processes a command starts follow the command's flag."""
    logging.basicConfig(format=LOG_FORMAT, datefmt="%H:%M:%S")
    logging.getLogger().setLevel(level)
    logging.captureWarnings(True)
    # kept by DeepSpeed's logger when it sets itself up on import, which warns then
    logging.getLogger("DeepSpeed").addFilter(_not_cpu_fallback)
    if not logging.getLogger().isEnabledFor(logging.INFO):
        for name in QUIET_PROGRESS:
            os.environ.setdefault(name, "1")


def _not_cpu_fallback(record: logging.LogRecord) -> bool:
    """Not DeepSpeed's warning, on import where it finds no GPU, that it takes the CPU: a
    process without one trains on it (the launcher names it for the ranks, DS_ACCELERATOR)."""
    return not record.getMessage().startswith("Setting accelerator to CPU")


def log_level() -> str:
    """This process's level by name (``WARNING`` under ``-q``), for the processes it starts."""
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


def adopt_logger(name: str) -> None:
    """A library's logger that prints through a console handler of its own (DeepSpeed's, Ray
    Data's), routed through this process's logging instead: its console handlers removed (a
    file's stay), its records passed on in this process's format, at the library's own level or
    this process's, whichever is higher. Call it once the library has set its logger
    up (on import, or when it starts)."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler):
            logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(max(logger.getEffectiveLevel(), logging.getLogger().getEffectiveLevel()))
