"""The garbage collector kept out of training steps.

Python starts a collection on its own whenever allocations outrun frees by a threshold, so one
lands inside whichever step crosses it; with torch, ``transformers`` and DeepSpeed loaded a full
one walks millions of objects, a host stall the device waits on, at a different step on each
rank, so the data-parallel ranks wait for the slowest. After set-up everything alive is frozen
(``gc.freeze``: the permanent generation, which no collection walks) and automatic collection is
off; every ``--gc-every`` steps, between steps, the young generations are collected on every
rank at once (the manual collection torchtitan and Megatron run)."""

from __future__ import annotations

import gc
from dataclasses import dataclass


@dataclass
class StepCollector:
    """``with StepCollector(every) as c:`` around the steps, ``c.after_step(n)`` between them."""

    every: int  # steps between collections (0: Python's own schedule, inside steps too)

    def __enter__(self) -> "StepCollector":
        if self.every:
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def after_step(self, completed: int) -> None:
        """Collect the young generations when ``completed`` steps make a multiple of
        ``every``: cycles made by the steps since (the frozen set-up is not walked)."""
        if self.every and completed % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.every:
            gc.enable()
            gc.unfreeze()
