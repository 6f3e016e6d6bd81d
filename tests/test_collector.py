"""Python's garbage collector between training steps only (``train.collector``)."""

from __future__ import annotations

import gc

from vlmshard.train.collector import StepCollector


def _collections_by_step(every: int, steps: int) -> list:
    """Run ``steps`` steps that each leave 20,000 reference cycles (far past the young
    generation's threshold of allocations), and return, for each collection Python started,
    the step it started in (None: between steps) and its generation."""
    where: list = []
    now: list = [None]

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            where.append((now[0], info["generation"]))

    gc.callbacks.append(seen)
    try:
        with StepCollector(every) as collector:
            for step in range(steps):
                now[0] = step
                for _ in range(20_000):
                    cycle: list = []
                    cycle.append(cycle)
                now[0] = None
                collector.after_step(step + 1)
    finally:
        gc.callbacks.remove(seen)
    return where


def test_no_collection_starts_inside_a_step_and_one_runs_every_n_steps():
    # a full one before the steps (then frozen), the young ones after steps 3 and 6
    assert _collections_by_step(3, 7) == [(None, 2), (None, 1), (None, 1)]
    assert gc.isenabled() and gc.get_freeze_count() == 0  # the interpreter's own again
    # Python's own schedule collects inside the steps, the stall the collector keeps out
    assert any(step is not None for step, _ in _collections_by_step(0, 2))
