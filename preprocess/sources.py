"""Input discovery and row access: conversation files (JSON, JSONL), InternVL meta files, Parquet,
Arrow, and ``datasets.save_to_disk`` folders (a ``DatasetDict``'s split chosen with ``split``).

The driver indexes each source once (row count; the byte span of every row of a JSONL file or
JSON list) and splits the selected rows into fixed-size parts, each carrying its rows' spans. Parts
depend only on the inputs and ``part_size``, never on the engine or worker count, which is what
makes the output byte-identical however it is run.

A worker's memory is bounded by its part, not by the source: it reads only its rows' bytes (JSONL,
JSON list) or the Parquet row groups holding its rows, one batch at a time.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from vlmshard.errors import InputError
from vlmshard.io import file_exists, is_url, open_file, read_json, resolve
from vlmshard.rejects import Reject

from .conversation import RowFormat


@dataclass(frozen=True)
class Source:
    """One annotation file (or saved dataset) and where its images live."""

    name: str
    kind: str  # "jsonl" | "json" | "parquet" | "arrow" | "hf_dataset"
    path: str
    image_root: str
    repeat_time: float = 1.0
    max_num: int | None = None  # InternVL meta's per-source max_dynamic_patch
    format: RowFormat = RowFormat()

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": self.path,
                "image_root": self.image_root, "repeat_time": self.repeat_time,
                "max_num": self.max_num, "format": self.format.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Source:
        """The source a run recorded (runs before formats existed read LLaVA rows: ``auto``)."""
        return cls(name=d["name"], kind=d["kind"], path=d["path"], image_root=d["image_root"],
                   repeat_time=d["repeat_time"], max_num=d["max_num"],
                   format=RowFormat.from_dict(d["format"]) if "format" in d else RowFormat())


@dataclass
class Part:
    """A unit of work: some rows of one source, processed and committed together."""

    index: int
    source_index: int
    rows: np.ndarray  # row numbers within the source file, ascending per repeat
    offsets: np.ndarray | None = None  # JSONL, JSON list: byte offset of each row's text
    lengths: np.ndarray | None = None  # JSONL, JSON list: byte length of each row's text
    unreadable: str | None = None  # JSON list: why the whole file could not be parsed


@dataclass
class SourceIndex:
    n_rows: int
    offsets: np.ndarray | None = None
    lengths: np.ndarray | None = None
    unreadable: str | None = None  # why the whole file could not be parsed

    def spans(self, part: Part) -> Part:
        """``part`` with its rows' byte spans (or the reason the file is unreadable) attached."""
        if self.offsets is None:
            return replace(part, unreadable=self.unreadable)
        return replace(part, offsets=self.offsets[part.rows], lengths=self.lengths[part.rows])


_EXTENSIONS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _stem(path: str) -> str:
    base = os.path.basename(path.rstrip("/"))
    for ext in _EXTENSIONS:
        if base.endswith(ext):
            return base[: -len(ext)]
    return base


def _kind_of(path: str, split: str | None = None) -> tuple[str, str]:
    """(kind, path): a ``DatasetDict`` folder becomes its split's folder."""
    if not is_url(path) and os.path.isdir(path):
        splits_file = os.path.join(path, "dataset_dict.json")
        if os.path.exists(splits_file):
            splits = read_json(splits_file).get("splits", [])
            if split is None and len(splits) == 1:
                split = splits[0]
            if split is None or split not in splits:
                what = f"has no split {split!r}" if split else "holds several splits"
                raise InputError(f"{path} is a DatasetDict that {what}: pass --split (or "
                                 f"'split' in a meta file), one of {', '.join(splits)}")
            path = os.path.join(path, split)
        if os.path.exists(os.path.join(path, "state.json")):
            return "hf_dataset", path
        raise InputError(f"{path} is a folder but not a dataset saved with datasets.save_to_disk")
    for ext, kind in _EXTENSIONS.items():
        if path.endswith(ext):
            return kind, path
    raise InputError(f"cannot tell the format of {path}: use .json, .jsonl, .parquet, .arrow, "
                     "an InternVL meta .json, or a saved datasets folder")


def discover_sources(inputs: list[str], image_root: str | None = None,
                     row_format: RowFormat = RowFormat(), split: str | None = None
                     ) -> list[Source]:
    """Expand the command-line inputs into sources, in order (meta files in their key order).
    ``row_format`` and ``split`` apply to every input but a meta file's entries, which give their
    own (``format``, ``columns``, ``roles``, ``split``)."""
    sources: list[Source] = []
    for path in inputs:
        if not file_exists(path):
            raise InputError(f"input not found: {path}")
        kind, data_path = _kind_of(path, split)
        meta = _read_meta(path) if kind == "json" else None
        if meta is not None:
            sources.extend(_meta_sources(path, meta))
            continue
        root = image_root or (os.path.dirname(path) if not is_url(path)
                              else path.rsplit("/", 1)[0])
        root = root if is_url(root) else os.path.abspath(root)
        sources.append(Source(name=_stem(path), kind=kind, path=data_path, image_root=root,
                              format=row_format))
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
        return resolve(base, p)

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
        kind, annotation = _kind_of(annotation, entry.get("split"))
        try:
            row_format = RowFormat.from_options(entry.get("format", "auto"),
                                                entry.get("columns"), entry.get("roles"))
        except ValueError as e:
            raise InputError(f"meta file {meta_path}: entry {name!r}: {e}") from None
        sources.append(Source(name=name, kind=kind, path=annotation,
                              image_root=root, repeat_time=repeat,
                              max_num=int(max_num) if max_num is not None else None,
                              format=row_format))
    return sources


# ---------------------------------------------------------------------------------------------
# Indexing (driver side)


def index_source(source: Source) -> SourceIndex:
    if source.kind == "jsonl":
        offsets, lengths = _jsonl_line_index(source.path)
        return SourceIndex(n_rows=len(offsets), offsets=offsets, lengths=lengths)
    if source.kind == "json":
        try:
            offsets, lengths = _json_list_index(source.path)
        except Reject as r:
            return SourceIndex(n_rows=1, unreadable=r.message)
        return SourceIndex(n_rows=len(offsets), offsets=offsets, lengths=lengths)
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        with open_file(source.path) as f:
            return SourceIndex(n_rows=pq.ParquetFile(f).metadata.num_rows)
    if source.kind in ("hf_dataset", "arrow"):
        return SourceIndex(n_rows=len(_load_dataset(source)))
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
        offsets, lengths = array("q"), array("q")
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
    return np.frombuffer(offsets, np.int64), np.frombuffer(lengths, np.int64)


_WINDOW = 1 << 20  # bytes of a JSON list held while indexing it; also the most one read spans
_GAP = 64 << 10  # rows further apart than this are read separately, not with the bytes between
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_SCALAR_END = re.compile(r"[ \t\n\r,\]}]")
# Strings (group 1 is the closing quote, empty when the text ends first) and brackets. The
# quantifiers are possessive: a backtracking one keeps state for every escape of a long string.
_STRUCTURE = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+("?)|[][{}]', re.DOTALL)


def _json_list_index(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Byte offset and length of every element of a JSON-list file, found in one streaming pass
    that parses each element (so a malformed file is rejected here, whole, as ``json.loads``
    would) while holding only a window of the file, never all of it."""
    offsets, lengths = array("q"), array("q")
    with open_file(path) as f:
        window = _JsonWindow(f, path)
        if f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8:
            raise window.error("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0)
        f.seek(0)
        char, pos = window.next_char(0)
        if char != "[":
            value, end = window.value(pos)
            window.expect_end(end)
            raise Reject("unreadable_source",
                         f"{path} holds a JSON {type(value).__name__}, not a list")
        char, pos = window.next_char(pos + 1)
        while char != "]":
            end = window.value(pos)[1]
            offsets.append(pos)
            lengths.append(end - pos)
            char, pos = window.next_char(end)
            if char == ",":
                pos = window.next_char(pos + 1)[1]
            elif char != "]":
                raise window.error("Expecting ',' delimiter", pos)
        window.expect_end(pos + 1)
    return np.frombuffer(offsets, np.int64), np.frombuffer(lengths, np.int64)


class _JsonWindow:
    """A sliding window over a JSON file, addressed by absolute byte position.

    The bytes are decoded as Latin-1, one character per byte, so string positions are byte
    offsets; JSON's structure is ASCII and any byte may sit inside a string, so the window parses
    exactly as the UTF-8 text does.
    """

    def __init__(self, f, path: str) -> None:
        self.f, self.path = f, path
        self.text, self.base, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _more(self, keep: int) -> bool:
        """Drop the text before ``keep`` and read on (at least doubling what is kept, so a long
        value is parsed a bounded number of times); False at the end of the file."""
        if self.eof:
            return False
        tail = self.text[keep - self.base:]
        data = self.f.read(max(_WINDOW, len(tail)))
        if not data:
            self.eof = True
            return False
        text = data.decode("latin-1")
        del data  # the bytes, and the old window below, freed before the new window is built
        self.text = ""
        self.text, self.base = tail + text, keep
        return True

    def next_char(self, pos: int) -> tuple[str, int]:
        """The first non-whitespace character at or after ``pos`` and its position ('' at EOF)."""
        while True:
            i = _WHITESPACE.match(self.text, pos - self.base).end()
            if i < len(self.text):
                return self.text[i], self.base + i
            pos = self.base + i
            if not self._more(pos):
                return "", pos

    def value(self, pos: int) -> tuple[Any, int]:
        """The JSON value starting at ``pos`` and where it ends, read on until it is whole."""
        while True:
            i = pos - self.base
            try:
                value, end = self.decoder.raw_decode(self.text, i)
            except json.JSONDecodeError as e:
                error = e.msg, self.base + e.pos  # not the exception: it holds the whole window
            else:
                # A number cut by the window parses short ("12" of "123"): make sure it ended.
                if (self.text[end - 1] in '"]}' or _SCALAR_END.search(self.text, end)
                        or not self._more(pos)):
                    return value, self.base + end
                continue
            # An error inside a value that ends in the window is real; else read on.
            if _ends_within(self.text, i) or not self._more(pos):
                raise self.error(*error)

    def expect_end(self, pos: int) -> None:
        """Nothing but whitespace may follow the top-level value."""
        char, pos = self.next_char(pos)
        if char:
            raise self.error("Extra data", pos)

    def error(self, message: str, pos: int) -> Reject:
        return Reject("unreadable_source",
                      f"{self.path} is not valid JSON: {message}: {_json_position(self.path, pos)}")


def _ends_within(text: str, i: int) -> bool:
    """Whether the value starting at ``text[i]`` ends inside ``text``, judged by its brackets and
    strings alone: for a valid value this is exact, so a parse error there is not a cut."""
    if i >= len(text):
        return False
    if text[i] not in '[{"':
        return _SCALAR_END.search(text, i) is not None
    depth = 0
    for m in _STRUCTURE.finditer(text, i):
        token = text[m.start()]
        if token == '"':
            if not m.group(1):
                return False
        elif token in "[{":
            depth += 1
        else:
            depth -= 1
        if depth <= 0:
            return True
    return False


def _json_position(path: str, pos: int) -> str:
    """``line L column C (char N)`` of byte ``pos``, counted in the decoded text as ``json``'s
    own messages count it; the file is read again up to ``pos``, only when there is an error."""
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    chars = lines = line_start = 0
    with open_file(path) as f:
        left = pos
        while left > 0:
            data = f.read(min(left, _WINDOW))
            if not data:
                break
            left -= len(data)
            text = decoder.decode(data, final=left <= 0)
            newline = text.rfind("\n")
            if newline >= 0:
                lines += text.count("\n")
                line_start = chars + newline + 1
            chars += len(text)
    return f"line {lines + 1} column {chars - line_start + 1} (char {chars})"


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


# ---------------------------------------------------------------------------------------------
# Reading rows (worker side)


def read_part_rows(source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
    """Yield (row number, record) for each row of the part; a bad row yields a ``Reject``."""
    if source.kind in ("jsonl", "json"):
        if part.offsets is None and part.unreadable is None:  # a part not made by plan_parts
            part = _cached_index(source).spans(part)
        if part.unreadable is not None:
            yield int(part.rows[0]), Reject("unreadable_source", part.unreadable)
            return
        # A JSON list keeps undecodable bytes (as lone surrogates) for the row's own checks.
        yield from _text_rows(source.path, part,
                              "strict" if source.kind == "jsonl" else "surrogateescape")
    elif source.kind == "parquet":
        yield from _parquet_rows(source.path, part.rows)
    elif source.kind in ("hf_dataset", "arrow"):
        # Memory-mapped Arrow: rows are taken without decoding (an Image value stays its
        # {bytes, path}); a batch at a time, so a part's images are not all held at once.
        import pyarrow as pa

        table = _load_dataset(source).data.table
        for start in range(0, len(part.rows), _PARQUET_BATCH):
            rows = part.rows[start:start + _PARQUET_BATCH]
            for row, rec in zip(rows, table.take(pa.array(rows, pa.int64())).to_pylist()):
                yield int(row), _as_record(rec)
    else:
        raise AssertionError(source.kind)


def first_record(source: Source, index: SourceIndex) -> dict | None:
    """The source's first row, or None if it has none or it is not a JSON object."""
    if index.n_rows == 0 or index.unreadable:
        return None
    part = index.spans(Part(index=-1, source_index=0, rows=np.zeros(1, np.int64)))
    record = next(read_part_rows(source, part))[1]
    return None if isinstance(record, Reject) else record


def _text_rows(path: str, part: Part, errors: str) -> Iterator[tuple[int, dict | Reject]]:
    """Each row parsed from its own bytes, read in runs of nearby rows (see ``_runs``)."""
    with open_file(path) as f:
        for run in _runs(part.offsets, part.lengths):
            lo = int(part.offsets[run.start])
            f.seek(lo)
            span = memoryview(f.read(int(part.offsets[run.stop - 1] + part.lengths[run.stop - 1])
                                     - lo))
            for row, off, n in zip(part.rows[run], part.offsets[run], part.lengths[run]):
                data = span[off - lo: off - lo + n]
                if off == 0 and data[:3] == codecs.BOM_UTF8:  # a UTF-8 file's byte-order mark
                    data = data[3:]
                if bytes(data).count(0) * 4 >= len(data) > 0:  # ASCII as UTF-16: NUL between
                    yield int(row), Reject("undecodable_text", "line looks like UTF-16 (NUL "
                                                               "bytes between characters), not "
                                                               "UTF-8")
                    continue
                try:
                    text = str(data, "utf-8", errors)
                except UnicodeDecodeError as e:
                    yield int(row), Reject("undecodable_text", f"line is not UTF-8: {e}")
                    continue
                try:
                    yield int(row), _as_record(json.loads(text))
                except (json.JSONDecodeError, RecursionError) as e:  # "[" * 10**5 recurses
                    yield int(row), Reject("malformed_json", f"invalid JSON: {e}")


def _runs(offsets: np.ndarray, lengths: np.ndarray) -> list[slice]:
    """Consecutive rows of a part, grouped so each group is one read: a group ends where the
    next row lies before it (a new repeat), more than ``_GAP`` bytes after it (a subsample), or
    past ``_WINDOW`` bytes from the group's start. So a part that wraps into the next repeat, or
    a sparse subsample, never reads the bytes between its rows."""
    runs, first = [], 0
    for i in range(1, len(offsets)):
        prev_end = offsets[i - 1] + lengths[i - 1]
        if (not 0 <= offsets[i] - prev_end <= _GAP
                or offsets[i] + lengths[i] - offsets[first] > _WINDOW):
            runs.append(slice(first, i))
            first = i
    runs.append(slice(first, len(offsets)))
    return runs


_PARQUET_BATCH = 1024  # rows decoded at a time


def _parquet_rows(path: str, rows: np.ndarray) -> Iterator[tuple[int, dict | Reject]]:
    """The rows, from the row groups that hold them only, decoded a batch at a time and stopping
    after the last row wanted from each group."""
    import pyarrow.parquet as pq

    with open_file(path) as f:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        # Ascending runs (a part may wrap into the next repeat); within one, groups ascend too.
        for run in np.split(rows, np.flatnonzero(np.diff(rows) <= 0) + 1):
            groups = np.searchsorted(starts, run, side="right") - 1
            for g in np.unique(groups):
                wanted = run[groups == g]
                records = _row_group_records(pf, int(g), wanted - starts[g])
                for row, rec in zip(wanted, records):
                    yield int(row), _as_record(rec)


def _row_group_records(pf, group: int, wanted: np.ndarray) -> Iterator[dict]:
    """The records at the ascending positions ``wanted`` of one row group."""
    pos = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group]):
        lo, hi = np.searchsorted(wanted, [pos, pos + batch.num_rows])
        if hi > lo:
            yield from batch.take(wanted[lo:hi] - pos).to_pylist()
        pos += batch.num_rows
        if hi == len(wanted):
            return


def _as_record(value: Any) -> dict | Reject:
    if isinstance(value, dict):
        return value
    return Reject("malformed_json", f"row is a {type(value).__name__}, not a JSON object")


@lru_cache(maxsize=None)
def _cached_index(source: Source) -> SourceIndex:
    """The index of a source whose rows are read without a planned part (rows read back by the
    write job), built once per process and kept: the write reads every source's rows again,
    unit by unit."""
    return index_source(source)


@lru_cache(maxsize=2)
def _load_dataset(source: Source):
    """A saved dataset or an Arrow file (``datasets``' stream format), memory-mapped."""
    import datasets

    if source.kind == "arrow":
        try:
            return datasets.Dataset.from_file(source.path)
        except Exception as e:  # pyarrow raises several kinds for a file that is not Arrow
            raise InputError(f"{source.path} is not an Arrow stream file as datasets writes "
                             f"them: {e}") from None
    return datasets.load_from_disk(source.path)

