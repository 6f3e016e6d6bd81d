"""Resumable output folders, shared by the stages that write them (preprocess, write; pack
uses the fingerprint alone: its two files are rewritten whole).

One job at a time per folder: ``locked_output`` holds an exclusive ``flock`` on the folder for
the job's lifetime (released by the kernel if the process dies), and a second job is refused
naming the holder, whose pid and host ``OUT/_work/job.json`` records.

A finished job is marked by one file written last (``preprocess.json``, ``manifest.json``)
holding the job's fingerprint; an unfinished one by ``OUT/_work/job.json``. The fingerprint is a
hash of what determines the output bytes, so a rerun skips a finished job, resumes an interrupted
one, and refuses clearly to mix two different jobs in one folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from typing import Iterator

from .io import canonical_json, read_json, sha256_text, write_json_atomic

WORK = "_work"


def fingerprint(identity: dict) -> str:
    """The hash of what determines a job's output bytes (its canonical JSON)."""
    return sha256_text(canonical_json(identity))


@contextlib.contextmanager
def locked_output(out: str, error: type[Exception] = ValueError) -> Iterator[None]:
    """Hold an exclusive lock on the folder ``out`` (created if missing) while the block runs;
    raise ``error`` at once if another job holds it."""
    os.makedirs(out, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        job = os.path.join(out, WORK, "job.json")
        owner = read_json(job).get("owner", {}) if os.path.exists(job) else {}
        holder = (f"pid {owner['pid']} on {owner['host']}, started {owner['started']}"
                  if owner else "a job that is starting")
        raise error(f"{out} is in use by another vlmshard job ({holder}); wait for it to end "
                    "or pass another --out") from None
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def claim_output(out: str, final_name: str, identity: dict,
                 error: type[Exception] = ValueError) -> tuple[str, dict | None]:
    """(fingerprint of ``identity``, the final file's content if ``out`` already holds this very
    job finished). Otherwise prepares ``OUT/_work`` for this job, or raises ``error`` if ``out``
    holds another job, finished or not. Call it inside ``locked_output(out)``."""
    key = fingerprint(identity)
    final = os.path.join(out, final_name)
    if os.path.exists(final):
        done = read_json(final)
        if done.get("fingerprint") == key:
            return key, done
        raise error(f"{out} holds a finished job with other inputs or config; pass a new --out "
                    "or delete that folder")
    work = os.path.join(out, WORK)
    job = os.path.join(work, "job.json")
    if os.path.exists(job) and read_json(job).get("fingerprint") != key:
        raise error(f"{out} holds an interrupted job with other inputs or config; delete {work} "
                    "to start over, or rerun with the original options")
    os.makedirs(work, exist_ok=True)
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json_atomic(job, {"fingerprint": key, "identity": identity, "owner": owner})
    return key, None
