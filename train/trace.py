"""One step under the torch profiler (``--trace``), and what its device did in it.

The trace is Chrome's format (chrome://tracing, Perfetto): tens of MB for one step of a 2B
model, too much to read by eye or to carry off a leased machine. Beside it, ``summarize`` writes
the step's device time by kernel class (GEMM, attention, elementwise, ...) and the kernels that
took the most, the device's busy time against its span (the gaps are time the device waited for
the host), what the host was running in those gaps, and the host's synchronising runtime calls:
the first things to read when a step is slower than its FLOPs say. The step after it is sampled
(``sampled_step``): where the training thread's Python was, every millisecond, by function
(``HostSampler``), for when the host is what the device waits for.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import re
import sys
import sysconfig
import threading
import time
from collections import defaultdict
from typing import ContextManager

import torch

from vlmshard.io import read_json, write_json_atomic

from .clock import code_site

# the profiler ranges each layer's forward and recompute run in (``annotated``)
LAYER_RANGE = "vlmshard::"
# trace event categories that are device work
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel classes, by the first pattern a kernel's name matches (lower case)
KERNEL_CLASSES = (
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|sm\d+_.*_tn|nvjet|cublas|matmul"),
    ("norm", r"norm"),
    ("reduction", r"reduce|sum_kernel|max_kernel|softmax|cross_entropy|nll|triton_red|triton_per"),
    ("copy", r"memcpy|memset|copy|cat_|index|gather|scatter|transpose|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton"),
)


def traced_step(folder: str | None, rank: int, step: int, cuda: bool, on: bool
                ) -> ContextManager:
    """Inside: a torch profiler trace of the step (CPU, and CUDA kernels on GPU), written as
    ``folder/trace-rank{rank}-step{step}.json`` with its ``summarize`` beside it
    (``...-summary.json``); nothing when not ``on``."""
    if not on:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"trace-rank{rank}-step{step}.json")

    def ready(prof) -> None:
        prof.export_chrome_trace(path)
        write_json_atomic(path.replace(".json", "-summary.json"), summarize(path))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, record_shapes=True, on_trace_ready=ready)


def annotated(name: str, layer):
    """``layer`` run inside a profiler range named ``vlmshard::<name>`` while a profiler
    records (its recompute in backward too), so a trace's kernels can be charged to their
    layer (``by_layer``); otherwise called as it is."""
    def run(*args):
        if not torch.autograd.profiler._is_profiler_enabled:
            return layer(*args)
        with torch.profiler.record_function(LAYER_RANGE + name):
            return layer(*args)
    return run


class HostSampler:
    """Where the thread that made it runs Python, read about every ``interval`` seconds from a
    daemon thread (``sys._current_frames``: no tracing hook, so the sampled code runs at its
    own speed but for the sampler's share of the GIL, one hand-over per sample). Each sample is
    charged the time since the one before (the sampler waits for the GIL up to the
    interpreter's switch interval while the thread runs Python, not while it waits in C), at
    the innermost frame outside torch and the standard library: the code that called into
    them, as "file:first line function" (``seconds``, most first). A sampling profiler's view
    of the host: which of our, DeepSpeed's or ``transformers``' functions a step's host time
    goes to."""

    def __init__(self, interval: float = 1e-3) -> None:
        self.interval = interval
        self.thread = threading.get_ident()
        self.time: defaultdict[str, float] = defaultdict(float)
        self.samples = 0
        self._stop = threading.Event()

    def __enter__(self) -> "HostSampler":
        self._start = time.perf_counter()
        self._sampler = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()
        self.elapsed = time.perf_counter() - self._start

    def _run(self) -> None:
        last = self._start
        while not self._stop.wait(self.interval):
            site = self._site()
            now = time.perf_counter()
            if site is not None:
                self.samples += 1
                self.time[site] += now - last
            last = now

    def _site(self, tries: int = 3) -> str | None:
        """The sampled thread's calling site; None when it has no frame. A generator's frame
        loses its caller when it yields, so a walk that the sampled thread interrupts (the OS
        can pause this one while it holds the GIL) may find no frame outside torch: that
        sample is taken again, and only after ``tries`` such is the innermost frame charged."""
        for _ in range(tries):
            frame = sys._current_frames().get(self.thread)
            if frame is None:
                return None
            outside = _outside(frame)
            if outside is not None:
                return _site_of(outside)
        return _site_of(frame)

    def seconds(self, top: int = 40) -> dict[str, float]:
        """The sampled time by site, the ``top`` sites."""
        return dict(sorted(self.time.items(), key=lambda kv: -kv[1])[:top])


_TORCH = f"{os.sep}torch{os.sep}"
_STDLIB = sysconfig.get_paths()["stdlib"]


def _passed(filename: str) -> bool:
    """A frame of torch or of Python's standard library (frozen modules included)."""
    return _TORCH in filename or filename.startswith("<") or (
        filename.startswith(_STDLIB) and "-packages" not in filename)


def _outside(frame):
    """The innermost frame of ``frame``'s stack outside torch and the standard library (None
    when the walk finds none)."""
    while frame is not None and _passed(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _site_of(frame) -> str:
    code = frame.f_code
    return f"{code_site(code.co_filename, code.co_firstlineno)} {code.co_name}"


@contextlib.contextmanager
def sampled_step(folder: str | None, rank: int, step: int, on: bool):
    """Inside: this thread sampled (``HostSampler``), its sites written as
    ``folder/host-rank{rank}-step{step}.json``; nothing when not ``on``."""
    if not on:
        yield
        return
    with HostSampler() as sampler:
        yield
    os.makedirs(folder, exist_ok=True)
    write_json_atomic(os.path.join(folder, f"host-rank{rank}-step{step}.json"),
                      {"sampled_s": sampler.elapsed, "samples": sampler.samples,
                       "seconds": sampler.seconds()})


def kernel_class(name: str) -> str:
    lower = name.lower()
    return next((cls for cls, pattern in KERNEL_CLASSES if re.search(pattern, lower)), "other")


def summarize(path: str, top: int = 25) -> dict:
    """The device work in the trace at ``path``: ``device_busy_s`` (the union of its kernels'
    intervals), ``device_span_s`` (first kernel's start to last one's end), seconds by kernel
    class (``by_class``), the ``top`` kernels by time, and the host's synchronising runtime
    calls (``cuda*Synchronize``: calls and seconds). Empty figures where the trace has no device
    (CPU)."""
    events = read_json(path)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"] / 1e6
        by_name[e["name"]][1] += 1
    by_class: dict[str, float] = defaultdict(float)
    for name, (seconds, _) in by_name.items():
        by_class[kernel_class(name)] += seconds
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", ""):
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e.get("dur", 0) / 1e6
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the intervals
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    idle = host_while_idle(events, kernels)
    return {"device_busy_s": busy / 1e6,
            "by_layer": by_layer(events, kernels),
            "device_span_s": (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0,
            "device_idle_host": dict(sorted(idle.items(), key=lambda kv: -kv[1])[:top]),
            "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": name[:160], "class": kernel_class(name), "s": s,
                             "calls": n} for name, (s, n) in ranked],
            "host_syncs": {name: {"calls": n, "s": s} for name, (n, s) in syncs.items()}}


def host_while_idle(events: list[dict], kernels: list[dict], min_gap_us: float = 10.0
                    ) -> dict[str, float]:
    """Seconds the device sat idle between kernels (gaps of ``min_gap_us`` or more), by what
    the host was running then on the thread that launched the kernel ending the gap: its
    outermost CPU op (``aten::nonzero``; in backward ``autograd::engine::evaluate_function:
    ...``), ``(python)`` where that thread was between ops (interpreter time: our code, the
    engine's, the optimizer's loops), ``(python) <layer>`` where it launched the kernel inside
    that layer's range (``annotated``)."""
    launches = _launches(events)
    layers = LayerRanges(events)
    outermost: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    cpu_ops = (e for e in events if e.get("cat") == "cpu_op" and "dur" in e and "tid" in e)
    for e in sorted(cpu_ops, key=lambda e: (e["ts"], -e["dur"])):
        ops = outermost[e["tid"]]
        if not ops or e["ts"] >= ops[-1][1]:  # not inside the last outermost op
            ops.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    stops = {tid: [op[1] for op in ops] for tid, ops in outermost.items()}
    idle: dict[str, float] = defaultdict(float)
    end = None
    for k in sorted(kernels, key=lambda e: e["ts"]):
        if end is not None and k["ts"] - end >= min_gap_us:
            tid, launched = launches.get(k.get("args", {}).get("correlation"), (None, 0.0))
            ops = outermost.get(tid, [])
            covered = 0.0
            # a thread's outermost ops are disjoint and in order: from the first that ends
            # after the gap starts, while they start before it ends
            for start, stop, name in itertools.islice(
                    ops, bisect.bisect_right(stops.get(tid, []), end), None):
                if start >= k["ts"]:
                    break
                overlap = min(stop, k["ts"]) - max(start, end)
                idle[name] += overlap / 1e6
                covered += overlap
            layer = layers.at(tid, launched)
            idle["(python)" + (f" {layer}" if layer else "")] += (k["ts"] - end - covered) / 1e6
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    return dict(idle)


def by_layer(events: list[dict], kernels: list[dict]) -> dict[str, dict[str, float]]:
    """Device seconds by layer kind (``vit_embed``, ``vit_block``, ``projector``,
    ``llm_block``, ``head``, ...: a layer's name without its number) and kernel class. A kernel
    launched inside a layer's range (``annotated``: its forward, or its recompute in backward)
    is that layer's; one launched by the backward of an autograd node is the layer of the
    forward op that made the node (the op's ``Sequence number``, inside a layer's range on
    some thread: where threads' numbers collide, the thread with the most ranges); the rest is
    ``unattributed`` (the optimizer, DeepSpeed's own work)."""
    layers = LayerRanges(events)

    def kind_at(tid, ts: float) -> str | None:
        layer = layers.at(tid, ts)
        return re.sub(r"_\d+$", "", layer) if layer else None

    main = layers.busiest
    made_by: dict[int, dict[object, str]] = defaultdict(dict)  # sequence number -> tid -> kind
    for e in events:
        seq = e.get("args", {}).get("Sequence number")
        if (e.get("cat") == "cpu_op" and seq is not None and "evaluate_function" not in e["name"]
                and (kind := kind_at(e.get("tid"), e["ts"])) is not None):
            made_by[seq].setdefault(e.get("tid"), kind)
    backward_ops: dict[object, list[tuple[float, float, int]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("name", "").startswith(
                "autograd::engine::evaluate_function") and "Sequence number" in e.get("args", {}):
            backward_ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"],
                                           e["args"]["Sequence number"]))
    for ops in backward_ops.values():
        ops.sort()
    op_starts = {tid: [op[0] for op in ops] for tid, ops in backward_ops.items()}

    def node_kind(tid, ts: float) -> str | None:
        i = bisect.bisect_right(op_starts.get(tid, []), ts) - 1
        if i < 0 or ts > backward_ops[tid][i][1]:
            return None
        kinds = made_by.get(backward_ops[tid][i][2], {})
        return kinds[main] if len(kinds) > 1 and main in kinds else next(iter(kinds.values()),
                                                                          None)

    launches = _launches(events)
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for k in kernels:
        tid, ts = launches.get(k.get("args", {}).get("correlation"), (None, 0.0))
        kind = kind_at(tid, ts) or node_kind(tid, ts) or "unattributed"
        seconds[kind][kernel_class(k["name"])] += k["dur"] / 1e6
    return {kind: dict(sorted(by_class.items(), key=lambda kv: -kv[1]))
            for kind, by_class in seconds.items()}


def _launches(events: list[dict]) -> dict[int, tuple[object, float]]:
    """Each kernel's launch by its correlation id: the launching thread and the time."""
    return {e["args"]["correlation"]: (e.get("tid"), e["ts"]) for e in events
            if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}


class LayerRanges:
    """The layers' profiler ranges (``annotated``) on each thread: which layer a thread was
    running at a time (``at``); ``busiest``: the thread with the most (the forward's)."""

    def __init__(self, events: list[dict]) -> None:
        self.spans: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith(LAYER_RANGE):
                self.spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"],
                                             e["name"][len(LAYER_RANGE):]))
        for spans in self.spans.values():
            spans.sort()
        self.starts = {tid: [span[0] for span in spans] for tid, spans in self.spans.items()}
        self.busiest = max(self.spans, key=lambda tid: len(self.spans[tid]), default=None)

    def at(self, tid, ts: float) -> str | None:
        i = bisect.bisect_right(self.starts.get(tid, []), ts) - 1
        return self.spans[tid][i][2] if i >= 0 and ts <= self.spans[tid][i][1] else None
