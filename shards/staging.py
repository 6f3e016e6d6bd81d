"""What the shard workers take from the sources, staged first: each row read once, in source order.

Two things come from the source rows rather than the stats table: the images a row embeds
(``embedded:`` in ``image_paths``), and the token ids when preprocessing did not keep them (no
``--keep-tokens``). A shard holds samples from all over a source, so a shard worker that read its
samples' rows itself would decode a Parquet row group (~100 rows and their images) for every
sample it wants, and every shard would decode most row groups again: up to ~100 times the
source's bytes. Instead the write job first reads those rows once, in source order (a row group
is read by the one unit holding its rows), re-tokenizes them and copies their embedded images'
bytes, unchanged, into uncompressed Arrow files under ``_work/staged/`` that the shard workers
memory-map, as they do the sample table. The files go with ``_work`` when the job finishes; a
rerun keeps the units already staged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from vlmshard.io import atomic_write
from vlmshard.preprocess import EMBEDDED, Retokenizer, SampleSpec, SourceRows

UNIT_BYTES = 256 << 20  # embedded image bytes one unit reads and holds
UNIT_SAMPLES = 8192
SCHEMA = pa.schema([
    pa.field("sample_id", pa.int64()),
    pa.field("images", pa.list_(pa.binary())),  # null: no embedded image; a null item: a file
    pa.field("input_ids", pa.list_(pa.int32())),  # null when the stats keep the tokens
    pa.field("labels", pa.list_(pa.int32())),
])
ROW_COLUMNS = ["sample_id", "source", "row", "seq_len", "image_tiles", "image_paths"]


@dataclass(frozen=True)
class StageSpec:
    """What a staging worker needs, picklable for pool processes and Ray actors."""

    folder: str
    samples: SampleSpec  # the run's sources, tokenizer and limits
    tokens: bool  # re-tokenize (the stats did not keep the ids)


@dataclass(frozen=True)
class StageUnit:
    """Consecutive samples (stats rows with ``ROW_COLUMNS``), in sample order."""

    index: int
    rows: tuple[dict, ...]


def unit_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"unit-{index:06d}.arrow")


def plan_units(table: pa.Table, tokens: bool) -> list[StageUnit]:
    """The samples of ``table`` (in sample order) that need their source rows: every one when
    re-tokenizing, else those that embed images; cut into units of at most ``UNIT_SAMPLES``
    samples and ``UNIT_BYTES`` of embedded images (by the stats' ``image_bytes``)."""
    rows = table.select(ROW_COLUMNS).to_pylist()
    sizes = (table["image_bytes"].to_pylist() if "image_bytes" in table.column_names
             else [[0] * len(r["image_paths"]) for r in rows])
    units, current, total = [], [], 0
    for row, row_sizes in zip(rows, sizes):
        size = sum(s for p, s in zip(row["image_paths"], row_sizes) if p.startswith(EMBEDDED))
        if not (tokens or any(p.startswith(EMBEDDED) for p in row["image_paths"])):
            continue
        if current and (total + size > UNIT_BYTES or len(current) == UNIT_SAMPLES):
            units.append(StageUnit(len(units), tuple(current)))
            current, total = [], 0
        current.append(row)
        total += size
    return units + ([StageUnit(len(units), tuple(current))] if current else [])


class Stager:
    """Reads a unit's rows back from their sources once; writes their tokens and images."""

    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.rows = SourceRows(spec.samples.sources)
        self.retokenizer = Retokenizer(spec.samples) if spec.tokens else None

    def process(self, unit: StageUnit) -> dict:
        """Stage one unit; raises ``RetokenizeError`` naming a row that no longer reads."""
        records = self.rows.records((r["source"], r["row"]) for r in unit.rows)
        columns: dict[str, list] = {name: [] for name in SCHEMA.names}
        for row in unit.rows:
            record = records[(row["source"], row["row"])]
            embeds = any(p.startswith(EMBEDDED) for p in row["image_paths"])
            ids, labels = self.retokenizer.encode(row, record) if self.retokenizer else (None,
                                                                                       None)
            columns["sample_id"].append(row["sample_id"])
            columns["images"].append(self.rows.embedded_images(row["source"], row["row"], record)
                                     if embeds else None)
            columns["input_ids"].append(ids)
            columns["labels"].append(labels)
        table = pa.table(columns, schema=SCHEMA)

        def write(tmp: str) -> None:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
                writer.write_table(table)

        atomic_write(unit_path(self.spec.folder, unit.index), write)
        return {"unit": unit.index, "samples": len(unit.rows)}


class StagedRows:
    """The staged samples, memory-mapped: nothing is read until a record asks for them."""

    def __init__(self, folder: str, units: int) -> None:
        tables = [pa.ipc.open_file(pa.memory_map(unit_path(folder, k))).read_all()
                  for k in range(units)]
        self.table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
        self.ids = self.table["sample_id"].to_numpy()  # ascending: units follow sample order

    def get(self, sample_id: int) -> dict | None:
        """The sample's staged ``images``, ``input_ids`` and ``labels`` (None where not staged),
        or None if the sample was not staged."""
        k = int(np.searchsorted(self.ids, sample_id))
        if k == len(self.ids) or self.ids[k] != sample_id:
            return None
        return self.table.slice(k, 1).to_pylist()[0]
