"""Reading a training run's log: ``train_log.jsonl``, one JSON line per optimizer step (written
by global rank 0 through ``vlmshard.train.train_log``), and ``pipeline.json`` beside it.

Kept below the stages and free of torch, so that the simulator and the report read a run
without importing the trainer. Every field of both files, and what it means: docs/training.md,
"The run's log: train_log.jsonl and pipeline.json".
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
