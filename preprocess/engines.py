"""Execution engines: the same ``PartWorker`` run in-process, in a process pool, or on Ray Data.

Engines only decide where parts run; each part's output is fixed by its inputs, so every engine
and worker count commits identical files.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
from typing import Iterator

from .sources import Part
from .worker import JobSpec, PartWorker

log = logging.getLogger(__name__)

_worker: PartWorker | None = None


def _init_pool_worker(spec: JobSpec) -> None:
    global _worker
    _worker = PartWorker(spec)


def _run_in_pool(part: Part) -> dict:
    assert _worker is not None
    return _worker.process(part)


def run_local(spec: JobSpec, parts: list[Part], workers: int) -> Iterator[dict]:
    """Yield part summaries as parts finish; one worker runs in this process (no pool)."""
    if workers <= 1 or len(parts) <= 1:
        worker = PartWorker(spec)
        for part in parts:
            yield worker.process(part)
        return
    # spawn, not fork: the parent may hold pyarrow/tokenizer threads that fork would copy mid-lock.
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(parts)), initializer=_init_pool_worker,
                  initargs=(spec,)) as pool:
        yield from pool.imap_unordered(_run_in_pool, parts)


class _RayPartWorker:
    """Ray Data actor: builds the tokenizer once, then processes the parts it is handed."""

    def __init__(self, spec: JobSpec, parts: list[Part]) -> None:
        self.worker = PartWorker(spec)
        self.parts = {p.index: p for p in parts}

    def __call__(self, item: dict) -> dict:
        summary = self.worker.process(self.parts[int(item["part"])])
        # As JSON text: per-reason counts differ between parts, which Arrow cannot unify.
        return {"summary": json.dumps(summary)}


def run_ray(spec: JobSpec, parts: list[Part], workers: int | None,
            address: str | None) -> Iterator[dict]:
    """Run parts as a Ray Data job (``address`` joins an existing cluster; None starts one).

    Workers write parts straight to the output folder, which must be on storage every node sees.
    """
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        kwargs = {"address": address} if address else {"num_cpus": workers}
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 **kwargs)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        concurrency = max(1, min(workers or cpus, cpus, len(parts)))
        log.info("ray: %d part(s) on %d actor(s), cluster has %d CPU(s)",
                 len(parts), concurrency, cpus)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_items([{"part": p.index} for p in parts],
                                 override_num_blocks=len(parts))
        ds = ds.map(_RayPartWorker, fn_constructor_args=(spec, parts), num_cpus=1,
                    compute=ray.data.ActorPoolStrategy(size=concurrency))
        for row in ds.iter_rows():
            yield json.loads(row["summary"])
    finally:
        if started_here:
            ray.shutdown()
