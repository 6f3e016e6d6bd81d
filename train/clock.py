"""A pipeline stage's own compute time, read once per step.

DeepSpeed's timers (``wall_clock_breakdown``) trip an assertion in pipeline mode, so a stage
times itself: forward around its layers; backward from the moment its output's gradient arrives
to the moment the last of its parameters has its gradient; and the pipeline time, from the
step's start to the end of its last backward, which splits the step into the pipeline (where
its bubbles are) and what follows it (gradient all-reduce, optimizer). On a GPU the marks are
CUDA events recorded on the compute stream (a host clock would time kernel launches, not
kernels), and ``take`` synchronises once to read them all. Each training engine owns one clock
(``vlmshard.train.engine``) and hands it to the layers it builds.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch


def mark(cuda: bool):
    """A point in time on the compute stream: a recorded CUDA event, or the host clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds(start, end, cuda: bool) -> float:
    """Between two ``mark``s (CUDA events: once both are done on the device)."""
    return end - start if not cuda else start.elapsed_time(end) / 1000.0


@dataclass(frozen=True)
class StageTimes:
    """One step of one stage, in seconds."""

    forward_s: float
    backward_s: float
    pipeline_s: float  # step start to the end of the stage's last backward (0: no backward)


class StageClock:
    """Forward and backward intervals of this process's micro-batches since ``start_step``;
    ``cuda``: marks are CUDA events on the compute stream."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._start = None
        self._forward: list[tuple] = []
        self._backward: list[tuple] = []
        self._backward_open: list | None = None  # [start, latest parameter-gradient mark]

    def mark(self):
        return mark(self.cuda)

    def start_step(self) -> None:
        """Forget earlier intervals and mark the step's start."""
        self._forward, self._backward, self._backward_open = [], [], None
        self._start = self.mark()

    def forward_done(self, start) -> None:
        self._forward.append((start, self.mark()))

    def backward_done(self, start) -> None:
        """A backward timed around its call (the plain engine's; a pipeline stage's backward is
        timed by the hooks below, as DeepSpeed runs it)."""
        self._backward.append((start, self.mark()))

    def watch(self, parameters) -> None:
        for p in parameters:
            p.register_post_accumulate_grad_hook(self._on_parameter_grad)

    def output_grad_arrives(self, grad):
        """Tensor hook on the stage's output: this micro-batch's backward starts."""
        self._close_backward()
        start = self.mark()
        self._backward_open = [start, start]
        return grad

    def _on_parameter_grad(self, _param) -> None:
        if self._backward_open is None:
            return
        if self.cuda:  # one end event per micro-batch, re-recorded: the latest record counts
            if self._backward_open[1] is self._backward_open[0]:
                self._backward_open[1] = torch.cuda.Event(enable_timing=True)
            self._backward_open[1].record()
        else:
            self._backward_open[1] = time.perf_counter()

    def _close_backward(self) -> None:
        if self._backward_open is not None:
            self._backward.append(tuple(self._backward_open))
            self._backward_open = None

    def take(self) -> StageTimes:
        """The step's times since ``start_step``; one device synchronisation, after which the
        step's work is done on the device too."""
        self._close_backward()
        if self.cuda:
            torch.cuda.synchronize()
        out = StageTimes(sum(self._seconds(a, b) for a, b in self._forward),
                         sum(self._seconds(a, b) for a, b in self._backward),
                         self._seconds(self._start, self._backward[-1][1])
                         if self._backward and self._start is not None else 0.0)
        self._forward, self._backward, self._start = [], [], None
        return out

    def _seconds(self, start, end) -> float:
        return seconds(start, end, self.cuda)


class HostSyncs:
    """Counts the synchronizing CUDA calls made inside ``with`` (``torch.cuda``'s sync debug
    mode warns at each: a ``.item()``, a copy from the device, a pageable copy to it); a
    no-op off CUDA or when not ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self.count = 0

    def __enter__(self) -> "HostSyncs":
        if self.enabled:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            self.count = sum("synchronizing" in str(w.message) for w in self._caught)
