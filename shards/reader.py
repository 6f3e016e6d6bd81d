"""Streaming one shard with webdataset's tar iterator, checking it against the manifest as it goes.

Each shard is read front to back (never seeked, so it works on any stream) through a hashing
reader. Records must come in the manifest's step range, in (step, micro) order, each decoding and
agreeing with its CRCs; at the end the record count, byte count and sha256 must match. Any
failure raises ``ShardError`` naming the shard and the record: skipping would silently break the
balance and the step count every rank relies on.
"""

from __future__ import annotations

import hashlib
from typing import IO, Iterator

from webdataset.tariterators import group_by_keys, tar_file_iterator

from .layout import Manifest, ShardEntry, join, open_url
from .records import Record, RecordError, decode_record


class ShardError(RuntimeError):
    """A shard that is missing, truncated, corrupt or out of order."""


class _HashingReader:
    """File-like wrapper that hashes and counts every byte read through it."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def iter_shard(root: str, entry: ShardEntry, manifest: Manifest, *,
               check_hash: bool = True) -> Iterator[Record]:
    """Yield the records of one shard in order, checked (see the module docstring)."""
    url = join(root, entry.path)
    try:
        raw = open_url(url)
    except Exception as e:
        raise ShardError(f"{url}: cannot open shard: {e}") from None
    reader = _HashingReader(raw)
    expected = ((step, micro) for step in range(entry.first_step, entry.end_step)
                for micro in range(manifest.micro_batches))
    count, last = 0, "(none)"
    try:
        files = ({**f, "__url__": url} for f in tar_file_iterator(reader))
        for sample in group_by_keys(files):
            record = decode_record(sample, url)
            want = next(expected, None)
            if (record.step, record.micro) != want or record.rank != entry.rank:
                raise ShardError(f"{url}: record {record.key} (rank {record.rank}) where "
                                 f"{'nothing more' if want is None else 'step %d micro %d' % want}"
                                 f" of rank {entry.rank} belongs")
            count += 1
            last = record.key
            yield record
        reader.drain()
    except (ShardError, RecordError):
        raise
    except Exception as e:  # tarfile.ReadError, EOFError, curl/pipe exit status, ...
        raise ShardError(f"{url}: truncated or corrupt tar after {count} record(s) "
                         f"(last good record {last}): {e}") from None
    finally:
        raw.close()
    if count != entry.records:
        raise ShardError(f"{url}: {count} record(s), manifest says {entry.records} "
                         f"(the tar is cut short after record {last})")
    if check_hash and (reader.bytes != entry.bytes
                       or reader.sha256.hexdigest() != entry.sha256):
        raise ShardError(f"{url}: {reader.bytes} bytes with sha256 {reader.sha256.hexdigest()}, "
                         f"manifest says {entry.bytes} bytes with sha256 {entry.sha256}")
