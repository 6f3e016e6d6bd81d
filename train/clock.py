"""A rank's own time in a step, by part of the model, read once per step.

DeepSpeed's timers (``wall_clock_breakdown``) trip an assertion in pipeline mode, so a stage
times itself. Forward: around its layers, one interval per run of consecutive layers of one part
(``PARTS``). Backward: from the moment the gradient of a part's last output arrives to the moment
the next part's arrives (tensor hooks), the stage's last interval ending at its last parameter's
gradient (or, in the plain engine, where its ``backward`` call returns). Recompute: the re-forward
of a checkpointed layer inside backward, timed around the layer's second call and taken off its
part's backward. Optimizer: torch's optimizer step, from its first pre-hook to its last
post-hook. The pipeline time runs from the step's start to the end of the stage's last backward,
which splits the step into the pipeline (where its bubbles are) and what follows it (gradient
all-reduce, optimizer). On a GPU the marks are CUDA events recorded on the compute stream (a
host clock would time kernel launches, not kernels), and ``take`` synchronises once to read them
all; on CPU, where the device is synchronous, they are ``perf_counter`` readings. Each mark also
keeps the host clock's reading where it was made, so every part has a host time too: the time
the host took to launch it. A part whose host time nears its device time is host-bound (the
device waited for launches, which the device's own intervals cannot tell apart from work). Each
training engine owns one clock (``vlmshard.train.engine``) and hands it to the layers it
builds.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

# The parts of the model a step's compute is split into: ViT (patch embedding and blocks),
# projector (merger), LLM (token embedding, blocks, final norm), head (LM head and loss)
PARTS = ("vit", "projector", "llm", "head")


def layer_part(name: str) -> str:
    """The part (``PARTS``) a pipeline layer belongs to, by its name (``LayerDef.name``)."""
    if name.startswith("vit_"):
        return "vit"
    if name in ("projector", "head"):
        return name
    return "llm"


class Mark:
    """A point in a step on two clocks: the compute stream's (a recorded CUDA event; on CPU,
    where the device is synchronous, the host clock) and the host's, read where it was made (on
    a GPU: when the host had launched the work before it)."""

    __slots__ = ("event", "host")

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.record()

    def record(self) -> "Mark":
        """Move the mark to now (its event re-recorded)."""
        self.host = time.perf_counter()
        if self.event is not None:
            self.event.record()
        return self

    def seconds_to(self, end: "Mark") -> float:
        """The device's seconds from here to ``end`` (events: once both are done on it)."""
        if self.event is None:
            return end.host - self.host
        return self.event.elapsed_time(end.event) / 1000.0

    def host_seconds_to(self, end: "Mark") -> float:
        return end.host - self.host


@dataclass(frozen=True)
class StageTimes:
    """One step of one stage, in seconds."""

    forward_s: float
    backward_s: float  # recompute included
    pipeline_s: float  # step start to the end of the stage's last backward (0: no backward)
    # per part (PARTS): its layers' forward and backward, recompute excluded
    parts: dict[str, float] = field(default_factory=dict)
    recompute_s: float = 0.0
    optimizer_s: float = 0.0
    # the host's time launching each of the above (PARTS, "recompute", "optimizer")
    host: dict[str, float] = field(default_factory=dict)


class StageClock:
    """The intervals of this process's micro-batches since ``start_step``; ``cuda``: marks are
    CUDA events on the compute stream."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._clear()

    def _clear(self) -> None:
        self._start = None
        self._forward: list[tuple] = []  # (part, start, end)
        self._backward: list[tuple] = []  # (part, start, end)
        self._recompute: list[tuple] = []  # (part, start, end)
        self._spans: list[tuple] = []  # (start, end): each micro-batch's whole backward
        self._open: list | None = None  # [part, start] of the backward interval running
        self._span_start = None
        self._latest = None  # the latest parameter-gradient mark of the open backward
        self._last = None  # the end of the latest forward interval
        self._optimizer: list | None = None  # [first pre-hook mark, last post-hook mark]

    def mark(self) -> Mark:
        return Mark(self.cuda)

    def start_step(self) -> None:
        """Forget earlier intervals and mark the step's start."""
        self._clear()
        self._start = self.mark()

    # forward

    def forward_begin(self) -> None:
        """A micro-batch's forward through this stage starts."""
        self._last = self.mark()

    def forward_part(self, part: str) -> None:
        """The forward since the last mark was ``part``'s."""
        end = self.mark()
        self._forward.append((part, self._last, end))
        self._last = end

    def recomputed(self, part: str, fn):
        """``fn`` as a checkpointed layer of ``part`` calls it: the first call is its forward,
        any later one its recompute in backward, timed (also when the checkpoint stops it early
        by raising, once the tensors backward needs are made again)."""
        calls = 0

        def run(*args):
            nonlocal calls
            calls += 1
            if calls == 1:
                return fn(*args)
            start = self.mark()
            try:
                return fn(*args)
            finally:
                self._recompute.append((part, start, self.mark()))
        return run

    # backward

    def backward_begin(self, part: str) -> None:
        """A micro-batch's backward through this stage starts, with ``part``'s (the stage's
        last layer's)."""
        self._close_backward()
        self._span_start = self._latest = self.mark()
        self._open = [part, self._span_start]

    def output_grad_arrives(self, part: str):
        """A tensor hook on the stage's output (a pipeline stage's backward starts when DeepSpeed
        gives it its output's gradient)."""
        def hook(grad):
            self.backward_begin(part)
            return grad
        return hook

    def part_grad_arrives(self, part: str):
        """A tensor hook on the last output of a run of ``part``'s layers: its backward starts."""
        def hook(_grad) -> None:
            if self._open is None:
                return
            now = self.mark()
            self._backward.append((self._open[0], self._open[1], now))
            self._open = [part, now]
        return hook

    def backward_done(self) -> None:
        """The plain engine's ``backward`` call returned: the micro-batch's backward ends."""
        self._latest = self.mark()
        self._close_backward()

    def watch(self, parameters) -> None:
        """A pipeline stage's backward ends at its last parameter's gradient."""
        for p in parameters:
            p.register_post_accumulate_grad_hook(self._on_parameter_grad)

    def watch_input(self, x: torch.Tensor) -> None:
        """Or at its input's gradient, where later (a stage whose frozen layers only pass the
        gradient down has no parameter's to wait for)."""
        x.register_hook(self._on_input_grad)

    def _on_input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self._on_parameter_grad(None)
        return grad

    def _on_parameter_grad(self, _param) -> None:
        if self._open is None:
            return
        # one end mark per micro-batch, re-recorded: the latest record counts
        if self._latest is self._span_start:
            self._latest = self.mark()
        else:
            self._latest.record()

    def _close_backward(self) -> None:
        if self._open is not None:
            self._backward.append((self._open[0], self._open[1], self._latest))
            self._spans.append((self._span_start, self._latest))
            self._open = None

    # optimizer

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Time torch's ``optimizer`` step (DeepSpeed calls it once a step, ZeRO-3 once per
        parameter group)."""
        optimizer.register_step_pre_hook(self._on_optimizer_start)
        optimizer.register_step_post_hook(self._on_optimizer_end)

    def _on_optimizer_start(self, *_) -> None:
        if self._optimizer is None:
            self._optimizer = [self.mark(), None]

    def _on_optimizer_end(self, *_) -> None:
        if self._optimizer is None:
            return
        if self._optimizer[1] is None:
            self._optimizer[1] = self.mark()
        else:
            self._optimizer[1].record()

    def take(self) -> StageTimes:
        """The step's times since ``start_step``; one device synchronisation, after which the
        step's work is done on the device too."""
        self._close_backward()
        if self.cuda:
            torch.cuda.synchronize()
        parts = dict.fromkeys(PARTS, 0.0)
        host = dict.fromkeys(PARTS, 0.0)
        for part, a, b in self._forward + self._backward:
            parts[part] += a.seconds_to(b)
            host[part] += a.host_seconds_to(b)
        recompute = host["recompute"] = 0.0
        for part, a, b in self._recompute:
            took = a.seconds_to(b)
            parts[part] -= took
            recompute += took
            launched = a.host_seconds_to(b)
            host[part] -= launched
            host["recompute"] += launched
        optimizer = self._optimizer
        ran = optimizer is not None and optimizer[1] is not None
        host["optimizer"] = optimizer[0].host_seconds_to(optimizer[1]) if ran else 0.0
        out = StageTimes(
            sum(a.seconds_to(b) for _, a, b in self._forward),
            sum(a.seconds_to(b) for a, b in self._spans),
            self._start.seconds_to(self._spans[-1][1])
            if self._spans and self._start is not None else 0.0,
            parts, recompute, optimizer[0].seconds_to(optimizer[1]) if ran else 0.0, host)
        self._clear()
        return out


# The caching allocators' own calls to CUDA, counted by ``torch.cuda.memory_stats``: device
# allocations (cudaMalloc, or cuMemMap of expandable segments), frees (cudaFree or cuMemUnmap:
# each waits for the device, unseen by the sync debug mode), the cache flushes after a failed
# allocation; and by ``torch.cuda.host_memory_stats`` the pinned host memory allocated (page
# locking: milliseconds for a large block) and the seconds it took. In a steady step all are 0.
ALLOCATOR_CALLS = {"device_allocs": "num_device_alloc", "device_frees": "num_device_free",
                   "alloc_retries": "num_alloc_retries"}
PINNED_CALLS = {"pinned_allocs": ("num_host_alloc", 1), "pinned_alloc_s": (
    "host_alloc_time.total", 1e-6)}  # microseconds


def allocator_calls(device: torch.device) -> dict[str, float]:
    """The allocators' counts so far (``ALLOCATOR_CALLS`` on ``device``, ``PINNED_CALLS``)."""
    stats = torch.cuda.memory_stats(device)
    pinned = torch.cuda.host_memory_stats()
    return {**{name: stats.get(key, 0) for name, key in ALLOCATOR_CALLS.items()},
            **{name: pinned.get(key, 0) * unit for name, (key, unit) in PINNED_CALLS.items()}}


class HostSyncs:
    """Counts the calls inside ``with`` that make the host wait for the device, and where each
    was made (``sites``: "file:line" of the first caller outside torch and DeepSpeed's
    accelerator, counted): the synchronizing CUDA calls ``torch.cuda``'s sync debug mode warns
    at (a ``.item()``, a copy from the device, a pageable copy to it), and
    ``torch.cuda.synchronize``, counted by wrapping it while inside (the mode sees it on some
    torch versions and not on others: what it reports at ``torch.cuda``'s own lines is dropped,
    so each call counts once, at its caller). A no-op when not ``enabled``; off CUDA only
    ``synchronize`` calls are counted."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._debug = enabled and torch.cuda.is_available()
        self.sites: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> "HostSyncs":
        if self.enabled:
            self._synchronize = torch.cuda.synchronize

            def counted(*args, **kwargs):
                try:
                    return self._synchronize(*args, **kwargs)
                finally:
                    self.sites[_caller(sys._getframe(1))] += 1

            torch.cuda.synchronize = counted
        if self._debug:
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._debug:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(*exc)
            # torch 2.11 on an H200 reported ``synchronize`` again, at torch/cuda/__init__.py:1270:
            # ``set_sync_debug_mode``'s call into C++, where the warning surfaces after the
            # wrapped call (dropping it there did not catch it)
            self.sites.update(code_site(w.filename, w.lineno) for w in self._caught
                              if "synchronizing" in str(w.message)
                              and not w.filename.endswith(_TORCH_CUDA))
        if self.enabled:
            torch.cuda.synchronize = self._synchronize


# torch.cuda's module, whose ``synchronize`` the wrapper counts at its caller
_TORCH_CUDA = os.path.join("torch", "cuda", "__init__.py")
# frames a synchronisation passes through on its way from the code that asked for it
_PASSED = (f"{os.sep}torch{os.sep}", f"{os.sep}deepspeed{os.sep}accelerator{os.sep}")


def _caller(frame) -> str:
    """The site of the first frame from ``frame`` outwards outside torch and DeepSpeed's
    accelerator."""
    while frame.f_back is not None and any(p in frame.f_code.co_filename for p in _PASSED):
        frame = frame.f_back
    return code_site(frame.f_code.co_filename, frame.f_lineno)


def code_site(filename: str, line: int) -> str:
    """``filename:line``, the path from its package (the folder above ``site-packages`` or the
    repository dropped)."""
    parts = filename.split(os.sep)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + 1:]
            break
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{line}"
