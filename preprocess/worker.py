"""Processing one part: read its rows, turn each into a stats row or a reject, commit atomically.

A part is committed when its summary JSON exists and the two Parquet files, renamed into place
before it, still have the size and sha256 it records. A rerun skips committed parts, so a killed
job resumes where it stopped; a part file torn or changed behind the job's back is done again.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from vlmshard.io import atomic_write, read_json, sha256_file, write_json_atomic, write_parquet
from vlmshard.rejects import Reject

from .sample import SampleProcessor, SampleSpec
from .schema import REJECTS_SCHEMA, stats_schema
from .sources import Part, read_part_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSpec:
    """Everything a worker needs, picklable so it ships to pool processes and Ray actors."""

    samples: SampleSpec
    keep_tokens: bool
    parts_dir: str


def part_paths(parts_dir: str, index: int) -> tuple[str, str, str]:
    stem = os.path.join(parts_dir, f"part-{index:06d}")
    return f"{stem}.stats.parquet", f"{stem}.rejects.parquet", f"{stem}.json"


def committed_summary(parts_dir: str, index: int) -> dict | None:
    """The part's summary if it is committed and its files are as committed, else None."""
    stats_path, rejects_path, summary_path = part_paths(parts_dir, index)
    if not os.path.exists(summary_path):
        return None
    summary = read_json(summary_path)
    if summary.get("files") != {"stats": _file_record(stats_path),
                                "rejects": _file_record(rejects_path)}:
        log.warning("part %d: its files differ from what was committed; processing it again",
                    index)
        return None
    return summary


def _file_record(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


class PartWorker:
    """Holds the per-process state (tokenizer, tiling) and processes parts one at a time."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.samples = SampleProcessor(spec.samples)

    def process(self, part: Part) -> dict:
        """Process and commit ``part``; returns its summary (counts per reason)."""
        spec = self.spec
        source = spec.samples.sources[part.source_index]
        schema = stats_schema(spec.keep_tokens, with_sample_id=False)
        columns: dict[str, list] = {name: [] for name in schema.names}
        rejects: dict[str, list] = {name: [] for name in REJECTS_SCHEMA.names}
        for row, record in read_part_rows(source, part):
            try:
                stats = self.samples.process(part.source_index, record, spec.keep_tokens)
            except Reject as r:
                for name, value in zip(REJECTS_SCHEMA.names,
                                       (source.name, row, r.reason, r.message)):
                    rejects[name].append(value)
                continue
            stats["row"] = row
            for name in schema.names:
                columns[name].append(stats[name])
        stats_path, rejects_path, summary_path = part_paths(spec.parts_dir, part.index)
        atomic_write(stats_path, lambda tmp: write_parquet(pa.table(columns, schema=schema), tmp))
        atomic_write(rejects_path,
                     lambda tmp: write_parquet(pa.table(rejects, schema=REJECTS_SCHEMA), tmp))
        summary = {
            "part": part.index,
            "source": source.name,
            "rows": len(part.rows),
            "accepted": len(columns["row"]),
            "rejected": dict(Counter(rejects["reason"])),
            "seq_len": sum(columns["seq_len"]),
            "vit_tiles": sum(columns["vit_tiles"]),
            "images": sum(columns["n_images"]),
            "files": {"stats": _file_record(stats_path), "rejects": _file_record(rejects_path)},
        }
        write_json_atomic(summary_path, summary)
        return summary
