"""Options of ``vlmshard write`` and ``vlmshard verify``: one definition each."""

from __future__ import annotations

from dataclasses import dataclass

from vlmshard.config import option, parse_size
from vlmshard.fleet import EngineOptions


@dataclass(kw_only=True)
class WriteConfig(EngineOptions):
    """Options of ``vlmshard write``."""

    plan: str = option(help="plan folder written by vlmshard pack")
    stats: str = option(help="the preprocess output folder the plan was packed from")
    out: str = option(help="shard folder to write")
    shard_bytes: int | str = option(
        "1GB", help="target shard size, e.g. 1GB or 256MiB; shards hold whole steps, so one step "
                    "larger than this makes a larger shard")

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_size(self.shard_bytes)  # a bad size fails when the config is made

    @property
    def shard_size(self) -> int:
        """``shard_bytes`` in bytes."""
        return parse_size(self.shard_bytes)


@dataclass(kw_only=True)
class VerifyConfig:
    """Options of ``vlmshard verify``."""

    shards: str = option(positional=True, metavar="SHARDS",
                         help="shard folder or URL (http://, fsspec, 'pipe:CMD {path}')")
    plan: str | None = option(None, help="plan folder: also check every planned sample is "
                                         "present exactly once where planned")
    quick: bool = option(False, help="only files, sizes and step coverage (no data read)")
    workers: int | None = option(None, help="shards checked in parallel",
                                 default_text="the CPUs this process may use")
