"""File helpers shared by every stage: atomic writes, canonical JSON, hashing, CPU discovery."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path``.

    Readers see either the old file or the complete new one, never a torn write; a crash leaves
    at most a ``.tmp-*`` file that the next run ignores.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; outputs are shared like any file
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
