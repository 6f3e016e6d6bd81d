"""Reading a training run's log: ``train_log.jsonl``, one JSON line per optimizer step (written
by global rank 0 through ``vlmshard.train.train_log``), and ``pipeline.json`` beside it.

Kept below the stages and free of torch, so that the simulator and the report read a run
without importing the trainer. A record holds every rank's timings and, for each data-parallel
rank, what its first stage trained:

``{"step", "loss", "lr", "step_time_s", "load_s", "tokens", "tokens_per_s",
"end_to_end_tokens_per_s", "model_flops", "model_flops_per_s", "hardware_flops",
"hardware_flops_per_s", "ranks": [{"rank", "stage", "dp_rank", "forward_s", "backward_s",
"pipeline_s", "wait_s", "step_time_s", "load_s", "time_breakdown": {"vit", "projector", "llm",
"head", "recompute", "optimizer", "pipeline_wait", "data_wait", "other"}}], "data": [{"dp_rank",
"tokens", "plan_steps", "micro_sizes", "sample_ids"}]}`` (``micro_sizes``: per micro-batch
its tiles, tokens and squares, and where the model has them ``windowed``, ``vit_squares`` and
``vit_windows``: ``vlmshard.train.train_log.micro_batch_size``; ``hardware_flops``: the model's
FLOPs and those recompute runs again; ``time_breakdown``: the rank's ``load_s + step_time_s``
by part, ``vlmshard.train.train_log.time_breakdown``); a step traced by the profiler
(``--trace``) has ``"traced": true``; on GPU a rank
also logs ``peak_memory_bytes`` and ``peak_reserved_bytes`` (the allocator's peaks in the
step: ``max_memory_allocated``, which pipeline.json's predicted peak is checked against, and
``max_memory_reserved``) and, when counted, ``host_syncs`` with ``host_sync_sites`` (each
"file:line" that made the host wait, and how often: ``vlmshard.train.clock.HostSyncs``).
With ``--compile-blocks`` a rank logs ``compilations``: ``torch.compile``'s compilations in
its process so far (``vlmshard.train.kernels.CompileCount``); a steady run stops adding to it.
The first step after a start or resume also has, per rank, ``engine_bytes``:
the bytes of the tensors the DeepSpeed engine holds at its first optimizer update, counted once
per storage (``vlmshard.train.engine_memory``): ``{"weights", "gradients", "optimizer",
"total", "params", "buckets", "other"}``, where ``total`` (weights, gradients, fp32 master
weights, moments and DeepSpeed's flat buffers) is what ``model_sizes.bytes_per_param`` times
``params`` (the trained parameters the rank's stage holds; ZeRO-3: the whole model's) predicts;
``buckets`` are ZeRO's fixed-size reduce buckets and ``other`` the rest the engine reaches
(module buffers, the pipeline's micro-batch buffers), neither in ``total``. Under ZeRO-3 the
first two steps also have, per rank, ``zero3_gathered_peak_bytes``: the most bytes of split
weights gathered whole at once in the step (``vlmshard.train.engine_memory.GatheredWeights``;
the second step is the steady one), which pipeline.json's ``zero3_gathered`` bounds.

``pipeline.json`` says what the stages held, each stage's predicted peak memory by part at the
caps, and where that partition came from (``{"model", "partition_source",
"memory_budget_bytes", "stages": [{"stage", "layers", "recompute", "memory": {"params",
"activations", "rebuilt", "transient", "predicted_peak_bytes"}}]}``; under ZeRO-3 the memory
also has what it holds whatever the layers, ``zero3_reduce_bucket``, ``zero3_gathered``,
``zero3_gradient`` and ``zero3_persistent``: ``model_sizes.zero3_fixed_bytes``): what a
replay of the run (``vlmshard.simulate.replay``) needs besides the log.
"""

from __future__ import annotations

import json
from typing import Iterable

from vlmshard.errors import InputError

LOG_NAME = "train_log.jsonl"
PIPELINE_NAME = "pipeline.json"


class TrainLogError(InputError):
    """A train log that cannot be read; the message names the file and line."""


def parse_log(lines: Iterable[str], name: str) -> list[tuple[int, dict]]:
    """(line number, record) of each non-blank line of a train log; ``name`` is its path in
    errors."""
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainLogError(f"{name} line {number}: not JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise TrainLogError(f"{name} line {number}: not a train_log record (a JSON object)")
        records.append((number, record))
    if not records:
        raise TrainLogError(f"{name}: no training steps in it")
    return records


def read_numbered(path: str) -> list[tuple[int, dict]]:
    """(line number, record) of each step in the train log file ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_log(f, path)
    except UnicodeDecodeError as e:
        raise TrainLogError(f"{path}: not UTF-8 text ({e.reason})") from e


def read_log(path: str) -> list[dict]:
    """The records of a ``train_log.jsonl``, one per step."""
    return [record for _, record in read_numbered(path)]


def stage_bounds(stages: list[dict]) -> list[int]:
    """The stage bounds (layer indices, one more than stages) that ``pipeline.json``'s stages
    describe."""
    bounds = [0]
    for stage in stages:
        bounds.append(bounds[-1] + len(stage["layers"]))
    return bounds
