"""Input discovery and row access: conversation files, InternVL meta files, Parquet, HF datasets.

The driver indexes each source once (row count; line offsets for JSONL) and splits the selected
rows into fixed-size parts. Parts depend only on the inputs and ``part_size``, never on the engine
or worker count, which is what makes the output byte-identical however it is run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

import numpy as np

from vlmshard.io import file_exists, is_url, open_file

from .rejects import Reject


@dataclass(frozen=True)
class Source:
    """One annotation file (or saved dataset) and where its images live."""

    name: str
    kind: str  # "jsonl" | "json" | "parquet" | "hf_dataset"
    path: str
    image_root: str
    repeat_time: float = 1.0
    max_num: int | None = None  # InternVL meta's per-source max_dynamic_patch

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": self.path,
                "image_root": self.image_root, "repeat_time": self.repeat_time,
                "max_num": self.max_num}


@dataclass
class Part:
    """A unit of work: some rows of one source, processed and committed together."""

    index: int
    source_index: int
    rows: np.ndarray  # row numbers within the source file, ascending per repeat
    offsets: np.ndarray | None = None  # JSONL: byte offset of each row's line
    lengths: np.ndarray | None = None  # JSONL: byte length of each row's line


@dataclass
class SourceIndex:
    n_rows: int
    offsets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    unreadable: str | None = None  # why the whole file could not be parsed


class InputError(ValueError):
    """An input that cannot be used at all (missing path, unknown format)."""


def _stem(path: str) -> str:
    base = os.path.basename(path.rstrip("/"))
    for ext in (".jsonl", ".json", ".parquet"):
        if base.endswith(ext):
            return base[: -len(ext)]
    return base


def _kind_of(path: str) -> str:
    if not is_url(path) and os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            raise InputError(f"{path} is a DatasetDict; pass one split folder, e.g. {path}/train")
        if os.path.exists(os.path.join(path, "state.json")):
            return "hf_dataset"
        raise InputError(f"{path} is a folder but not a dataset saved with datasets.save_to_disk")
    for ext, kind in ((".jsonl", "jsonl"), (".json", "json"), (".parquet", "parquet")):
        if path.endswith(ext):
            return kind
    raise InputError(f"cannot tell the format of {path}: use .json, .jsonl, .parquet, "
                     "an InternVL meta .json, or a saved datasets folder")


def discover_sources(inputs: list[str], image_root: str | None = None) -> list[Source]:
    """Expand the command-line inputs into sources, in order (meta files in their key order)."""
    sources: list[Source] = []
    for path in inputs:
        if not file_exists(path):
            raise InputError(f"input not found: {path}")
        kind = _kind_of(path)
        meta = _read_meta(path) if kind == "json" else None
        if meta is not None:
            sources.extend(_meta_sources(path, meta))
            continue
        root = image_root or (os.path.dirname(path) if not is_url(path)
                              else path.rsplit("/", 1)[0])
        root = root if is_url(root) else os.path.abspath(root)
        sources.append(Source(name=_stem(path), kind=kind, path=path, image_root=root))
    names = [s.name for s in sources]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"several inputs are named {', '.join(duplicates)}; rename them or list "
                         "them in a meta file with distinct keys")
    return sources


def _read_meta(path: str) -> dict | None:
    """The parsed meta file if ``path`` is an InternVL-style meta JSON (an object), else None."""
    with open_file(path) as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"{"):
        return None
    with open_file(path) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is neither a conversation list nor a valid meta file: {e}")
    bad = [k for k, v in meta.items() if not isinstance(v, dict) or "annotation" not in v]
    if bad:
        raise InputError(f"meta file {path}: entries {bad[:3]} lack an 'annotation' path "
                         '(expected {name: {"root": dir, "annotation": file, "repeat_time": 1}})')
    return meta


def _meta_sources(meta_path: str, meta: dict) -> list[Source]:
    base = os.path.dirname(meta_path)

    def rel(p: str) -> str:
        return p if is_url(p) or os.path.isabs(p) else os.path.normpath(os.path.join(base, p))

    sources = []
    for name, entry in meta.items():
        annotation = rel(entry["annotation"])
        if not file_exists(annotation):
            raise InputError(f"meta file {meta_path}: annotation of {name!r} not found: {annotation}")
        repeat = float(entry.get("repeat_time", 1.0))
        if repeat <= 0:
            raise InputError(f"meta file {meta_path}: repeat_time of {name!r} must be > 0")
        root = rel(entry.get("root", os.path.dirname(annotation)))
        root = root if is_url(root) else os.path.abspath(root)
        max_num = entry.get("max_dynamic_patch")
        sources.append(Source(name=name, kind=_kind_of(annotation), path=annotation,
                              image_root=root, repeat_time=repeat,
                              max_num=int(max_num) if max_num is not None else None))
    return sources


# ---------------------------------------------------------------------------------------------
# Indexing (driver side)


def index_source(source: Source) -> SourceIndex:
    if source.kind == "jsonl":
        offsets, lengths = _jsonl_line_index(source.path)
        return SourceIndex(n_rows=len(offsets), offsets=offsets, lengths=lengths)
    if source.kind == "json":
        try:
            rows = _load_json_list(source.path)
        except Reject as r:
            return SourceIndex(n_rows=1, unreadable=r.message)
        return SourceIndex(n_rows=len(rows))
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        with open_file(source.path) as f:
            return SourceIndex(n_rows=pq.ParquetFile(f).metadata.num_rows)
    if source.kind == "hf_dataset":
        return SourceIndex(n_rows=len(_load_hf_dataset(source.path)))
    raise AssertionError(source.kind)


def _jsonl_line_index(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and length of every non-blank line. Local files are memory-mapped, so a
    file far larger than RAM is scanned without being read into the driver's memory."""
    import mmap

    with open_file(path) as f:
        if is_url(path):
            data = f.read()
        else:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        offsets: list[int] = []
        lengths: list[int] = []
        find, end, pos = data.find, len(data), 0
        while pos < end:
            nl = find(b"\n", pos)
            nl = end if nl < 0 else nl
            # Blank lines are not rows; only lines starting with whitespace need a closer look.
            if nl > pos and (data[pos] not in b" \t\r" or data[pos:nl].strip()):
                offsets.append(pos)
                lengths.append(nl - pos)
            pos = nl + 1
        if isinstance(data, mmap.mmap):
            data.close()
    return np.array(offsets, dtype=np.int64), np.array(lengths, dtype=np.int64)


def select_rows(n_rows: int, repeat_time: float, seed: int, name: str) -> np.ndarray:
    """Row numbers after InternVL's ``repeat_time``: whole repeats, then a fractional subsample.

    The subsample is a seeded choice kept in file order, so it is the same on every run.
    """
    whole = int(repeat_time)
    frac = repeat_time - whole
    chunks = [np.arange(n_rows, dtype=np.int64)] * whole
    k = int(round(n_rows * frac))
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
            part = Part(index=len(parts), source_index=si, rows=chunk)
            if index.offsets is not None:
                part.offsets, part.lengths = index.offsets[chunk], index.lengths[chunk]
            parts.append(part)
    return parts


# ---------------------------------------------------------------------------------------------
# Reading rows (worker side)


def read_part_rows(source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
    """Yield (row number, record) for each row of the part; a bad row yields a ``Reject``."""
    if source.kind == "jsonl":
        yield from _jsonl_rows(source.path, part)
    elif source.kind == "json":
        try:
            rows = _load_json_list(source.path)
        except Reject as r:
            yield int(part.rows[0]), r
            return
        for row in part.rows:
            yield int(row), _as_record(rows[row])
    elif source.kind == "parquet":
        table = _load_parquet(source.path)
        for row, rec in zip(part.rows, table.take(part.rows).to_pylist()):
            yield int(row), _as_record(rec)
    elif source.kind == "hf_dataset":
        ds = _load_hf_dataset(source.path)
        for row, rec in zip(part.rows, ds.select(part.rows.tolist()).to_list()):
            yield int(row), _as_record(rec)
    else:
        raise AssertionError(source.kind)


def _jsonl_rows(path: str, part: Part) -> Iterator[tuple[int, dict | Reject]]:
    lo = int(part.offsets.min())
    hi = int((part.offsets + part.lengths).max())
    with open_file(path) as f:
        f.seek(lo)
        span = f.read(hi - lo)
    for row, off, n in zip(part.rows, part.offsets, part.lengths):
        line = span[off - lo: off - lo + n]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield int(row), Reject("undecodable_text", f"line is not UTF-8: {e}")
            continue
        try:
            yield int(row), _as_record(json.loads(text))
        except json.JSONDecodeError as e:
            yield int(row), Reject("malformed_json", f"invalid JSON: {e}")


def _as_record(value: Any) -> dict | Reject:
    if isinstance(value, dict):
        return value
    return Reject("malformed_json", f"row is a {type(value).__name__}, not a JSON object")


@lru_cache(maxsize=1)
def _load_json_list(path: str) -> list:
    """A JSON-list file, parsed once per process (lone surrogates survive to be rejected per row)."""
    with open_file(path) as f:
        text = f.read().decode("utf-8", errors="surrogateescape")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise Reject("unreadable_source", f"{path} is not valid JSON: {e}") from None
    if not isinstance(rows, list):
        raise Reject("unreadable_source", f"{path} holds a JSON {type(rows).__name__}, not a list")
    return rows


@lru_cache(maxsize=1)
def _load_parquet(path: str):
    import pyarrow.parquet as pq

    with open_file(path) as f:
        return pq.read_table(f)


@lru_cache(maxsize=1)
def _load_hf_dataset(path: str):
    import datasets

    return datasets.load_from_disk(path)
