"""The built-in container kinds (see ``containers``): JSONL and JSON-list files, Parquet, Arrow,
``datasets.save_to_disk`` folders and ``DatasetDict`` folders; the meta files are in ``catalogs``.

A worker's memory is bounded by its part, not by the source: it reads only its rows' bytes (JSONL,
JSON list) or the Parquet row groups holding its rows, one batch at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import lru_cache

import numpy as np

from vlmshard.errors import InputError
from vlmshard.io import is_url, open_file, read_json
from vlmshard.rejects import Reject

from .catalogs import json_object
from .containers import Container, Input, Part, RowReader, Source, SourceIndex, SourceOptions
from .json_rows import as_record, json_list_index, jsonl_line_index, text_rows


class _TextRows(RowReader):
    """Rows whose byte spans the index holds; the part carries its rows' spans."""

    errors = "strict"  # how undecodable bytes are read

    def claims(self, path: str) -> bool:
        return path.endswith(self.extension)

    def read_rows(self, source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
        if part.offsets is None and part.unreadable is None:  # a part not made by plan_parts
            part = _cached_index(self, source).spans(part)
        if part.unreadable is not None:
            yield int(part.rows[0]), Reject("unreadable_source", part.unreadable)
            return
        yield from text_rows(source.path, part, self.errors)


class Jsonl(_TextRows):
    kind, extension, description = "jsonl", ".jsonl", "a .jsonl file (a row per line)"

    def index(self, source: Source) -> SourceIndex:
        offsets, lengths = jsonl_line_index(source.path)
        return SourceIndex(n_rows=len(offsets), offsets=offsets, lengths=lengths)


class JsonList(_TextRows):
    kind, extension, description = "json", ".json", "a .json list of rows"
    errors = "surrogateescape"  # undecodable bytes kept (as lone surrogates) for the row's checks

    def sources(self, path: str, options: SourceOptions) -> list[Source]:
        if json_object(path) is not None:
            raise InputError(
                f"{path} is a JSON object but neither an InternVL meta file "
                '({name: {"annotation": file, "root": dir}}) nor LLaMA-Factory\'s '
                'dataset_info.json ({name: {"file_name": file, "formatting": "sharegpt"}}); '
                "a conversation file is a JSON list")
        return super().sources(path, options)

    def index(self, source: Source) -> SourceIndex:
        try:
            offsets, lengths = json_list_index(source.path)
        except Reject as r:
            return SourceIndex(n_rows=1, unreadable=r.message)
        return SourceIndex(n_rows=len(offsets), offsets=offsets, lengths=lengths)


@lru_cache(maxsize=None)
def _cached_index(reader: RowReader, source: Source) -> SourceIndex:
    """The index of a source whose rows are read without a planned part (rows read back by the
    write job), built once per process and kept: the write reads every source's rows again,
    unit by unit."""
    return reader.index(source)


_PARQUET_BATCH = 1024  # rows decoded at a time


class Parquet(RowReader):
    kind, extension, description = "parquet", ".parquet", "a .parquet file"
    columnar = True

    def claims(self, path: str) -> bool:
        return path.endswith(self.extension)

    def index(self, source: Source) -> SourceIndex:
        import pyarrow.parquet as pq

        with open_file(source.path) as f:
            return SourceIndex(n_rows=pq.ParquetFile(f).metadata.num_rows)

    def read_rows(self, source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
        """The rows, from the row groups that hold them only, decoded a batch at a time and
        stopping after the last row wanted from each group."""
        import pyarrow.parquet as pq

        rows = part.rows
        with open_file(source.path) as f:
            pf = pq.ParquetFile(f)
            meta = pf.metadata
            starts = np.cumsum([0] + [meta.row_group(g).num_rows
                                      for g in range(meta.num_row_groups)])
            # Ascending runs (a part may wrap into the next repeat); within one, groups ascend.
            for run in np.split(rows, np.flatnonzero(np.diff(rows) <= 0) + 1):
                groups = np.searchsorted(starts, run, side="right") - 1
                for g in np.unique(groups):
                    wanted = run[groups == g]
                    records = _row_group_records(pf, int(g), wanted - starts[g])
                    for row, rec in zip(wanted, records):
                        yield int(row), as_record(rec)


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


class _MappedArrow(RowReader):
    """A dataset ``datasets`` memory-maps. Rows are taken without decoding (an Image value stays
    its {bytes, path}), a batch at a time, so a part's images are not all held at once."""

    columnar = True

    def index(self, source: Source) -> SourceIndex:
        return SourceIndex(n_rows=len(_load_dataset(self, source.path)))

    def read_rows(self, source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
        import pyarrow as pa

        table = _load_dataset(self, source.path).data.table
        for start in range(0, len(part.rows), _PARQUET_BATCH):
            rows = part.rows[start:start + _PARQUET_BATCH]
            for row, rec in zip(rows, table.take(pa.array(rows, pa.int64())).to_pylist()):
                yield int(row), as_record(rec)

    def load(self, path: str):
        raise NotImplementedError


class Arrow(_MappedArrow):
    kind, extension, description = "arrow", ".arrow", "an .arrow file (datasets' stream format)"

    def claims(self, path: str) -> bool:
        return path.endswith(self.extension)

    def load(self, path: str):
        import datasets

        try:
            return datasets.Dataset.from_file(path)
        except Exception as e:  # pyarrow raises several kinds for a file that is not Arrow
            raise InputError(f"{path} is not an Arrow stream file as datasets writes "
                             f"them: {e}") from e


class SavedDataset(_MappedArrow):
    kind, description = "hf_dataset", "a datasets.save_to_disk folder"

    def claims(self, path: str) -> bool:
        return not is_url(path) and os.path.isdir(path)

    def sources(self, path: str, options: SourceOptions) -> list[Source]:
        if not os.path.exists(os.path.join(path, "state.json")):
            raise InputError(f"{path} is a folder but not a dataset saved with "
                             "datasets.save_to_disk")
        return super().sources(path, options)

    def load(self, path: str):
        import datasets

        return datasets.load_from_disk(path)


@lru_cache(maxsize=2)
def _load_dataset(reader: _MappedArrow, path: str):
    """A saved dataset or an Arrow file, memory-mapped."""
    return reader.load(path)


class DatasetDict(Container):
    """A ``DatasetDict.save_to_disk`` folder: its split's folder (``--split``, or a meta
    entry's ``split``; the only one if it holds one), named after the whole folder."""

    kind, description = "dataset_dict", "a DatasetDict folder with --split"

    def claims(self, path: str) -> bool:
        return not is_url(path) and os.path.isfile(os.path.join(path, "dataset_dict.json"))

    def sources(self, path: str, options: SourceOptions) -> list[Input]:
        splits = read_json(os.path.join(path, "dataset_dict.json")).get("splits", [])
        split = options.split
        if split is None and len(splits) == 1:
            split = splits[0]
        if split is None or split not in splits:
            what = f"has no split {split!r}" if split else "holds several splits"
            raise InputError(f"{path} is a DatasetDict that {what}: pass --split (or "
                             f"'split' in a meta file), one of {', '.join(splits)}")
        name = options.name or os.path.basename(path.rstrip("/"))
        root = options.image_root or os.path.dirname(path)
        return [Input(os.path.join(path, split),
                      SourceOptions(name=name, image_root=root, format=options.format,
                                    repeat_time=options.repeat_time, max_num=options.max_num))]
