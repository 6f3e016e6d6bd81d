"""One step under the torch profiler (``--trace``), and what its device did in it.

The trace is Chrome's format (chrome://tracing, Perfetto): tens of MB for one step of a 2B
model, too much to read by eye or to carry off a leased machine. Beside it, ``summarize`` writes
the step's device time by kernel class (GEMM, attention, elementwise, ...) and the kernels that
took the most, the device's busy time against its span (the gaps are time the device waited for
the host), and the host's synchronising runtime calls: the first things to read when a step is
slower than its FLOPs say.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import defaultdict
from typing import ContextManager

from vlmshard.io import read_json, write_json_atomic

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
    return {"device_busy_s": busy / 1e6,
            "device_span_s": (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0,
            "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": name[:160], "class": kernel_class(name), "s": s,
                             "calls": n} for name, (s, n) in ranked],
            "host_syncs": {name: {"calls": n, "s": s} for name, (n, s) in syncs.items()}}
