"""Where things live in a shard folder, the manifest, and opening any of it by URL.

A shard folder (Contract 3 of ``docs/design.md``)::

    SHARDS/manifest.json                      written last: its presence means the write finished
    SHARDS/rank-00000/shard-000000.tar ...    one folder per (virtual) rank, tars in step order

Record keys are ``{step:08d}_{micro:03d}``. WebDataset splits a member name into key and
extension at the first dot of its base name, so a dotted key such as ``00000012.003`` would merge
every micro-batch of a step into one sample in any webdataset reader.

``SHARDS`` may be a local folder, any fsspec URL (``http(s)://`` from a server that serves byte
ranges, as object stores do; ``s3://``, ``gs://``, ``memory://``, ...; read with retries), or a
``pipe:`` command with a ``{path}`` placeholder for the file's path below the root, e.g.
``pipe:curl -s https://host/shards/{path}`` for a server without ranges.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import IO

from vlmshard.errors import InputError
from vlmshard.io import is_url, open_file
from vlmshard.jobs import WORK

FORMAT = "vlmshard-shards/2"  # 2: the images of a record in one member (images.mp)
MANIFEST = "manifest.json"
_KEY = re.compile(r"^(\d{8})_(\d{3})$")


def shard_path(rank: int, index: int) -> str:
    """Path of a shard below the root, with ``/`` separators (also a URL suffix)."""
    return f"rank-{rank:05d}/shard-{index:06d}.tar"


def record_key(step: int, micro: int) -> str:
    return f"{step:08d}_{micro:03d}"


def parse_key(key: str) -> tuple[int, int] | None:
    """(step, micro) of a record key, or None if the key is not one of ours."""
    m = _KEY.match(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class ShardEntry:
    """One tar: which rank and steps it holds, and what its bytes must hash to."""

    path: str
    rank: int
    index: int
    first_step: int
    end_step: int  # exclusive
    records: int
    samples: int
    bytes: int
    sha256: str
    # Where each record's first tar header starts, then where the last record ends (records + 1
    # entries), and each record's CRC-32 over that range: loader workers seek to their own
    # records and check just those bytes. Empty in manifests from before they were recorded.
    offsets: list[int] = field(default_factory=list)
    crc32: list[int] = field(default_factory=list)

    @property
    def seekable(self) -> bool:
        return len(self.offsets) == self.records + 1 == len(self.crc32) + 1


@dataclass
class Manifest:
    """What a reader needs to stream, check and collate the shards (``manifest.json``)."""

    ranks: int  # (virtual) ranks: one folder each
    dp: int  # the DP size the plan was measured at
    micro_batches: int  # records per rank per step
    steps: int  # every rank has exactly this many
    qv: int  # caps: pixel_values are padded to qv tiles, token tensors to qt
    qt: int
    model: dict  # the model family, image layout and dtype preprocessing recorded (ModelSpec)
    tokenizer: dict
    image_token_id: int
    pad_token_id: int
    tiling: dict[str, dict]  # source name -> tiling policy dict (max_num may differ per source)
    plan: dict  # path, algorithm, plan.parquet sha256
    stats: dict  # path, sha256 (as the plan recorded it)
    shard_bytes: int
    shards: list[ShardEntry] = field(default_factory=list)
    fingerprint: str = ""  # of what determines the bytes: plan, stats, shard size (a rerun skips)
    format: str = FORMAT
    vlmshard_version: str = ""
    video_token_id: int | None = None  # the token video embeddings fill (None: no video layout)
    # a grouped plan's packing groups (length, qv, sp: ``vlmshard pack --groups``) and each
    # step's; empty for a plan of one group
    groups: list[dict] = field(default_factory=list)
    step_groups: list[int] = field(default_factory=list)

    def step_group(self, step: int) -> dict:
        """The packing group of ``step``: its length (Qt), Qv, sequence-parallel degree and the
        tiles one of its ranks encodes at most."""
        if not self.step_groups:
            return {"length": self.qt, "qv": self.qv, "sp": 1, "rank_qv": self.qv}
        return self.groups[self.step_groups[step]]

    @property
    def sp_degrees(self) -> list[int]:
        """The sequence-parallel degrees the steps take."""
        return sorted({self.groups[g]["sp"] for g in set(self.step_groups)} or {1})

    @property
    def visual_token_ids(self) -> tuple[int, ...]:
        """The tokens image and video embeddings fill."""
        return tuple(dict.fromkeys(t for t in (self.image_token_id, self.video_token_id)
                                   if t is not None))

    def rank_shards(self, rank: int) -> list[ShardEntry]:
        return sorted((s for s in self.shards if s.rank == rank), key=lambda s: s.index)

    def model_spec(self):
        """The recorded ``ModelSpec`` (family, image layout, dtype)."""
        from vlmshard.families import ModelSpec

        return ModelSpec.from_dict(self.model)

    def policies(self) -> dict:
        """Source name -> the tiling policy its images were counted (and must be cut) with."""
        from vlmshard.families import policy_from_dict

        return {name: policy_from_dict(d) for name, d in self.tiling.items()}

    def coverage_problem(self, rank: int) -> str | None:
        """Why ``rank``'s shards do not hold steps 0..steps-1 back to back, or None."""
        end = 0
        for s in self.rank_shards(rank):
            if s.first_step != end or s.end_step <= s.first_step:
                return (f"rank {rank}: {s.path} holds steps {s.first_step}..{s.end_step - 1}, "
                        f"expected to start at step {end}")
            if s.records != (s.end_step - s.first_step) * self.micro_batches:
                return f"rank {rank}: {s.path} lists {s.records} records for its steps"
            end = s.end_step
        if end != self.steps:
            return f"rank {rank}: shards end at step {end}, not at step {self.steps}"
        return None

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Manifest":
        found = d.get("format")
        if isinstance(found, str) and found.startswith("vlmshard-shards/") and found != FORMAT:
            raise InputError(f"{where}: shards in format {found!r}, but this vlmshard reads "
                             f"{FORMAT!r} (format 1 kept each image as its own member, which "
                             "generic WebDataset readers refuse): write them again with "
                             "vlmshard write")
        if found != FORMAT:
            raise InputError(f"{where}: not a vlmshard shard manifest (format {found!r}, "
                             f"expected {FORMAT!r})")
        d = dict(d)
        d["shards"] = [ShardEntry(**s) for s in d["shards"]]
        return cls(**d)


def is_remote(root: str) -> bool:
    """Whether ``root`` is a URL or a ``pipe:`` command, not a local path (nothing to list)."""
    return is_url(root) or root.startswith("pipe:")


def join(root: str, path: str) -> str:
    """The URL or local path of ``path`` below ``root``."""
    if root.startswith("pipe:"):
        if "{path}" not in root:
            raise InputError(f"{root!r}: a pipe: root needs a {{path}} placeholder for the file "
                             "below it, e.g. 'pipe:curl -s http://host/shards/{path}'")
        return root.replace("{path}", path)
    if is_url(root):
        return root.rstrip("/") + "/" + path
    return os.path.join(root, *path.split("/"))


def open_url(url: str) -> IO[bytes]:
    """A binary reader for a local path, a URL (``vlmshard.io.open_file``: fsspec, ranged reads
    retried on transient errors) or a ``pipe:`` command (``webdataset.gopen``)."""
    if url.startswith("pipe:"):
        import importlib

        wds_gopen = importlib.import_module("webdataset.gopen")  # the package shadows it
        return wds_gopen.gopen(url, "rb")
    return open_file(url)


def read_manifest(root: str) -> Manifest:
    """The manifest of a finished shard folder; a clear error if the write is not finished."""
    url = join(root, MANIFEST)
    if not is_remote(root) and not os.path.exists(url):
        hint = (" (an unfinished write: rerun vlmshard write to finish it)"
                if os.path.isdir(os.path.join(root, WORK)) else "")
        raise FileNotFoundError(f"{root}: no {MANIFEST}{hint}")
    try:
        with open_url(url) as f:
            data = f.read()
    except Exception as e:  # curl, pipe and fsspec each raise their own kind
        raise FileNotFoundError(f"cannot read {url}: {e}") from e
    try:
        return Manifest.from_dict(json.loads(data), url)
    except (json.JSONDecodeError, TypeError) as e:
        raise InputError(f"{url}: unreadable manifest: {e}") from e
