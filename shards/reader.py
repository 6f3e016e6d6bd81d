"""Reading shards with webdataset's tar iterator, checking them against the manifest.

Two ways in, both checked:

- ``iter_shard`` streams a whole shard front to back (never seeked, so it works on any stream,
  ``pipe:`` included). Records must come in the manifest's step range, in
  (step, micro) order, each decoding and agreeing with its CRCs; at the end the record count, byte
  count, sha256 and each record's byte-range CRC must match.
- ``SeekingShard`` seeks to chosen records through the manifest's per-record byte offsets and
  reads only their bytes, each checked against its range CRC: what a DataLoader worker uses, so
  K workers read the shards once between them instead of K times.

Any failure raises ``ShardError`` naming the shard and the record: skipping would silently break
the balance and the step count every rank relies on.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zlib
from typing import IO, Iterator

from webdataset.tariterators import group_by_keys, tar_file_iterator

from vlmshard.errors import InputError

from .layout import Manifest, ShardEntry, join, open_url, record_key
from .records import JSON, Record, RecordError, decode_record

_BLOCK = tarfile.BLOCKSIZE


class ShardError(InputError, RuntimeError):
    """A shard that is missing, truncated, corrupt or out of order."""


class ByteLedger:
    """File-like wrapper that counts and sha256-hashes every byte read through it, and CRC-32s
    each record's byte range ``offsets[i]:offsets[i+1]`` as the bytes pass."""

    def __init__(self, raw: IO[bytes], offsets: list[int] = ()) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        self.offsets = list(offsets)
        self.crc32: list[int] = []
        self._crc = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha256.update(data)
        start, self.bytes = self.bytes, self.bytes + len(data)
        bounds = self.offsets
        while data and len(self.crc32) + 1 < len(bounds):  # a record's range overlaps data
            lo, hi = bounds[len(self.crc32)], bounds[len(self.crc32) + 1]
            if lo >= self.bytes:
                break
            part = data[max(lo - start, 0):min(hi, self.bytes) - start]
            self._crc = zlib.crc32(part, self._crc)
            if hi > self.bytes:
                break
            self.crc32.append(self._crc)
            self._crc = 0
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def record_index(path: str) -> tuple[list[int], list[int], str, int]:
    """(offsets, crc32s, sha256, bytes) of a local tar written by the shard writer: where each
    record's first member header starts, then where the last record's data ends (the tar's
    end-of-archive blocks follow); and the CRC-32 of each record's range."""
    offsets, key, end = [], None, 0
    with tarfile.open(path, "r:") as tar:
        for info in tar:
            name = info.name.rsplit("/", 1)[-1].split(".", 1)[0]
            if name != key:
                offsets.append(info.offset)
                key = name
            end = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
    offsets.append(end)
    with open(path, "rb") as f:
        ledger = ByteLedger(f, offsets)
        ledger.drain()
    return offsets, ledger.crc32, ledger.sha256.hexdigest(), ledger.bytes


def _open(url: str) -> IO[bytes]:
    try:
        return open_url(url)
    except Exception as e:  # fsspec's backends and webdataset's gopen raise their own kinds
        raise ShardError(f"{url}: cannot open shard: {e}") from e


def _decode_one(url: str, data: bytes, want: tuple[int, int], rank: int) -> Record:
    """The one record in ``data`` (a record's tar members), checked to be ``want``."""
    files = ({**f, "__url__": url} for f in tar_file_iterator(io.BytesIO(data + bytes(2 * _BLOCK))))
    samples = list(group_by_keys(files))
    if len(samples) != 1:
        raise ShardError(f"{url}: the bytes of record {record_key(*want)} hold {len(samples)} "
                         "records")
    record = decode_record(samples[0], url)
    _check_place(url, record, want, rank)
    return record


def _check_place(url: str, record: Record, want: tuple[int, int] | None, rank: int) -> None:
    if (record.step, record.micro) != want or record.rank != rank:
        raise ShardError(f"{url}: record {record.key} (rank {record.rank}) where "
                         f"{'nothing more' if want is None else 'step %d micro %d' % want}"
                         f" of rank {rank} belongs")


def _place(entry: ShardEntry, manifest: Manifest, index: int) -> tuple[int, int]:
    """(step, micro) of the shard's ``index``-th record."""
    step, micro = divmod(index, manifest.micro_batches)
    return entry.first_step + step, micro


def iter_shard(root: str, entry: ShardEntry, manifest: Manifest, *,
               check_hash: bool = True) -> Iterator[Record]:
    """Yield the records of one shard in order, streamed and checked (see the module
    docstring)."""
    url = join(root, entry.path)
    raw = _open(url)
    reader = ByteLedger(raw, entry.offsets)
    expected = (_place(entry, manifest, i) for i in range(entry.records))
    count, last = 0, "(none)"
    samples = group_by_keys({**f, "__url__": url} for f in tar_file_iterator(reader))

    def read_tar(step):
        """``step()``, a read of the tar: what webdataset's iterator and the file raise
        (tarfile.ReadError, EOFError, OSError, a pipe's exit status) says it is cut or
        corrupt."""
        try:
            return step()
        except Exception as e:  # webdataset's tar iteration, the file or pipe under it
            raise ShardError(f"{url}: truncated or corrupt tar after {count} record(s) "
                             f"(last good record {last}): {e}") from e

    try:
        while (sample := read_tar(lambda: next(samples, None))) is not None:
            record = decode_record(sample, url)
            _check_place(url, record, next(expected, None), entry.rank)
            count += 1
            last = record.key
            yield record
        read_tar(reader.drain)
    finally:
        raw.close()
    if count != entry.records:
        raise ShardError(f"{url}: {count} record(s), manifest says {entry.records} "
                         f"(the tar is cut short after record {last})")
    if check_hash and (reader.bytes != entry.bytes
                       or reader.sha256.hexdigest() != entry.sha256):
        raise ShardError(f"{url}: {reader.bytes} bytes with sha256 {reader.sha256.hexdigest()}, "
                         f"manifest says {entry.bytes} bytes with sha256 {entry.sha256}")
    if entry.crc32 and reader.crc32 != entry.crc32:
        bad = next(i for i, (a, b) in enumerate(zip(reader.crc32, entry.crc32)) if a != b)
        raise ShardError(f"{url}: record {record_key(*_place(entry, manifest, bad))}: its bytes "
                         "differ from the manifest's per-record CRC-32 (offsets or content)")


class SeekingShard:
    """One shard open for reading single records through the manifest's offsets (a local file
    or a seekable fsspec URL); each record's bytes must match its CRC-32."""

    def __init__(self, root: str, entry: ShardEntry, manifest: Manifest) -> None:
        self.entry, self.manifest = entry, manifest
        self.url = join(root, entry.path)
        self.file = _open(self.url)

    def read(self, index: int) -> Record:
        """The shard's ``index``-th record."""
        url, entry = self.url, self.entry
        want = _place(entry, self.manifest, index)
        start, end = entry.offsets[index], entry.offsets[index + 1]
        try:
            self.file.seek(start)
            data = self.file.read(end - start)
        except Exception as e:  # the fsspec file's backend raises its own kinds
            raise ShardError(f"{url}: cannot read record {record_key(*want)}: {e}") from e
        if len(data) != end - start:
            raise ShardError(f"{url}: record {record_key(*want)}: {len(data)} of its "
                             f"{end - start} bytes (the tar is cut short)")
        if zlib.crc32(data) != entry.crc32[index]:
            raise ShardError(f"{url}: record {record_key(*want)}: its bytes differ from the "
                             "manifest's per-record CRC-32")
        try:
            return _decode_one(url, data, want, entry.rank)
        except (ShardError, RecordError):
            raise
        except Exception as e:  # tarfile.ReadError on a mangled header
            raise ShardError(f"{url}: record {record_key(*want)} does not parse as tar "
                             f"members: {e}") from e

    def meta(self, index: int) -> dict:
        """The shard's ``index``-th record's json member alone (its samples and their sizes),
        found through the members' tar headers: its images and tokens are passed over, not
        read, nor checked (``read`` checks them)."""
        want = _place(self.entry, self.manifest, index)
        at, end = self.entry.offsets[index], self.entry.offsets[index + 1]
        try:
            while at < end:
                self.file.seek(at)
                member = tarfile.TarInfo.frombuf(self.file.read(_BLOCK), "utf-8",
                                                 "surrogateescape")
                if member.name.endswith("." + JSON):
                    return json.loads(self.file.read(member.size))
                at += _BLOCK + -(-member.size // _BLOCK) * _BLOCK
        except Exception as e:  # the fsspec file's backend, a mangled header or json
            raise ShardError(f"{self.url}: record {record_key(*want)}: cannot read its json "
                             f"member: {e}") from e
        raise ShardError(f"{self.url}: record {record_key(*want)} has no json member")

    def close(self) -> None:
        self.file.close()
