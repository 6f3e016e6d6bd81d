"""Execution engines shared by the fleet stages: the same worker run in-process, in a local
process pool, or as Ray Data actors.

A stage supplies a worker class built once per process from a picklable spec (tokenizers, open
files) whose ``process(unit)`` commits one unit of work and returns a JSON-able summary. Engines
only decide where units run; a unit's output is fixed by its inputs, so every engine and worker
count commits identical files. Summaries arrive in completion order.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Protocol, Sequence, get_args

from .config import ConfigError, option
from .io import available_cpus
from .process import adopt_logger

log = logging.getLogger(__name__)

Engine = Literal["local", "ray"]
ENGINES: tuple[str, ...] = get_args(Engine)


@dataclass(kw_only=True)
class EngineOptions:
    """Where a fleet stage's units of work run: the options preprocess and write share."""

    engine: Engine = option("local", help="local process pool or Ray Data")
    workers: int | None = option(
        None, help="parallel workers",
        default_text="the CPUs this process may use; with ray, the cluster's CPUs")
    ray_address: str | None = option(
        None, help="join this Ray cluster (e.g. 10.0.0.1:6379) instead of starting one; OUT "
                   "must be on storage every node can write")

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")


class Worker(Protocol):
    def __init__(self, spec: Any) -> None: ...

    def process(self, unit: Any) -> dict:
        """Do and commit one unit of work; the summary must be JSON-serializable."""


def resolve_workers(engine: str, workers: int | None) -> int | None:
    """``workers`` if given, else the default: on ``local`` the CPUs this process may use; on
    ``ray`` None (the cluster's CPUs)."""
    return workers or (available_cpus() if engine == "local" else None)


def run_units(worker_cls: type[Worker], spec: Any, units: Sequence[Any], engine: str,
              workers: int | None, ray_address: str | None = None) -> Iterator[dict]:
    """Yield each unit's summary as it finishes, on the ``local`` or ``ray`` engine."""
    if engine == "local":
        return _run_local(worker_cls, spec, units, workers or 1)
    if engine == "ray":
        return _run_ray(worker_cls, spec, units, workers, ray_address)
    raise ValueError(f"unknown engine {engine!r}: choose {' or '.join(ENGINES)}")


_pool_worker: Worker | None = None


def _init_pool_worker(worker_cls: type[Worker], spec: Any) -> None:
    global _pool_worker
    _pool_worker = worker_cls(spec)


def _process_in_pool(unit: Any) -> dict:
    assert _pool_worker is not None
    return _pool_worker.process(unit)


def _run_local(worker_cls: type[Worker], spec: Any, units: Sequence[Any],
               workers: int) -> Iterator[dict]:
    if workers <= 1 or len(units) <= 1:  # one worker runs in this process, no pool
        worker = worker_cls(spec)
        for unit in units:
            yield worker.process(unit)
        return
    # spawn, not fork: the parent may hold pyarrow/tokenizer threads that fork would copy mid-lock.
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(units)), initializer=_init_pool_worker,
                  initargs=(worker_cls, spec)) as pool:
        yield from pool.imap_unordered(_process_in_pool, units)


def _not_token_default(record: logging.LogRecord) -> bool:
    """Not Ray's warning, on every cluster it starts, that it chose its default (token
    authentication): nothing to act on. Choosing it by name (``RAY_AUTH_MODE``) would have
    to happen before ``import ray``, which reads it once."""
    return not record.getMessage().startswith("Token authentication is enabled")


class _RayActor:
    """Ray Data actor: builds the worker once, then processes the unit each row carries."""

    def __init__(self, worker_cls: type[Worker], spec: Any) -> None:
        self.worker = worker_cls(spec)

    def __call__(self, item: dict) -> dict:
        summary = self.worker.process(pickle.loads(item["unit"]))
        # As JSON text: summaries differ in shape between units, which Arrow cannot unify.
        return {"summary": json.dumps(summary)}


def _run_ray(worker_cls: type[Worker], spec: Any, units: Sequence[Any], workers: int | None,
             address: str | None) -> Iterator[dict]:
    """Run units as a Ray Data job (``address`` joins an existing cluster; None starts one).

    Workers write straight to the output folder, which must be on storage every node sees.
    Ray's loggers go through this process's (``vlmshard.process.adopt_logger``), so ``-q``
    quiets them.
    """
    import ray
    import ray.data

    started_here = not ray.is_initialized()
    if started_here:
        kwargs = {"address": address} if address else {"num_cpus": workers}
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
            _not_token_default)
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 **kwargs)
    adopt_logger("ray")
    adopt_logger("ray.data")
    # Its one warning says that the progress bars are off, as turned off below: the units'
    # progress is this process's own
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        concurrency = max(1, min(workers or cpus, cpus, len(units)))
        log.info("ray: %d unit(s) on %d actor(s), cluster has %d CPU(s)",
                 len(units), concurrency, cpus)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        # One block per unit, each carrying its own pickled unit: an actor receives the units it
        # runs, not the whole list (whose parts hold row numbers and byte spans).
        ds = ray.data.from_items([{"unit": pickle.dumps(unit, pickle.HIGHEST_PROTOCOL)}
                                  for unit in units], override_num_blocks=len(units))
        # No actor restarts: Ray Data hands each actor its arguments through the object store,
        # from where Ray cannot restore them for a restarted actor (ray-project/ray#53727), and
        # says so on stderr, past any logging, for every actor it starts with restarts allowed
        # (ray#57733). A lost actor fails the job instead; a rerun resumes at its committed units.
        with warnings.catch_warnings():
            # Ray 2.60 deprecates remote arguments given to map, and names no other way to set
            # this one
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map(_RayActor, fn_constructor_args=(worker_cls, spec), num_cpus=1,
                        compute=ray.data.ActorPoolStrategy(size=concurrency), max_restarts=0)
        for row in ds.iter_rows():
            yield json.loads(row["summary"])
    finally:
        if started_here:
            ray.shutdown()
