"""The preprocess job: plan parts, run them on an engine, then finalize the stats table.

Output folder (Contract 1 of ``docs/design.md``)::

    OUT/stats/part-00000.parquet ...   accepted samples, dense sample_id in (source, row) order
    OUT/rejects.parquet                source, row, reason, message
    OUT/preprocess.json                config, tokenizer, tiling, per-source reconciliation, timings
    OUT/_work/                         committed parts of an unfinished job (removed at the end)

``preprocess.json`` is written last: its presence means the job finished. A rerun of a finished
job with the same fingerprint is a no-op; a rerun of an interrupted one resumes from its parts.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from vlmshard import __version__
from vlmshard.compat import check_transformers
from vlmshard.config import ConfigError
from vlmshard.fleet import resolve_workers, run_units
from vlmshard.errors import InputError, JobError
from vlmshard.families import (
    DEMO_FAMILY,
    ModelFolderError,
    ModelSpec,
    TilingPolicy,
    families,
    family,
    load_model,
)
from vlmshard.io import atomic_write, is_url, write_json_atomic, write_parquet
from vlmshard.jobs import WORK, claim_output, locked_output
from vlmshard.progress import Progress
from vlmshard.rejects import REASONS, UNSUPPORTED
from vlmshard.stage import Result

from .config import PreprocessConfig
from .registry import reader
from .conversation import TEXT_ENCODING, format_hint, missing_columns
from .sample import SampleLimits, SampleSpec, make_encoder
from .schema import REJECTS_SCHEMA, stats_schema
from .sources import (
    Source,
    SourceIndex,
    discover_sources,
    first_record,
    index_source,
    plan_parts,
)
from .tokenize import TokenizerConfig, tekken_tokenizer
from .worker import JobSpec, PartWorker, committed_summary, part_paths

log = logging.getLogger(__name__)

class RejectRatioExceeded(JobError):
    """More rows were rejected than ``max_reject_ratio`` allows (exit status 3)."""

    exit_status = 3


class NothingAccepted(JobError):
    """A source whose every row was rejected for one reason, or a job that accepted no row: the
    data is not what the options say (a format, a column name), not a few bad rows. (A whole
    file that does not parse stays one ``unreadable_source`` reject while others are accepted.)"""


@dataclass
class PreprocessResult(Result):
    out: str
    input_rows: int
    accepted: int
    rejected: int
    parts: int
    parts_resumed: int  # parts found committed by an earlier, interrupted run
    seconds: float
    already_complete: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, out: str, report: dict, parts: int, resumed: int, seconds: float,
           already_complete: bool = False) -> PreprocessResult:
        """The result a finished job's ``preprocess.json`` (``report``) tells."""
        totals = report["totals"]
        return cls(out=out, input_rows=totals["input_rows"], accepted=totals["accepted"],
                   rejected=totals["rejected"], parts=parts, parts_resumed=resumed,
                   seconds=seconds, already_complete=already_complete,
                   rejected_by_reason=report["rejected_by_reason"])

    def summary(self) -> str:
        return (f"{self.accepted} accepted, {self.rejected} rejected of {self.input_rows} rows "
                f"-> {self.out}{' (already complete)' if self.already_complete else ''}")


def run_preprocess(cfg: PreprocessConfig) -> PreprocessResult:
    """Run (or resume, or skip) a preprocess job; see the module docstring for the outputs. A
    second job on the same ``out`` while this one runs is refused (``ConfigError``)."""
    start = time.monotonic()
    with locked_output(cfg.out, ConfigError):
        return _preprocess(cfg, start)


def _preprocess(cfg: PreprocessConfig, start: float) -> PreprocessResult:
    try:  # what the inputs and the model folder are is the job's configuration
        sources = discover_sources(cfg.inputs, cfg.image_root, cfg.row_format(), cfg.split,
                                   cfg.datasets)
        model, tokenizer, tiling = resolve_model(cfg)
    except InputError as e:  # ours only: a bug's ValueError stays a bug with its traceback
        raise ConfigError(str(e)) from e
    limits = SampleLimits(max_seq_len=cfg.max_seq_len, cutoff_len=cfg.cutoff_len,
                          max_image_pixels=cfg.max_image_pixels,
                          max_video_seconds=cfg.max_video_seconds, decode_videos=cfg.decode_videos,
                          allow_outside_image_root=cfg.allow_outside_image_root)
    identity = _job_identity(cfg, sources, model, tokenizer, tiling, limits)

    def tokenizer_loads() -> None:
        """A folder whose tokenizer cannot load fails before the job claims OUT (a finished
        job's identity holds the same folder's bytes: it loaded then)."""
        try:
            make_encoder(tokenizer, model)
        except InputError as e:
            raise ConfigError(str(e)) from e

    fingerprint, done = claim_output(cfg.out, "preprocess.json", identity, error=ConfigError,
                                     recorded_as="config", before_claim=tokenizer_loads)
    if done is not None:
        log.info("%s is already complete (same inputs and config): nothing to do", cfg.out)
        return PreprocessResult.of(cfg.out, done, len(done["stats_files"]), 0,
                                   time.monotonic() - start, already_complete=True)
    final_path = os.path.join(cfg.out, "preprocess.json")
    work_dir = os.path.join(cfg.out, WORK)
    parts_dir = os.path.join(work_dir, "parts")
    os.makedirs(parts_dir, exist_ok=True)

    t_index = time.monotonic()
    indexes = [index_source(s) for s in sources]
    for source, index in zip(sources, indexes):
        _check_columns(source, index)
    parts = plan_parts(sources, indexes, cfg.part_size, cfg.seed)
    total_rows = sum(len(p.rows) for p in parts)
    index_seconds = time.monotonic() - t_index
    summaries = {p.index: committed_summary(parts_dir, p.index) for p in parts}
    todo = [p for p in parts if summaries[p.index] is None]
    todo_rows = sum(len(p.rows) for p in todo)
    resumed = len(parts) - len(todo)
    log.info("%d source(s), %d row(s) in %d part(s)%s", len(sources), total_rows, len(parts),
             f"; resuming, {resumed} part(s) already committed" if resumed else "")

    spec = JobSpec(samples=SampleSpec(sources=tuple(sources), model=model, tokenizer=tokenizer,
                                      tiling=tiling.to_dict(), limits=limits),
                   keep_tokens=cfg.keep_tokens, parts_dir=parts_dir)
    t_process = time.monotonic()
    workers = resolve_workers(cfg.engine, cfg.workers)
    results = run_units(PartWorker, spec, todo, cfg.engine, workers, cfg.ray_address)
    with Progress(total=todo_rows, desc="preprocess", unit="rows") as progress:
        for summary in results:
            summaries[summary["part"]] = summary
            progress.update(summary["rows"])
    process_seconds = time.monotonic() - t_process

    t_final = time.monotonic()
    report = _finalize(cfg, sources, parts_dir, [summaries[p.index] for p in parts])
    report.update({
        "vlmshard_version": __version__,
        "fingerprint": fingerprint,
        "config": identity,
        "engine": {"name": cfg.engine, "workers": workers, "ray_address": cfg.ray_address},
        "timings": {"index_seconds": round(index_seconds, 3),
                    "process_seconds": round(process_seconds, 3),
                    "finalize_seconds": round(time.monotonic() - t_final, 3),
                    "rows_per_second": round(todo_rows / max(process_seconds, 1e-9), 1),
                    "parts_resumed": resumed},
    })
    totals = report["totals"]
    _check_something_accepted(cfg, sources, indexes, report)
    _check_reject_ratio(cfg, report)
    write_json_atomic(final_path, report)
    shutil.rmtree(work_dir)
    seconds = time.monotonic() - start
    log.info("preprocess: %d accepted, %d rejected of %d rows in %.1fs -> %s",
             totals["accepted"], totals["rejected"], totals["input_rows"], seconds, cfg.out)
    return PreprocessResult.of(cfg.out, report, len(parts), resumed, seconds)


def _check_reject_ratio(cfg: PreprocessConfig, report: dict) -> None:
    totals = report["totals"]
    ratio = totals["rejected"] / max(1, totals["input_rows"])
    if cfg.max_reject_ratio is not None and ratio > cfg.max_reject_ratio:
        top = ", ".join(f"{r}={n}" for r, n in Counter(report["rejected_by_reason"]).most_common(5))
        raise RejectRatioExceeded(
            f"{totals['rejected']} of {totals['input_rows']} rows rejected ({ratio:.1%}) > "
            f"--max-reject-ratio {cfg.max_reject_ratio:.1%}; top reasons: {top}; "
            f"see {os.path.join(cfg.out, 'rejects.parquet')}")


def _check_columns(source: Source, index: SourceIndex) -> None:
    """A renamed column (``--columns``) that the source's first row lacks is a one-line error
    before any work."""
    if not source.format.columns:
        return
    record = first_record(source, index)
    missing = (missing_columns(record, source.format, reader(source.kind).columnar)
               if record is not None else [])
    if missing:
        raise ConfigError(f"source {source.name}: the column mapping names {', '.join(missing)}, "
                          f"which its first row lacks (it has: {', '.join(sorted(record))})")


def _check_something_accepted(cfg: PreprocessConfig, sources: list[Source],
                              indexes: list[SourceIndex], report: dict) -> None:
    """Raise ``NothingAccepted`` naming what the rows look like, or which inputs hold no row. The
    committed parts are removed first, so a rerun with the right options starts clean;
    ``rejects.parquet`` stays. A source with no row beside sources with rows is a warning."""
    rejects = os.path.join(cfg.out, "rejects.parquet")
    empty = [(s, i) for s, i in zip(sources, indexes)
             if not report["sources"][s.name]["input_rows"]]
    if len(empty) == len(sources):
        shutil.rmtree(os.path.join(cfg.out, WORK))
        raise NothingAccepted(f"no rows in {', '.join(_why_empty(s, i) for s, i in empty)}: "
                              "the job accepted nothing")
    for source, index in empty:
        log.warning("source %s: no rows in %s; it adds nothing to the job",
                    source.name, _why_empty(source, index))
    for source, index in zip(sources, indexes):
        entry = report["sources"][source.name]
        if entry["accepted"] or not entry["input_rows"]:
            continue
        reasons = entry["by_reason"]
        if report["totals"]["accepted"] and (len(reasons) > 1 or "unreadable_source" in reasons):
            # A source of many faults, or a whole file that does not parse (one reject), in a
            # job that accepts others: its rejects say it.
            continue
        if report["totals"]["accepted"] and set(reasons) <= UNSUPPORTED:
            # Data of a kind the model does not read (audio), named on purpose with the rest.
            log.warning("source %s: all %d row(s) rejected as %s; see %s", source.name,
                        entry["input_rows"], ", ".join(reasons), rejects)
            continue
        reason = max(reasons, key=reasons.get)
        if reason == "unreadable_source":  # the file does not parse: where, from its reject
            hint = first_reject_message(rejects, source.name)
        else:
            record = first_record(source, index)
            hint = format_hint(record, source.format) if record is not None else None
        shutil.rmtree(os.path.join(cfg.out, WORK))
        raise NothingAccepted(
            f"source {source.name}: all {entry['input_rows']} row(s) rejected"
            f"{f' as {reason}' if len(reasons) == 1 else f', most as {reason}'}"
            f"{f': {hint}' if hint else ''}; see {rejects}")


def first_reject_message(rejects: str, source: str) -> str | None:
    """The message of ``source``'s first reject in the ``rejects`` file (a JSON syntax error
    names its file, line and column)."""
    table = pq.read_table(rejects, columns=["source", "message"])
    return next((m for name, m in zip(table["source"].to_pylist(),
                                       table["message"].to_pylist()) if name == source), None)


def _why_empty(source: Source, index: SourceIndex) -> str:
    """The path of a source that gave no row, and why when its file has rows (repeat_time)."""
    if index.n_rows:
        return f"{source.path} (its {index.n_rows} row(s) at repeat_time {source.repeat_time:g})"
    return source.path


def resolve_model(cfg: PreprocessConfig) -> tuple[ModelSpec, TokenizerConfig, TilingPolicy]:
    """The model folder's family, tokenizer and tiling (or the demo's), with the options that
    adjust the tiling applied."""
    if cfg.model is not None:
        check_transformers()  # the folder's template and tokenizer are rendered by transformers
        try:
            model, tiling = load_model(cfg.model)
        except ModelFolderError as e:
            raise ConfigError(str(e)) from e
        tokenizer = TokenizerConfig(kind="model", path=model.path)
    else:
        name = cfg.tiling or DEMO_FAMILY
        if name not in families():
            raise ConfigError(f"--tiling {name}: not a model family (known: "
                              f"{', '.join(sorted(families()))})")
        tokenizer = tekken_tokenizer()
        tiling = family(name).default_tiling()
        model = ModelSpec(family=name, path=None)
    limited = tiling.with_limits(max_patches=cfg.max_patches, budget=cfg.tile_budget)
    if limited is not None:
        tiling = limited
    elif cfg.max_patches is not None:
        limits = [f.description for f in families().values()
                  if f.default_tiling().with_limits() is not None]
        raise ConfigError(f"--max-patches applies to {' or '.join(limits)} tiling, not "
                          f"{model.family}")
    return model, tokenizer, tiling


def _job_identity(cfg: PreprocessConfig, sources: list[Source], model: ModelSpec,
                  tokenizer: TokenizerConfig, tiling: TilingPolicy, limits: SampleLimits) -> dict:
    """What determines the output bytes (not the engine or worker count). Files are named by
    their resolved paths, so a rerun naming them another way (relative, ``./``, a symlink) is the
    same job; a file's content by its size and modification time."""

    def file_identity(path: str) -> dict:
        if is_url(path):
            return {"path": path}
        st = os.stat(path)
        return {"path": _resolved(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}

    def source_identity(source: Source) -> dict:
        return dict(source.to_dict(), path=_resolved(source.path),
                    image_root=_resolved(source.image_root), file=file_identity(source.path))

    return {
        "sources": [source_identity(s) for s in sources],
        "model": dict(model.to_dict(), path=model.path and _resolved(model.path)),
        "tokenizer": tokenizer.to_dict(),
        "tiling": tiling.to_dict(),
        "limits": asdict(limits),
        "keep_tokens": cfg.keep_tokens,
        "text_encoding": TEXT_ENCODING,
        "part_size": cfg.part_size,
        "seed": cfg.seed,
    }


def _resolved(path: str) -> str:
    """A local path with its symlinks resolved; a URL as it is."""
    return path if is_url(path) else os.path.realpath(path)


def _finalize(cfg: PreprocessConfig, sources: list[Source], parts_dir: str,
              summaries: list[dict]) -> dict:
    """Assign dense sample ids, write ``stats/`` and ``rejects.parquet``, reconcile the counts."""
    stats_dir = os.path.join(cfg.out, "stats")
    os.makedirs(stats_dir, exist_ok=True)
    schema = stats_schema(cfg.keep_tokens)
    stats_files: list[str] = []
    reject_tables = []
    next_id = 0
    for summary in summaries:
        stats_path, rejects_path, _ = part_paths(parts_dir, summary["part"])
        reject_tables.append(pq.read_table(rejects_path))
        table = pq.read_table(stats_path)
        if table.num_rows == 0:
            continue
        ids = pa.array(range(next_id, next_id + table.num_rows), pa.int64())
        table = table.add_column(0, schema.field("sample_id"), ids).cast(schema)
        next_id += table.num_rows
        name = f"part-{len(stats_files):05d}.parquet"
        atomic_write(os.path.join(stats_dir, name), lambda tmp, t=table: write_parquet(t, tmp))
        stats_files.append(f"stats/{name}")
    for stale in sorted(set(glob.glob(os.path.join(stats_dir, "part-*.parquet")))
                        - {os.path.join(cfg.out, f) for f in stats_files}):
        os.unlink(stale)
    rejects = pa.concat_tables(reject_tables) if reject_tables else REJECTS_SCHEMA.empty_table()
    atomic_write(os.path.join(cfg.out, "rejects.parquet"),
                 lambda tmp: write_parquet(rejects, tmp))

    per_source = {s.name: {"input_rows": 0, "accepted": 0, "rejected": 0, "by_reason": Counter(),
                           "images": 0, "vit_tiles": 0, "seq_len": 0} for s in sources}
    for summary in summaries:
        entry = per_source[summary["source"]]
        entry["input_rows"] += summary["rows"]
        entry["accepted"] += summary["accepted"]
        entry["rejected"] += sum(summary["rejected"].values())
        entry["by_reason"].update(summary["rejected"])
        for key in ("images", "vit_tiles", "seq_len"):
            entry[key] += summary[key]
    by_reason: Counter = Counter()
    for name, entry in per_source.items():
        if entry["input_rows"] != entry["accepted"] + entry["rejected"]:
            raise AssertionError(f"source {name}: counts do not reconcile: {entry}")
        by_reason.update(entry["by_reason"])
        entry["by_reason"] = dict(sorted(entry["by_reason"].items()))
    totals = {key: sum(e[key] for e in per_source.values())
              for key in ("input_rows", "accepted", "rejected", "images", "vit_tiles", "seq_len")}
    if totals["accepted"] != next_id or totals["rejected"] != rejects.num_rows:
        raise AssertionError("part summaries disagree with the tables written")
    return {
        "stats_files": stats_files,
        "rejects_file": "rejects.parquet",
        "totals": totals,
        "rejected_by_reason": dict(sorted(by_reason.items())),
        "reasons": {r: REASONS[r] for r in sorted(by_reason)},
        "sources": per_source,
    }
