"""Input discovery and row access. Each input path becomes sources by the container kind that
claims it (``containers``: JSON, JSONL, Parquet, Arrow, ``datasets.save_to_disk`` and
``DatasetDict`` folders, InternVL meta files, LLaMA-Factory's ``dataset_info.json``, and any a
user registers); each source's rows are indexed and read by its kind's ``RowReader``.

The driver indexes each source once (row count; the byte span of every row of a JSONL file or
JSON list) and splits the selected rows into fixed-size parts, each carrying its rows' spans. Parts
depend only on the inputs and ``part_size``, never on the engine or worker count, which is what
makes the output byte-identical however it is run.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from vlmshard.errors import InputError
from vlmshard.io import file_exists
from vlmshard.rejects import Reject

from .containers import Part, Source, SourceIndex, SourceOptions
from .registry import reader, sources_of
from .conversation import RowFormat

__all__ = ["Part", "Source", "SourceIndex", "discover_sources", "first_record", "index_source",
           "plan_parts", "read_part_rows", "select_rows"]


def discover_sources(inputs: list[str], image_root: str | None = None,
                     row_format: RowFormat = RowFormat(), split: str | None = None,
                     datasets: list[str] | None = None) -> list[Source]:
    """Expand the command-line inputs into sources, in order (meta files in their key order, or
    the entries ``datasets`` names, in its order). ``row_format`` and ``split`` apply to every
    input but a meta file's entries, which give their own (``format``, ``columns``, ``roles``,
    ``split``)."""
    sources: list[Source] = []
    for path in inputs:
        if not file_exists(path):
            raise InputError(f"input not found: {path}")
        sources += sources_of(path, SourceOptions(
            name=None, image_root=image_root, format=row_format, split=split,
            datasets=tuple(datasets) if datasets else None))
    missing = [d for d in datasets or () if d not in {s.name for s in sources}]
    if missing:
        raise InputError(f"--datasets {', '.join(missing)}: no such entry in the meta files "
                         f"given ({', '.join(inputs)}); their entries are the files' keys")
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"several inputs are named {', '.join(duplicates)}; rename them or list "
                         "them in a meta file with distinct keys")
    return sources


def index_source(source: Source) -> SourceIndex:
    """The source's row count (and byte spans where its kind has them)."""
    return reader(source.kind).index(source)


def read_part_rows(source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
    """Yield (row number, record) for each row of the part; a bad row yields a ``Reject``."""
    return reader(source.kind).read_rows(source, part)


def first_record(source: Source, index: SourceIndex) -> dict | None:
    """The source's first row, or None if it has none or it is not a JSON object."""
    if index.n_rows == 0 or index.unreadable:
        return None
    part = index.spans(Part(index=-1, source_index=0, rows=np.zeros(1, np.int64)))
    record = next(read_part_rows(source, part))[1]
    return None if isinstance(record, Reject) else record


def select_rows(n_rows: int, repeat_time: float, seed: int, name: str) -> np.ndarray:
    """Row numbers after InternVL's ``repeat_time``: whole repeats, then a fractional subsample.

    The subsample is a seeded choice kept in file order, so it is the same on every run.
    """
    whole = int(repeat_time)
    frac = repeat_time - whole
    chunks = [np.arange(n_rows, dtype=np.int64)] * whole
    k = round(n_rows * frac)
    if k:
        name_key = int.from_bytes(name.encode("utf-8")[:8].ljust(8, b"\0"), "little")
        rng = np.random.default_rng([seed, name_key])
        chunks.append(np.sort(rng.choice(n_rows, size=k, replace=False)).astype(np.int64))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


def plan_parts(sources: list[Source], indexes: list[SourceIndex], part_size: int,
               seed: int) -> list[Part]:
    parts: list[Part] = []
    for si, (source, index) in enumerate(zip(sources, indexes)):
        rows = select_rows(index.n_rows, source.repeat_time if not index.unreadable else 1.0,
                           seed, source.name)
        for start in range(0, len(rows), part_size):
            chunk = rows[start:start + part_size]
            parts.append(index.spans(Part(index=len(parts), source_index=si, rows=chunk)))
    return parts
