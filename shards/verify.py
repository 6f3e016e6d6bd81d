"""``vlmshard verify``: prove a shard folder holds exactly its plan, byte for byte.

Full check, per shard (in parallel): sha256 and size, record count, records in (step, micro)
order within the shard's steps, every member decodable (json, npy, each image decoded in full:
once, where the same bytes recur, as images samples share and epochs' repeats do),
CRC-32 of every member, tile counts recomputed from the decoded image sizes with the recorded
policy, and image-token counts. Across shards: every rank covers the same steps back to back,
no unlisted tars. With ``--plan``: the plan is the one written, and every planned sample sits
exactly once at its planned (step, rank, micro, slot).

``--quick`` checks only what the file system tells without reading data: files present, sizes,
and the step coverage of each rank.
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from vlmshard.errors import InputError
from vlmshard.io import available_cpus, sha256_file
from vlmshard.progress import Progress
from vlmshard.stage import Result

from .config import VerifyConfig
from .layout import Manifest, ShardEntry, is_remote, join, read_manifest
from .reader import ShardError, iter_shard
from .records import RecordError, check_image_tokens, decoded_images

log = logging.getLogger(__name__)

MAX_SHOWN = 20  # problems printed; all are in the --json output



@dataclass
class VerifyResult(Result):
    root: str
    ok: bool
    quick: bool
    plan: str | None = None  # the plan the samples were checked against
    ranks: int = 0
    steps: int = 0
    shards: int = 0
    # the plan's micro-batches and samples, each once: a sequence-parallel step's copies on
    # its group's other ranks not counted (``copies`` of them)
    records: int = 0
    samples: int = 0
    copies: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.ok:
            return (f"{self.root}: {len(self.problems)} problem(s), the first: "
                    f"{self.problems[0] if self.problems else '?'}")
        copies = (f", {self.copies} records more as sequence-parallel copies" if self.copies
                  else "")
        return (f"OK{' (quick)' if self.quick else ''}: {self.records} records, {self.samples} "
                f"samples{', every one as planned' if self.plan else ''} ({self.shards} shards, "
                f"{self.ranks} ranks x {self.steps} steps{copies}, {self.bytes / 1e6:.1f} MB)")

    def text(self) -> str:
        if self.ok:
            return self.summary()
        more = len(self.problems) - MAX_SHOWN
        return "\n".join([f"FAIL {problem}" for problem in self.problems[:MAX_SHOWN]]
                         + [f"{self.root}: {len(self.problems)} problem(s)"
                            + (f" ({more} more with --json)" if more > 0 else "")])

    @property
    def exit_status(self) -> int:
        return 0 if self.ok else 1


def run_verify(cfg: VerifyConfig) -> VerifyResult:
    """``vlmshard verify``: :func:`verify_shards` with the command's options."""
    return verify_shards(cfg.shards, plan=cfg.plan, quick=cfg.quick, workers=cfg.workers)


def verify_shards(root: str, plan: str | None = None, quick: bool = False,
                  workers: int | None = None) -> VerifyResult:
    """Check ``root`` (a folder or URL); ``problems`` is empty exactly when all holds."""
    start = time.monotonic()
    result = VerifyResult(root=root, ok=False, quick=quick, plan=plan)
    try:
        manifest = read_manifest(root)
    except (FileNotFoundError, InputError) as e:
        result.problems.append(str(e))
        return result
    result.ranks, result.steps, result.shards = manifest.ranks, manifest.steps, len(manifest.shards)
    result.copies = _copies(manifest)
    result.records, result.bytes = manifest.records - result.copies, manifest.bytes
    problems = result.problems
    problems += [p for r in range(manifest.ranks) if (p := manifest.coverage_problem(r))]
    problems += _unlisted_files(root, manifest)

    known: set[bytes] = set()  # the image bytes decoded so far, by digest: each once
    check = _quick_check if quick else functools.partial(_full_check, known=known)
    placements: list[np.ndarray] = []
    with Progress(total=len(manifest.shards), desc="verify", unit="shards") as bar, \
            ThreadPoolExecutor(workers or available_cpus()) as pool:
        for problem, placed in pool.map(lambda e: check(root, e, manifest), manifest.shards):
            if problem:
                problems.append(problem)
            if placed is not None:
                placements.append(placed)
            bar.update(1)
    # (quick: the manifest counts a shard's samples, copies among them, not each record's)
    result.samples = len(_as_planned(np.concatenate(placements), manifest)[0]) \
        if placements else sum(e.samples for e in manifest.shards)
    if plan is not None:
        problems += _plan_problems(plan, manifest, None if quick else placements)
    result.ok = not problems
    result.seconds = time.monotonic() - start
    return result


def _copies(manifest: Manifest) -> int:
    """The records that copy a sequence-parallel step's micro-batches onto its group's ranks
    after the first (``_as_planned``)."""
    if not manifest.step_groups:
        return 0
    sp = [manifest.step_group(t)["sp"] for t in range(manifest.steps)]
    return manifest.micro_batches * sum(
        e.rank % sp[t] != 0 for e in manifest.shards for t in range(e.first_step, e.end_step))


def _unlisted_files(root: str, manifest: Manifest) -> list[str]:
    if is_remote(root):
        return []  # a URL cannot be listed in general
    listed = {os.path.normpath(join(root, e.path)) for e in manifest.shards}
    found = {os.path.normpath(p) for p in glob.glob(os.path.join(root, "rank-*", "*"))}
    return [f"{p}: not in the manifest" for p in sorted(found - listed)]


def _quick_check(root: str, entry: ShardEntry, manifest: Manifest) -> tuple[str | None, None]:
    path = join(root, entry.path)
    if is_remote(root):
        return None, None
    if not os.path.exists(path):
        return f"{path}: missing", None
    size = os.path.getsize(path)
    if size != entry.bytes:
        return f"{path}: {size} bytes, manifest says {entry.bytes}", None
    return None, None


def _full_check(root: str, entry: ShardEntry, manifest: Manifest,
                known: set[bytes]) -> tuple[str | None, np.ndarray | None]:
    """(problem or None, placements [n, 5] of step, rank, micro, slot, sample_id); ``known``:
    ``decoded_images``'s, shared by the shards' checks."""
    policies = manifest.policies()
    rows = []
    try:
        for record in iter_shard(root, entry, manifest):
            check_image_tokens(record, manifest.visual_token_ids, policies)
            for _ in decoded_images(record, policies, rgb=False, known=known):
                pass
            rows += [(record.step, record.rank, record.micro, slot, s["sample_id"])
                     for slot, s in enumerate(record.samples)]
    except (ShardError, RecordError) as e:
        return str(e), None
    return None, np.array(rows, dtype=np.int64).reshape(-1, 5)


def _as_planned(found: np.ndarray, manifest: Manifest) -> tuple[np.ndarray, list[str]]:
    """Placements as ``plan.parquet`` has them. A step of sequence-parallel degree s holds the
    micro-batches of the group's data-parallel rank d on virtual ranks d·s … d·s + s − 1
    (``writer._plan_records``): they count once, as rank d, and the copies must match."""
    if not manifest.step_groups or not len(found):
        return found, []
    sp = np.array([g["sp"] for g in manifest.groups])[
        np.asarray(manifest.step_groups)[found[:, 0]]]
    placed = found.copy()
    placed[:, 1] //= sp
    first = found[:, 1] % sp == 0
    expected = np.repeat(placed[first], sp[first] - 1, axis=0)
    copies = placed[~first]
    if np.array_equal(expected[np.lexsort(expected.T[::-1])], copies[np.lexsort(copies.T[::-1])]):
        return placed[first], []
    return placed[first], ["the virtual ranks of a sequence-parallel step do not all hold its "
                           "micro-batches as planned"]


def _plan_problems(plan_dir: str, manifest: Manifest,
                   placements: list[np.ndarray] | None) -> list[str]:
    import pyarrow.parquet as pq

    path = os.path.join(plan_dir, "plan.parquet")
    if not os.path.exists(path):
        return [f"{plan_dir}: no plan.parquet"]
    if sha256_file(path) != manifest.plan["sha256"]:
        return [f"{path} is not the plan these shards were written from (sha256 differs)"]
    if placements is None:
        return []  # same bytes as written; --quick reads no records to compare
    table = pq.read_table(path)
    planned = np.stack([table[c].to_numpy().astype(np.int64)
                        for c in ("step", "rank", "micro", "slot", "sample_id")], axis=1)
    found = np.concatenate(placements) if placements else np.zeros((0, 5), np.int64)
    found, problems = _as_planned(found, manifest)
    found = found[np.lexsort(found.T[::-1])]
    if np.array_equal(planned, found) and not problems:
        return []
    ids, counts = np.unique(found[:, 4], return_counts=True)
    for sid in ids[counts > 1][:MAX_SHOWN]:
        problems.append(f"sample {sid} is in the shards {counts[ids == sid][0]} times")
    missing = np.setdiff1d(planned[:, 4], found[:, 4])
    for sid in missing[:MAX_SHOWN]:
        step, rank, micro, slot, _ = planned[planned[:, 4] == sid][0]
        problems.append(f"sample {sid} (step {step} rank {rank} micro {micro} slot {slot}) "
                        "is planned but not in the shards")
    if not problems:
        problems.append("the shards hold the planned samples at other places than planned")
    return problems
