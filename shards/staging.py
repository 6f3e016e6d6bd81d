"""What the shard workers take from the sources, staged first: each row read once, in source order.

Two things come from the source rows rather than the stats table: the images a row embeds
(``embedded:`` in ``image_paths``), and the token ids when preprocessing did not keep them (no
``--keep-tokens``). A shard holds samples from all over a source, so a shard worker that read its
samples' rows itself would decode a Parquet row group (~100 rows and their images) for every
sample it wants, and every shard would decode most row groups again: up to ~100 times the
source's bytes. Instead the write job first reads those rows in source order, once per sample
(a row group is read by the unit holding its rows, or the two at a unit boundary; a row that
``repeat_time`` repeats is read per repeat), re-tokenizes them and copies their embedded
images' bytes, unchanged, into uncompressed Arrow files under ``_work/staged/`` that the shard
workers memory-map, as they do the sample table. The files go with ``_work`` when the job
finishes; a rerun keeps the units already staged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vlmshard.io import atomic_write
from vlmshard.preprocess import EMBEDDED, Retokenizer, SampleSpec, SourceRows

UNIT_BYTES = 256 << 20  # embedded image bytes one unit reads and holds
UNIT_SAMPLES = 8192
SCHEMA = pa.schema([
    pa.field("sample_id", pa.int64()),
    pa.field("images", pa.list_(pa.binary())),  # null: no embedded image; a null item: a file
    # per video, per file it reads (container or frames); null: nothing embedded; null item: a file
    pa.field("videos", pa.list_(pa.list_(pa.binary()))),
    pa.field("input_ids", pa.list_(pa.int32())),  # null when the stats keep the tokens
    pa.field("labels", pa.list_(pa.int32())),
])
ROW_COLUMNS = ["sample_id", "source", "row", "seq_len", "image_tiles", "image_paths", "videos"]


@dataclass(frozen=True)
class StageSpec:
    """What a staging worker needs, picklable for pool processes and Ray actors."""

    folder: str
    samples_path: str  # the write job's memory-mappable sample table (row = sample_id)
    samples: SampleSpec  # the run's sources, tokenizer and limits
    tokens: bool  # re-tokenize (the stats did not keep the ids)


@dataclass(frozen=True)
class StageUnit:
    """Consecutive samples to stage, in sample order."""

    index: int
    sample_ids: np.ndarray  # int64


def unit_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"unit-{index:06d}.arrow")


def plan_units(table: pa.Table, tokens: bool) -> list[StageUnit]:
    """The samples of ``table`` (sample table rows, in sample order) that need their source
    rows: every one when re-tokenizing, else those that embed images; cut into units of about
    ``UNIT_SAMPLES`` samples or ``UNIT_BYTES`` of embedded images (by the stats'
    ``image_bytes``), whichever comes first. Columnar: no Python object per sample."""
    paths = table["image_paths"].combine_chunks()
    embedded = pc.starts_with(pc.list_flatten(paths), EMBEDDED).to_numpy(zero_copy_only=False)
    owner = pc.list_parent_indices(paths).to_numpy()[embedded]
    sizes = (pc.list_flatten(table["image_bytes"].combine_chunks()).to_numpy()[embedded]
             if "image_bytes" in table.column_names else np.zeros(len(owner)))
    if "videos" in table.column_names:  # each video file's row and size
        videos = table["videos"].combine_chunks()
        flat = pc.list_flatten(videos)
        files = flat.field("paths")
        in_row = pc.list_parent_indices(videos).to_numpy()[pc.list_parent_indices(files)]
        video_embedded = pc.starts_with(pc.list_flatten(files), EMBEDDED).to_numpy(
            zero_copy_only=False)
        owner = np.concatenate([owner, in_row[video_embedded]])
        sizes = np.concatenate([sizes, pc.list_flatten(flat.field("bytes")).to_numpy()[
            video_embedded]])
    n = table.num_rows
    has_embedded = np.bincount(owner, minlength=n) > 0
    keep = np.ones(n, bool) if tokens else has_embedded
    ids = table["sample_id"].to_numpy()[keep]
    bytes_kept = np.bincount(owner, weights=sizes, minlength=n)[keep]
    # Non-decreasing unit numbers: by bytes so far or by count so far, whichever is further.
    unit = np.maximum((np.cumsum(bytes_kept) - bytes_kept) // UNIT_BYTES,
                      np.arange(len(ids)) // UNIT_SAMPLES).astype(np.int64)
    starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]]) if len(ids) else []
    bounds = list(starts) + [len(ids)]
    return [StageUnit(k, ids[a:b]) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


class Stager:
    """Reads a unit's rows back from their sources once; writes their tokens and images."""

    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.table = pa.ipc.open_file(pa.memory_map(spec.samples_path)).read_all()
        self.rows = SourceRows(spec.samples.sources)
        self.retokenizer = Retokenizer(spec.samples) if spec.tokens else None

    def process(self, unit: StageUnit) -> dict:
        """Stage one unit; raises ``RetokenizeError`` naming a row that no longer reads."""
        columns = [c for c in ROW_COLUMNS if c in self.table.column_names]  # older stats: no videos
        rows = self.table.select(columns).take(pa.array(unit.sample_ids)).to_pylist()
        records = self.rows.records((r["source"], r["row"]) for r in rows)
        columns: dict[str, list] = {name: [] for name in SCHEMA.names}
        for row in rows:
            record = records[(row["source"], row["row"])]
            files = [*row["image_paths"], *(p for v in row.get("videos") or [] for p in v["paths"])]
            embeds = any(p.startswith(EMBEDDED) for p in files)
            ids, labels = self.retokenizer.encode(row, record) if self.retokenizer else (None,
                                                                                       None)
            images, videos = (self.rows.embedded_media(row["source"], row["row"], record)
                              if embeds else (None, None))
            columns["sample_id"].append(row["sample_id"])
            columns["images"].append(images)
            columns["videos"].append(videos)
            columns["input_ids"].append(ids)
            columns["labels"].append(labels)
        table = pa.table(columns, schema=SCHEMA)

        def write(tmp: str) -> None:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
                writer.write_table(table)

        atomic_write(unit_path(self.spec.folder, unit.index), write)
        return {"unit": unit.index, "samples": len(rows)}


class StagedRows:
    """The staged samples, memory-mapped: nothing is read until a record asks for them."""

    def __init__(self, folder: str, units: int) -> None:
        self.units = [pa.ipc.open_file(pa.memory_map(unit_path(folder, k))).read_all()
                      for k in range(units)]
        self.ids = [t["sample_id"].to_numpy() for t in self.units]  # ascending, unit by unit
        self.first = np.array([ids[0] for ids in self.ids], np.int64)

    def get(self, sample_id: int) -> dict | None:
        """The sample's staged ``images``, ``videos``, ``input_ids`` and ``labels`` (None where
        not staged),
        or None if the sample was not staged."""
        u = int(np.searchsorted(self.first, sample_id, side="right")) - 1
        if u < 0:
            return None
        k = int(np.searchsorted(self.ids[u], sample_id))
        if k == len(self.ids[u]) or self.ids[u][k] != sample_id:
            return None
        return self.units[u].slice(k, 1).to_pylist()[0]
