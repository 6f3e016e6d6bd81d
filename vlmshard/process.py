"""What a vlmshard process does when it starts, whoever started it: the command line, a
training rank."""

from __future__ import annotations

import atexit
import gc


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
