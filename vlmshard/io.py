"""File helpers shared by every stage: local paths and fsspec URLs (read with retries), atomic
writes, canonical JSON, hashing, CPU discovery."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, TypeVar

from .errors import InputError

if TYPE_CHECKING:  # imported where used: a command's start does not pay for them
    import numpy
    import pyarrow

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    except BaseException:  # anything, a bug included: leave no temporary file, re-raise
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


def resolve(base: str, path: str) -> str:
    """``path`` made absolute against the folder ``base`` (a local folder or a URL); URLs and
    absolute paths name their file themselves."""
    if is_url(path) or os.path.isabs(path):
        return path
    if is_url(base):
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(base)
        joined = posixpath.normpath(posixpath.join("/" + parts.path.lstrip("/"), path))
        return urlunsplit(parts._replace(path=joined))
    return os.path.normpath(os.path.join(base, path))


# ---------------------------------------------------------------------------------------------
# Remote reads: object stores and HTTP servers fail transiently (503s, dropped connections,
# bodies cut off halfway); one such failure must not stop a fleet job.

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a remote read is retried: exponential backoff from
    ``first_wait_s`` up to 16 times that per wait, each with up to ``first_wait_s`` of random
    jitter so that a fleet's workers do not retry in step (about 20 s in all by default).
    ``VLMSHARD_REMOTE_ATTEMPTS``, ``VLMSHARD_REMOTE_WAIT_S`` and ``VLMSHARD_REMOTE_STALL_S``
    override the defaults."""

    attempts: int = 6
    first_wait_s: float = 0.5
    stall_s: float = 60.0  # an HTTP connect or read that waits longer is a transient failure

    @property
    def max_wait_s(self) -> float:
        return 16 * self.first_wait_s

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        env = os.environ.get
        return cls(attempts=max(1, int(env("VLMSHARD_REMOTE_ATTEMPTS", cls.attempts))),
                   first_wait_s=float(env("VLMSHARD_REMOTE_WAIT_S", cls.first_wait_s)),
                   stall_s=float(env("VLMSHARD_REMOTE_STALL_S", cls.stall_s)))


class RemoteReadError(InputError, OSError):
    """A remote read that failed for a reason not an ``OSError`` (an HTTP status, a client's own
    error), at once or, when transient, after every retry (names URL and error)."""


def is_transient(error: BaseException) -> bool:
    """Whether retrying may help: a 5xx/429/408 status, a dropped or refused connection, a
    timeout, a body shorter than its Content-Length. Not a 404 or 403: those stay as they are."""
    status = getattr(error, "status", None)  # aiohttp's ClientResponseError
    if isinstance(status, int):
        return status in TRANSIENT_STATUS
    if isinstance(error, FileNotFoundError):
        # fsspec's HTTP info() turns any failure into FileNotFoundError, raised from the cause
        return error.__cause__ is not None and is_transient(error.__cause__)
    if isinstance(error, PermissionError):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    import aiohttp

    return isinstance(error, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def retrying(url: str, call: Callable[[], T], policy: RetryPolicy | None = None) -> T:
    """``call()``, a read through fsspec, retried on transient errors (see ``RetryPolicy``);
    when the attempts run out, ``RemoteReadError`` naming ``url`` and the last error. Of the
    other errors an ``OSError`` (a missing or forbidden object) passes unchanged and the rest,
    a backend's own kinds, become ``RemoteReadError``: callers catch ``OSError`` alone."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

    policy = policy or RetryPolicy.from_env()

    def warn(state) -> None:
        log.warning("%s: %s; retry %d of %d", url, _describe(state.outcome.exception()),
                    state.attempt_number, policy.attempts - 1)

    retry = Retrying(stop=stop_after_attempt(policy.attempts), reraise=True,
                     wait=wait_exponential_jitter(initial=policy.first_wait_s,
                                                  max=policy.max_wait_s,
                                                  jitter=policy.first_wait_s),
                     retry=retry_if_exception(is_transient), before_sleep=warn)
    try:
        return retry(call)
    except Exception as e:  # fsspec's backends: OSError, aiohttp's, botocore's, gcsfs' kinds
        if is_transient(e):
            raise RemoteReadError(f"{url}: still failing after {policy.attempts} attempts: "
                                  f"{_describe(e)}") from e
        if isinstance(e, OSError):
            raise
        raise RemoteReadError(f"{url}: {_describe(e)}") from e


def _describe(error: BaseException | None) -> str:
    if isinstance(error, FileNotFoundError) and error.__cause__ is not None:
        error = error.__cause__  # fsspec's HTTP info() hides the status in the cause
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _storage_options(url: str) -> dict:
    """fsspec options: HTTP reads time out after ``RetryPolicy.stall_s`` without progress, so a
    stalled server is retried like a dropped connection (aiohttp's default waits 5 minutes)."""
    if not url.startswith(("http://", "https://")):
        return {}
    import aiohttp

    stall = RetryPolicy.from_env().stall_s
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=stall,
                                                               sock_read=stall)}}


def open_file(path: str, mode: str = "rb") -> IO:
    """The one opener of local paths and fsspec URLs (``s3://``, ``http://``, ``memory://``, ...).

    A URL is opened, and every byte range it reads is fetched, through ``retrying``: fsspec's
    buffered files read through their cache's fetcher, which takes (start, end) and so can be
    called again after a failure. Errors are the backend's own (``FileNotFoundError`` for a
    missing file) or ``RemoteReadError``."""
    if not is_url(path):
        return open(path, mode)
    import fsspec

    f = retrying(path, lambda: fsspec.open(path, mode, **_storage_options(path)).open())
    cache = getattr(f, "cache", None)
    fetch = getattr(cache, "fetcher", None)
    if fetch is not None:
        cache.fetcher = lambda start, end: retrying(path, lambda: fetch(start, end))
    return f


def read_bytes(path: str) -> bytes:
    """All bytes of a local file or of the object at an fsspec URL, the URL through
    ``retrying`` (a 0-byte object is ``b""``, as a 0-byte file is)."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    import fsspec

    fs, p = fsspec.core.url_to_fs(path, **_storage_options(path))
    return retrying(path, lambda: fs.cat_file(p))


def file_size(path: str) -> int:
    """Size in bytes of a local file or of the object at an fsspec URL."""
    if is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path, **_storage_options(path))
        return int(retrying(path, lambda: fs.size(p)))
    return os.path.getsize(path)


def file_exists(path: str) -> bool:
    """Whether a local path or an fsspec URL exists."""
    if is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path, **_storage_options(path))
        try:
            retrying(path, lambda: fs.info(p))  # exists() would call a 503 "absent"
        except FileNotFoundError:
            return False
        return True
    return os.path.exists(path)


def arrow_column(values: "numpy.ndarray") -> "pyarrow.Array":
    """A flat numeric NumPy array as an Arrow array, zero-copy. ``pa.array`` would do, but it
    first imports pandas to check the input's type (0.3 s of a command that takes 2)."""
    import numpy as np
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values),
                                 [None, pa.py_buffer(values)])


def file_in(path: str, name: str, option: str) -> str:
    """The file an option names: ``path`` itself, or where ``path`` is a folder (a run's, a
    profile's), its file ``name``; a missing one is one line naming the option."""
    if os.path.isdir(path):
        inner = os.path.join(path, name)
        if not os.path.isfile(inner):
            raise InputError(f"{option} {path}: the folder holds no {name}")
        return inner
    if not os.path.exists(path):
        raise InputError(f"{option} {path}: no such file or folder")
    return path


def folder_of(path: str, name: str, option: str) -> str:
    """The folder an option names, which must hold ``name``: ``path`` itself, or the folder of
    ``path`` where that is the file ``name``; anything else is one line naming the option."""
    if os.path.isfile(path) and os.path.basename(path) == name:
        return os.path.dirname(path) or "."
    if not os.path.exists(path):
        raise InputError(f"{option} {path}: no such file or folder")
    if not os.path.isdir(path):
        raise InputError(f"{option} {path}: not a folder holding {name}")
    if not os.path.isfile(os.path.join(path, name)):
        raise InputError(f"{option} {path}: the folder holds no {name}")
    return path


def read_json(path: str | Path) -> Any:
    """A JSON file's content; a file that is not JSON is an :class:`InputError` naming it."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON: {e}") from e


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
