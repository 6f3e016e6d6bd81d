"""Container kinds: how an input path becomes sources, and how a source's rows are counted and
read.

A ``Container`` claims the paths it reads and turns one into sources. A ``RowReader`` is a
container whose sources hold rows: it indexes a source (its row count, and byte spans where it
can) and reads the rows of a part. Meta files (InternVL's, LLaMA-Factory's ``dataset_info.json``)
and ``DatasetDict`` folders are containers that name other inputs (``Input``), each found again
by the registry (``vlmshard.preprocess.registry``), which holds the kinds by name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from vlmshard.io import is_url
from vlmshard.rejects import Reject

from .conversation import RowFormat


@dataclass(frozen=True)
class Source:
    """One annotation file (or saved dataset) and where its images live; ``kind`` names the
    ``RowReader`` that reads it."""

    name: str
    kind: str
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


@dataclass(frozen=True)
class SourceOptions:
    """What the command line, or a meta file's entry, says of an input's sources."""

    name: str | None  # None: the input's file name, less its extension
    image_root: str | None  # None: the input's folder
    format: RowFormat = RowFormat()
    split: str | None = None  # a DatasetDict's split
    repeat_time: float = 1.0
    max_num: int | None = None
    datasets: tuple[str, ...] | None = None  # the meta files' entries to read; None: all


@dataclass(frozen=True)
class Input:
    """Another input a container names (a meta file's entry, a DatasetDict's split), with what
    the container says of it: the registry finds its container again."""

    path: str
    options: SourceOptions


class Container:
    """A kind of input: the paths it claims and the sources (or other inputs) one holds."""

    kind: str  # its name, unique among the registered containers
    description: str  # what the error for an unknown input lists, e.g. "a .jsonl file"

    def claims(self, path: str) -> bool:
        raise NotImplementedError

    def sources(self, path: str, options: SourceOptions) -> list[Source | Input]:
        raise NotImplementedError


class RowReader(Container):
    """A container whose sources hold rows. ``columnar``: every row has every column (a table),
    so a renamed column that rows may leave out (images, system) is looked for in its first row
    too."""

    columnar: bool = False
    extension: str = ""  # the file name's ending, left out of the source's default name

    def sources(self, path: str, options: SourceOptions) -> list[Source]:
        base = os.path.basename(path.rstrip("/"))
        stem = base[:-len(self.extension)] if self.extension and base.endswith(self.extension) \
            else base
        return [Source(name=options.name or stem, kind=self.kind, path=path,
                       image_root=_image_root(path, options.image_root),
                       repeat_time=options.repeat_time, max_num=options.max_num,
                       format=options.format)]

    def index(self, source: Source) -> SourceIndex:
        raise NotImplementedError

    def read_rows(self, source: Source, part: Part) -> Iterator[tuple[int, dict | Reject]]:
        """(row number, record) for each row of the part; a bad row gives a ``Reject``."""
        raise NotImplementedError


def _image_root(path: str, given: str | None) -> str:
    """The folder relative image paths start from: ``given``, else the input's folder."""
    root = given or (os.path.dirname(path) if not is_url(path) else path.rsplit("/", 1)[0])
    return root if is_url(root) else os.path.abspath(root)
