"""File helpers shared by every stage: local paths and fsspec URLs, atomic writes, canonical
JSON, hashing, CPU discovery."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path``, durably.

    Readers see either the old file or the complete new one, never a torn write; a crash leaves
    at most a ``.tmp-*`` file that the next run ignores. The file's data is fsynced before the
    rename and the folder after it, so after a power loss a file that exists is complete: the
    stages count a part or shard as done by its file (or a marker written after it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs are shared like any file
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's (its entries') data to the device."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and fixed separators, so equal objects give equal bytes."""
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def write_json_atomic(path: str | Path, obj: Any) -> None:
    text = canonical_json(obj)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def write_parquet(table: "pyarrow.Table", path: str | Path) -> None:
    """The one Parquet writer of the project: fixed options, so equal tables give equal bytes."""
    import pyarrow.parquet as pq

    pq.write_table(table, str(path), compression="zstd", row_group_size=64 * 1024)


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in path


def open_file(path: str, mode: str = "rb") -> IO:
    """The one opener of local paths and fsspec URLs (``s3://``, ``http://``, ``memory://``, ...).

    Errors are the backend's own: ``OSError`` (``FileNotFoundError``) locally, whatever the
    fsspec filesystem raises for a URL."""
    if is_url(path):
        import fsspec

        return fsspec.open(path, mode).open()
    return open(path, mode)


def file_size(path: str) -> int:
    """Size in bytes of a local file or of the object at an fsspec URL."""
    if is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return int(fs.size(p))
    return os.path.getsize(path)


def file_exists(path: str) -> bool:
    """Whether a local path or an fsspec URL exists."""
    if is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        return fs.exists(p)
    return os.path.exists(path)


def arrow_column(values: "numpy.ndarray") -> "pyarrow.Array":
    """A flat numeric NumPy array as an Arrow array, zero-copy. ``pa.array`` would do, but it
    first imports pandas to check the input's type (0.3 s of a command that takes 2)."""
    import numpy as np
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values),
                                 [None, pa.py_buffer(values)])


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def available_cpus() -> int:
    """CPUs this process may actually use: its affinity mask, capped by a cgroup v2/v1 quota.

    ``os.cpu_count()`` reports the host's cores, which over-subscribes containers and Slurm jobs.
    """
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count)


def _cgroup_cpu_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
