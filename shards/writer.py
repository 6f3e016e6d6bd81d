"""The write job: a plan and its stats table in, pre-balanced WebDataset shards out (Contract 3 of
``docs/design.md``).

Steps, each restartable:

1. Check the plan was made from these stats (sha256) and that every step has all its
   micro-batches.
2. Copy the columns the records need into ``_work/samples.arrow``, an uncompressed Arrow file
   that every worker memory-maps: a shard's samples come from all over the dataset, and Parquet
   cannot be read by row.
3. Lay out the shards: per rank, whole steps in order, a new shard before the one that would
   pass ``--shard-bytes`` (estimated from the images' encoded sizes and token counts). The
   layout is a pure function of the plan, the stats and the images, so a rerun computes the
   same one.
4. Write each shard on an engine (local pool or Ray): temp file, then rename, then a marker in
   ``_work/done/``. A rerun skips shards that have their marker. What comes from the source rows
   (token ids the stats did not keep, images embedded in the rows) is staged before, each row
   read once in source order (``shards/staging.py``); embedded images' bytes go into the shards
   unchanged, as image files' bytes do.
5. Write ``manifest.json`` last and remove ``_work``.

Tars are byte-deterministic: members in sorted order, fixed mtime, uid/gid and names.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlmshard import __version__
from vlmshard.fleet import resolve_workers, run_units
from vlmshard.errors import JobError
from vlmshard.io import (
    atomic_write,
    file_size,
    read_bytes,
    read_json,
    sha256_file,
    write_json_atomic,
)
from vlmshard.jobs import WORK, claim_output, locked_output
from vlmshard.packing.plan import read_grouped_plan, read_plan_json
from vlmshard.packing.stats import files_sha256, read_preprocess_json, stats_files
from vlmshard.preprocess import (
    EMBEDDED,
    RecordedPreprocess,
    RetokenizeError,
    SampleSpec,
    sample_where,
)
from vlmshard.progress import Progress
from vlmshard.stage import Result

from . import staging
from .config import WriteConfig
from .layout import FORMAT, MANIFEST, Manifest, ShardEntry, shard_path
from .records import encode_record, image_name

log = logging.getLogger(__name__)

TAR_MTIME = 0  # every member's mtime: the same plan must give the same bytes
SAMPLE_COLUMNS = ["sample_id", "source", "row", "image_tiles", "seq_len", "loss_tokens",
                  "image_paths", "image_sizes", "image_bytes", "videos"]
TOKEN_COLUMNS = ["input_ids", "labels"]


class WriteError(JobError):
    """The shards cannot be written as planned; the message names the sample, image or file."""


@dataclass
class WriteResult(Result):
    out: str
    ranks: int
    steps: int
    shards: int
    records: int
    bytes: int
    seconds: float
    shards_resumed: int = 0
    already_complete: bool = False

    def summary(self) -> str:
        return (f"{self.shards} shards, {self.records} records, {self.bytes / 1e6:.1f} MB -> "
                f"{self.out}{' (already complete)' if self.already_complete else ''}")


@dataclass(frozen=True)
class ShardUnit:
    """One shard to write: its rank and steps, and each record's (step, micro, sample ids)."""

    rank: int
    index: int
    first_step: int
    end_step: int
    records: tuple[tuple[int, int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class WriteSpec:
    """Everything a shard worker needs, picklable for pool processes and Ray actors."""

    out: str
    samples_path: str
    staged_units: int  # units under _work/staged: tokens not kept, embedded images


# ---------------------------------------------------------------------------------------------
# Driver


def run_write(cfg: WriteConfig) -> WriteResult:
    """Write (or resume, or skip) the shards of ``cfg.plan``; see the module docstring. A second
    job on the same ``out`` while this one runs is refused (``WriteError``)."""
    start = time.monotonic()
    with locked_output(cfg.out, WriteError):
        return _write(cfg, cfg.shard_size, start)


def _write(cfg: WriteConfig, shard_bytes: int, start: float) -> WriteResult:
    plan_json = read_plan_json(cfg.plan)
    plan_parquet = os.path.join(cfg.plan, "plan.parquet")
    preprocess = _read_preprocess(cfg.stats, plan_json)
    files = stats_files(cfg.stats)
    if files_sha256(files) != plan_json["stats"]["sha256"]:
        raise WriteError(f"{cfg.stats} is not the stats table {cfg.plan} was packed from "
                         "(sha256 differs): pack again, or pass the stats the plan names "
                         f"({plan_json['run'].get('stats', 'see its plan.run.json')})")
    identity = {"format": FORMAT, "plan_sha256": sha256_file(plan_parquet),
                "stats_sha256": plan_json["stats"]["sha256"], "shard_bytes": shard_bytes}
    fingerprint, finished = claim_output(cfg.out, MANIFEST, identity, error=WriteError)
    if finished is not None:
        existing = Manifest.from_dict(finished, cfg.out)
        log.info("%s is already complete (same plan, stats and shard size)", cfg.out)
        return WriteResult(cfg.out, existing.ranks, existing.steps, len(existing.shards),
                           existing.records, existing.bytes, time.monotonic() - start,
                           already_complete=True)
    work = os.path.join(cfg.out, WORK)
    os.makedirs(os.path.join(work, "done"), exist_ok=True)
    for stale in glob.glob(os.path.join(cfg.out, "rank-*", ".tmp-*")):
        os.unlink(stale)  # a shard a killed run was writing

    params = plan_json["params"]
    ranks, micro = params["ranks"], params["micro_batches"]
    records, step_groups = _plan_records(cfg.plan)
    steps = len(records) // (ranks * micro)
    recorded = _recorded_preprocess(preprocess)
    samples_path = os.path.join(work, "samples.arrow")
    if not os.path.exists(samples_path):
        _write_sample_table(files, samples_path, recorded.keep_tokens)
    units = _layout(records, samples_path, ranks, micro, steps, shard_bytes)
    sample_spec = recorded.sample_spec()
    workers = resolve_workers(cfg.engine, cfg.workers)
    staged = _stage(cfg, work, samples_path, records, sample_spec, not recorded.keep_tokens,
                    workers)
    spec = WriteSpec(out=cfg.out, samples_path=samples_path, staged_units=staged)

    done = {(u.rank, u.index): _committed(work, u) for u in units}
    todo = [u for u in units if done[(u.rank, u.index)] is None]
    resumed = len(units) - len(todo)
    log.info("%d rank(s) x %d step(s) x %d micro-batch(es) in %d shard(s)%s", ranks, steps,
             micro, len(units), f"; resuming, {resumed} already written" if resumed else "")
    with Progress(total=sum(len(u.records) for u in todo), desc="write", unit="records") as bar:
        for summary in run_units(ShardWriter, spec, todo, cfg.engine, workers, cfg.ray_address):
            entry = ShardEntry(**summary)
            done[(entry.rank, entry.index)] = entry
            bar.update(entry.records)

    manifest = _manifest(cfg, plan_json, recorded, identity, fingerprint, ranks, micro, steps,
                         shard_bytes, sorted(done.values(), key=lambda e: (e.rank, e.index)),
                         step_groups)
    write_json_atomic(os.path.join(cfg.out, MANIFEST), manifest.to_dict())
    shutil.rmtree(work)
    seconds = time.monotonic() - start
    log.info("write: %d shard(s), %d record(s), %.1f MB in %.1fs -> %s", len(manifest.shards),
             manifest.records, manifest.bytes / 1e6, seconds, cfg.out)
    return WriteResult(cfg.out, ranks, steps, len(manifest.shards), manifest.records,
                       manifest.bytes, seconds, shards_resumed=resumed)


def _stage(cfg: WriteConfig, work: str, samples_path: str, records: list,
           sample_spec: SampleSpec, tokens: bool, workers: int) -> int:
    """Stage what the placed samples take from their source rows (``shards/staging.py``): their
    tokens if the stats did not keep them, their embedded images. Returns the unit count."""
    placed = pa.array(np.unique(np.concatenate([np.asarray(ids) for ids in records])))
    units = staging.plan_units(_open_sample_table(samples_path).take(placed), tokens)
    folder = os.path.join(work, "staged")
    os.makedirs(folder, exist_ok=True)
    todo = [u for u in units if not os.path.exists(staging.unit_path(folder, u.index))]
    if todo:
        spec = staging.StageSpec(folder=folder, samples_path=samples_path, samples=sample_spec,
                                 tokens=tokens)
        what = "re-tokenize" if tokens else "stage embedded images"
        with Progress(total=sum(len(u.sample_ids) for u in todo), desc=what,
                      unit="samples") as bar:
            try:
                for summary in run_units(staging.Stager, spec, todo, cfg.engine, workers,
                                         cfg.ray_address):
                    bar.update(summary["samples"])
            except RetokenizeError as e:
                raise WriteError(str(e)) from e
    return len(units)


def _read_preprocess(stats: str, plan_json: dict) -> dict:
    if plan_json["stats"].get("format") != "vlmshard":
        raise WriteError("the plan was packed from OmniBal length files, which hold no images "
                         "or tokens: pack the preprocess output folder to write shards")
    preprocess = read_preprocess_json(stats)
    if preprocess is None:
        raise WriteError(f"{stats}: no preprocess.json here or one folder up; pass the "
                         "preprocess output folder as --stats")
    return preprocess


def _plan_records(plan: str) -> tuple[list[tuple[int, ...]], list[int]]:
    """Sample ids of every micro-batch of every virtual rank, in step-major order (step, rank,
    micro), and each step's packing group (none for a one-group plan). In a step of a
    sequence-parallel group of degree s, virtual ranks d·s … d·s + s − 1 each hold the
    micro-batches of the group's data-parallel rank d (``vlmshard.shards.loader`` gives each
    rank its share of them)."""
    try:
        info, grouped = read_grouped_plan(plan)
    except ValueError as e:
        raise WriteError(str(e)) from e
    ranks, micro = info["params"]["ranks"], info["params"]["micro_batches"]
    chunks = []
    for g, packing in enumerate(grouped.packings):
        sizes = np.diff(packing.offsets)
        if np.any(sizes == 0):
            empty, per_step = int(np.flatnonzero(sizes == 0)[0]), packing.ranks * micro
            step = int(np.flatnonzero(grouped.order == g)[empty // per_step])
            raise WriteError(f"{plan}: step {step} rank {empty // micro % packing.ranks} micro "
                             f"{empty % micro} has no samples: every step needs all ranks x "
                             "micro-batches")
        chunks.append([tuple(map(int, c)) for c in np.split(packing.items, packing.offsets[1:-1])]
                      if packing.n_micro else [])
    if not grouped.steps:
        raise WriteError(f"{plan}: the plan places no samples")
    records, seen = [], [0] * len(grouped.groups)
    for g in grouped.order.tolist():
        per_step = grouped.packings[g].ranks * micro
        step = chunks[g][seen[g] * per_step:(seen[g] + 1) * per_step]
        seen[g] += 1
        sp = grouped.groups[g].sp
        records += [step[(v // sp) * micro + m] for v in range(ranks) for m in range(micro)]
    return records, (grouped.order.tolist() if grouped.grouped else [])


def _write_sample_table(files: list[str], path: str, keep_tokens: bool) -> None:
    """The stats columns the records need, as one memory-mappable Arrow file (row = sample_id)."""
    def write(tmp: str) -> None:
        writer = None
        for f in files:
            pf = pq.ParquetFile(f)
            # image_bytes: stats written before it existed are laid out from file sizes
            columns = [c for c in SAMPLE_COLUMNS if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(batch_size=65536,
                                         columns=columns + (TOKEN_COLUMNS if keep_tokens else [])):
                if writer is None:
                    writer = pa.ipc.new_file(tmp, batch.schema)
                writer.write_batch(batch)
        writer.close()

    atomic_write(path, write)


def _open_sample_table(path: str) -> pa.Table:
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def _layout(records: list[tuple[int, ...]], samples_path: str, ranks: int, micro: int,
            steps: int, shard_bytes: int) -> list[ShardUnit]:
    """Whole steps per shard, per rank, cut before a shard would pass ``shard_bytes``."""
    table = _open_sample_table(samples_path)
    sample_bytes = _estimated_sample_bytes(table)
    sizes = np.array([sum(sample_bytes[i] for i in ids) for ids in records], dtype=np.int64)
    step_bytes = sizes.reshape(steps, ranks, micro).sum(axis=2)
    units = []
    for rank in range(ranks):
        first, total, index = 0, 0, 0
        for step in range(steps + 1):
            if step == steps or (total and total + step_bytes[step, rank] > shard_bytes):
                recs = tuple((s, m, records[(s * ranks + rank) * micro + m])
                             for s in range(first, step) for m in range(micro))
                units.append(ShardUnit(rank, index, first, step, recs))
                first, total, index = step, 0, index + 1
            if step < steps:
                total += step_bytes[step, rank]
    # Early steps of every rank first, so a partial run leaves the start of training ready.
    return sorted(units, key=lambda u: (u.index, u.rank))


def _estimated_sample_bytes(table: pa.Table) -> np.ndarray:
    """Bytes a sample adds to a tar: its images, 8 bytes per token, headers and json."""
    tokens = table["seq_len"].to_numpy().astype(np.int64)
    if "image_bytes" in table.column_names:
        sizes = table["image_bytes"].to_pylist()
    else:  # stats from before image_bytes was recorded: the files' sizes now
        paths = table["image_paths"].to_pylist()
        unique = sorted({p for ps in paths for p in ps})
        with ThreadPoolExecutor(16) as pool:  # stat calls on remote storage wait on the network
            file_bytes = dict(zip(unique, pool.map(_file_size, unique)))
        sizes = [[file_bytes[p] for p in ps] for ps in paths]
    images = np.array([sum(ss) + 1024 * len(ss) for ss in sizes], dtype=np.int64)
    if "videos" in table.column_names:  # PNG frames: about half their RGB bytes
        images += np.array([sum(len(v["frames"]) * (v["w"] * v["h"] * 3 // 2 + 1024) for v in vs)
                            for vs in table["videos"].to_pylist()], dtype=np.int64)
    return 8 * tokens + images + 256


def _file_size(path: str) -> int:
    """A file's size, or 0 if it is gone (the worker then fails naming the sample)."""
    try:
        return file_size(path)
    except (OSError, ValueError):
        return 0


def _committed(work: str, unit: ShardUnit) -> ShardEntry | None:
    marker = _marker_path(work, unit.rank, unit.index)
    if not os.path.exists(marker):
        return None
    entry = ShardEntry(**read_json(marker))
    tar = os.path.join(os.path.dirname(work), entry.path)
    return entry if os.path.exists(tar) and os.path.getsize(tar) == entry.bytes else None


def _marker_path(work: str, rank: int, index: int) -> str:
    return os.path.join(work, "done", f"rank-{rank:05d}-shard-{index:06d}.json")


def _recorded_preprocess(preprocess: dict) -> RecordedPreprocess:
    """What preprocessing recorded, its tokenizer checked to be the same file (its ids are in the
    plan)."""
    try:
        recorded = RecordedPreprocess(preprocess)
    except ValueError as e:
        raise WriteError(str(e)) from e
    if not recorded.keep_tokens and not recorded.retokenizes_alike:
        raise WriteError("this preprocess output was made by an older vlmshard, which rendered "
                         "text differently (the line break after <image>); without "
                         "--keep-tokens its ids cannot be rebuilt: preprocess again")
    if not recorded.tokenizer_unchanged():
        raise WriteError(f"tokenizer {recorded.tokenizer.path} is missing or differs from the one "
                         "preprocessing used (sha256 of its files): token ids would not match "
                         "the plan")
    return recorded


def _manifest(cfg: WriteConfig, plan_json: dict, recorded: RecordedPreprocess, identity: dict,
              fingerprint: str, ranks: int, micro: int, steps: int, shard_bytes: int,
              entries: list[ShardEntry], step_groups: list[int]) -> Manifest:
    image_token_id, pad, video_token_id = recorded.token_ids()
    params = plan_json["params"]
    return Manifest(
        ranks=ranks, dp=params["dp"], micro_batches=micro, steps=steps,
        qv=params["qv"], qt=params["qt"], model=recorded.model.to_dict(),
        tokenizer=recorded.tokenizer.to_dict(),
        image_token_id=image_token_id, pad_token_id=pad, video_token_id=video_token_id,
        tiling=recorded.source_tilings(),
        plan={"path": os.path.abspath(cfg.plan), "algorithm": plan_json["algorithm"],
              "sha256": identity["plan_sha256"]},
        stats={"path": os.path.abspath(cfg.stats), "sha256": identity["stats_sha256"]},
        shard_bytes=shard_bytes, shards=entries, fingerprint=fingerprint,
        vlmshard_version=__version__,
        groups=[{k: g[k] for k in ("length", "qv", "sp", "rank_qv")} for g in plan_json["groups"]]
        if step_groups else [], step_groups=step_groups)


# ---------------------------------------------------------------------------------------------
# Worker


class ShardWriter:
    """Per-process state (the memory-mapped sample table, a tokenizer if needed); writes shards."""

    def __init__(self, spec: WriteSpec) -> None:
        self.spec = spec
        self.table = _open_sample_table(spec.samples_path)
        self.staged = staging.StagedRows(os.path.join(spec.out, WORK, "staged"),
                                         spec.staged_units)

    def process(self, unit: ShardUnit) -> dict:
        """Write one shard atomically, then its marker; returns its manifest entry."""
        import webdataset

        from .reader import record_index  # webdataset, so torch: only where shards are written

        rel = shard_path(unit.rank, unit.index)
        path = os.path.join(self.spec.out, *rel.split("/"))

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                with webdataset.TarWriter(f, encoder=False, mtime=TAR_MTIME, user="",
                                          group="") as tar:
                    for step, micro, ids in unit.records:
                        tar.write(self._record(unit.rank, step, micro, ids))

        atomic_write(path, write)
        offsets, crc32, sha256, size = record_index(path)
        entry = ShardEntry(path=rel, rank=unit.rank, index=unit.index,
                           first_step=unit.first_step, end_step=unit.end_step,
                           records=len(unit.records),
                           samples=sum(len(ids) for _, _, ids in unit.records),
                           bytes=size, sha256=sha256, offsets=offsets, crc32=crc32)
        write_json_atomic(_marker_path(os.path.join(self.spec.out, WORK), unit.rank,
                                       unit.index), asdict(entry))
        return asdict(entry)

    def _record(self, rank: int, step: int, micro: int, ids: tuple[int, ...]) -> dict:
        rows = self.table.take(pa.array(ids, pa.int64())).to_pylist()
        tokens = []
        images: list[bytes] = []
        samples = []
        for row in rows:
            staged = self.staged.get(row["sample_id"]) or {}
            tokens.append((row["input_ids"], row["labels"]) if "input_ids" in row
                          else (staged["input_ids"], staged["labels"]))
            names = []
            own = staged.get("images") or []
            own_videos = staged.get("videos") or []
            videos = {v["item"]: (k, v) for k, v in enumerate(row.get("videos") or [])}
            pictures = enumerate(zip(row["image_paths"], row["image_sizes"]))
            video_meta = []
            for item in range(len(row["image_paths"]) + len(videos)):  # in token order
                if item in videos:
                    k, video = videos[item]
                    video_meta.append(self._video(row, video, k, own_videos, images))
                    continue
                k, (path, size) = next(pictures)
                data, fmt = _read_image(row, path, size, own[k] if k < len(own) else None)
                names.append(image_name(len(images), path, fmt))
                images.append(data)
            sample = {"sample_id": row["sample_id"], "source": row["source"], "row": row["row"],
                      "seq_len": row["seq_len"], "loss_tokens": row["loss_tokens"],
                      "image_tiles": row["image_tiles"], "images": names}
            if video_meta:
                sample["videos"] = video_meta
            samples.append(sample)
        input_ids = np.concatenate([np.asarray(t[0], np.int32) for t in tokens])
        labels = np.concatenate([np.asarray(t[1], np.int32) for t in tokens])
        return encode_record(step, rank, micro, samples, input_ids, labels, images)


    def _video(self, row: dict, video: dict, index: int, staged: list, images: list[bytes]
               ) -> dict:
        """Append a video's sampled frames to ``images`` (lossless PNGs decoded from its
        container; a frame list's own files' bytes) and return its record entry."""
        own = staged[index] if index < len(staged) and staged[index] else [None] * len(
            video["paths"])
        if not video["frame_list"]:
            frames = _video_frames(row, video, own[0])
        else:
            frames = [_read_image(row, video["paths"][i], {"w": video["w"], "h": video["h"]},
                                  own[i]) for i in video["frames"]]
        names = []
        for data, fmt in frames:
            names.append(image_name(len(images), video["paths"][0], fmt))
            images.append(data)
        keys = ("frame_list", "total_frames", "fps", "w", "h", "grid", "tiles", "tokens",
                "seconds_per_step", "item")
        return {"frames": names, "indices": video["frames"], **{k: video[k] for k in keys}}


def _video_frames(row: dict, video: dict, data: bytes | None) -> list[tuple[bytes, str]]:
    """A container's sampled frames as PNGs, decoded once, checked to be the video the plan was
    made from (same size and frame count)."""
    from vlmshard.preprocess.videos import read_video_header, sampled_frames
    from vlmshard.rejects import Reject

    path = video["paths"][0]
    if data is None and path.startswith(EMBEDDED):
        raise WriteError(f"{sample_where(row)}: the row no longer embeds video {path}; the "
                         "source changed since packing: preprocess and pack again")
    data = _file_bytes(row, path) if data is None else data
    try:
        header = read_video_header(path, data)
        if (header.width, header.height, header.frames) != (video["w"], video["h"],
                                                           video["total_frames"]):
            raise WriteError(f"{sample_where(row)}: video {path} is {header.width}x"
                             f"{header.height}, {header.frames} frames now but was {video['w']}x"
                             f"{video['h']}, {video['total_frames']} frames when preprocessed; "
                             "preprocess and pack again")
        return [(_png(frame), "PNG") for frame in sampled_frames(data, video["frames"], path)]
    except Reject as e:
        raise WriteError(f"{sample_where(row)}: video {path} does not decode ({e.reason}: "
                         f"{e.message}); restore it, or preprocess (with --decode-videos, which "
                         "rejects streams that stop decoding) and pack again") from e


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _file_bytes(row: dict, path: str) -> bytes:
    try:
        return read_bytes(path)
    except OSError as e:  # read_bytes' RemoteReadError is one too
        raise WriteError(f"{sample_where(row)}: file vanished since preprocessing: {path} ({e}); "
                         "restore it, or preprocess and pack again") from e


def _read_image(row: dict, path: str, size: dict, data: bytes | None) -> tuple[bytes, str]:
    """An image's bytes (``data`` when its row embeds them, else its file's), checked to be the
    image the plan was made from (same size)."""
    from PIL import Image

    if data is None and path.startswith(EMBEDDED):
        raise WriteError(f"{sample_where(row)}: the row no longer embeds image {path}; the "
                         "source changed since packing: preprocess and pack again")
    try:
        data = read_bytes(path) if data is None else data
    except OSError as e:  # read_bytes' RemoteReadError is one too
        raise WriteError(f"{sample_where(row)}: image vanished since preprocessing: {path} ({e}); "
                         "restore it, or preprocess and pack again") from e
    try:
        with Image.open(io.BytesIO(data)) as im:
            (w, h), fmt = im.size, im.format or ""
    except Exception as e:  # Pillow: UnidentifiedImageError, OSError, ValueError, SyntaxError...
        raise WriteError(f"{sample_where(row)}: image {path} no longer parses: {e}") from e
    if (w, h) != (size["w"], size["h"]):
        raise WriteError(f"{sample_where(row)}: image {path} is {w}x{h} now but was "
                         f"{size['w']}x{size['h']} when preprocessed; preprocess and pack again")
    return data, fmt
