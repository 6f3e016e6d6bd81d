"""Output folders, shared by the stages that write them: one job at a time in each (preprocess,
pack, write), and resumable (preprocess, write; pack uses the fingerprint alone: its two files
are rewritten whole).

One job at a time per folder: ``locked_output`` holds an exclusive ``flock`` on the folder for
the job's lifetime (released by the kernel if the process dies), and a second job is refused
naming the holder. The holder writes its owner record (pid, host, start time) to
``OUT/_lock.json`` as soon as it holds the lock, and removes it before letting go; a refused job
waits up to ``OWNER_WAIT_S`` for that record, since the holder may have taken the lock an instant
before it, and ignores a record left by a holder on this host that is gone (killed).

A finished job is marked by one file written last (``preprocess.json``, ``manifest.json``)
holding the job's fingerprint; an unfinished one by ``OUT/_work/job.json``. The fingerprint is a
hash of what determines the output bytes, so a rerun skips a finished job, resumes an interrupted
one, and refuses clearly to mix two different jobs in one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import Callable, Iterator

from .io import canonical_json, read_json, sha256_text, write_json_atomic

WORK = "_work"
OWNER = "_lock.json"  # the lock holder's pid, host and start time
OWNER_WAIT_S = 2.0  # how long a refused job waits for the holder to write it


def fingerprint(identity: dict) -> str:
    """The hash of what determines a job's output bytes (its canonical JSON)."""
    return sha256_text(canonical_json(identity))


@contextlib.contextmanager
def locked_output(out: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """Hold an exclusive lock on the folder ``out`` (created if missing) while the block runs;
    raise ``error`` naming the holder if another job holds it."""
    os.makedirs(out, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    record = os.path.join(out, OWNER)
    try:
        if not _try_lock(fd):
            holder = _wait_for_holder(fd, record)
            if holder is not None:
                raise error(f"{out} is in use by another vlmshard job ({holder}); wait for it to "
                            "end or pass another --out")
        write_json_atomic(record, {"pid": os.getpid(), "host": socket.gethostname(),
                                   "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    except BaseException:  # anything, a bug included: close the lock file and re-raise
        os.close(fd)
        raise
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record)  # before the lock goes: a record present is a holder's
        os.close(fd)  # releases the lock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _wait_for_holder(fd: int, record: str) -> str | None:
    """Who holds the lock, from its owner record once it is there; None if the lock came free
    meanwhile and is now ours."""
    deadline = time.monotonic() + OWNER_WAIT_S
    while True:
        owner = _live_owner(record)
        if owner is not None:
            return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
        if _try_lock(fd):
            return None
        if time.monotonic() > deadline:
            return f"which wrote no {OWNER} within {OWNER_WAIT_S:g} s of taking the lock"
        time.sleep(0.01)


def _live_owner(record: str) -> dict | None:
    """The owner record at ``record``, unless missing, unreadable or left by a process on this
    host that is gone (killed before it could remove it)."""
    try:
        owner = read_json(record)
        pid, host, _ = int(owner["pid"]), owner["host"], owner["started"]
    except (OSError, ValueError, KeyError, TypeError):  # JSONDecodeError is a ValueError
        return None
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
    return owner


def claim_output(out: str, final_name: str, identity: dict,
                 error: type[Exception] = ValueError, recorded_as: str | None = None,
                 before_claim: Callable[[], None] | None = None) -> tuple[str, dict | None]:
    """(fingerprint of ``identity``, the final file's content if ``out`` already holds this very
    job finished). Otherwise prepares ``OUT/_work`` for this job, or raises ``error`` if ``out``
    holds another job, finished or not, naming the keys that differ where the final file keeps
    its identity (under ``recorded_as``). Call it inside ``locked_output(out)``.

    ``before_claim`` runs only for a job not yet finished, before ``out`` is claimed: a check
    that can fail (a model folder that does not load) then leaves nothing behind, and a finished
    job's rerun skips it."""
    key = fingerprint(identity)
    final = os.path.join(out, final_name)
    if os.path.exists(final):
        done = read_json(final)
        if done.get("fingerprint") == key:
            return key, done
        recorded = done.get(recorded_as) if recorded_as else None
        raise error(f"{out} holds a finished job with other inputs or config"
                    f"{_differing(recorded, identity)}; pass a new --out or delete that folder")
    if before_claim is not None:
        before_claim()
    work = os.path.join(out, WORK)
    job = os.path.join(work, "job.json")
    if os.path.exists(job):
        started = read_json(job)
        if started.get("fingerprint") != key:
            raise error(f"{out} holds an interrupted job with other inputs or config"
                        f"{_differing(started.get('identity'), identity)}; delete {work} to "
                        "start over, or rerun with the original options")
    os.makedirs(work, exist_ok=True)
    write_json_atomic(job, {"fingerprint": key, "identity": identity})
    return key, None


def _differing(recorded, identity: dict) -> str:
    """`` (differing: a.b, c[0].d)``: the leaf keys whose values differ between the recorded
    identity and this job's, or '' where none was recorded."""
    if not isinstance(recorded, dict):
        return ""
    before, now = _leaves(recorded), _leaves(json.loads(canonical_json(identity)))
    keys = sorted(k for k in {*before, *now} if before.get(k, _MISSING) != now.get(k, _MISSING))
    shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
    return f" (differing: {shown})" if keys else ""


_MISSING = object()


def _leaves(value, prefix: str = "") -> dict:
    """Every leaf of a JSON value by its dotted path (``sources[0].file.bytes``)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items()
                for k, v in _leaves(item, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value)
                for k, v in _leaves(item, f"{prefix}[{i}]").items()}
    return {prefix: value}
