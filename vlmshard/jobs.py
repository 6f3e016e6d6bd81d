"""Resumable output folders, shared by the stages that write them (preprocess, write; pack
uses the fingerprint alone: its two files are rewritten whole).

A finished job is marked by one file written last (``preprocess.json``, ``manifest.json``)
holding the job's fingerprint; an unfinished one by ``OUT/_work/job.json``. The fingerprint is a
hash of what determines the output bytes, so a rerun skips a finished job, resumes an interrupted
one, and refuses clearly to mix two different jobs in one folder.
"""

from __future__ import annotations

import os

from .io import canonical_json, read_json, sha256_text, write_json_atomic

WORK = "_work"


def fingerprint(identity: dict) -> str:
    """The hash of what determines a job's output bytes (its canonical JSON)."""
    return sha256_text(canonical_json(identity))


def claim_output(out: str, final_name: str, identity: dict,
                 error: type[Exception] = ValueError) -> tuple[str, dict | None]:
    """(fingerprint of ``identity``, the final file's content if ``out`` already holds this very
    job finished). Otherwise prepares ``OUT/_work`` for this job, or raises ``error`` if ``out``
    holds another job, finished or not."""
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
    write_json_atomic(job, {"fingerprint": key, "identity": identity})
    return key, None
