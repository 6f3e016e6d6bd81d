"""The pack job: stats in, ``plan.parquet`` + ``plan.json`` out (Contract 2 of ``docs/design.md``).

``plan.parquet`` has one row per placed sample, ``step, rank, micro, slot, sample_id``, sorted in
that order; the same stats, options and seed give the same bytes. Epoch e is packed with seed + e
and its steps follow epoch e − 1's. ``plan.json`` records the options, caps, cost model, metrics,
each epoch's step range and every sample that was not placed, with its reason: the same stats,
options and seed give the same bytes there too, wherever and whenever pack runs. The run's own
facts (where the stats and the plan were, the host, the timings) go to ``plan.run.json``.

A rerun with the same stats, options and cost model finds the finished plan (its fingerprint in
``plan.json``, ``plan.parquet``'s sha256 intact) and leaves the files as they are; anything else
packs again and replaces them. One pack at a time per folder (``vlmshard.jobs.locked_output``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

import numpy as np
import pyarrow as pa

from vlmshard import __version__
from vlmshard.errors import ConfigError, InputError
from vlmshard.io import (arrow_column, atomic_write, read_json, sha256_file,
                         write_json_atomic, write_parquet)
from vlmshard.jobs import fingerprint as job_fingerprint
from vlmshard.jobs import locked_output
from vlmshard.model_sizes import sequence_parallel_refusal
from vlmshard.stage import Result

from . import algorithms
from .algorithms import BalancedOptions, Caps
from .batches import Lengths, Packing, concat_steps
from .config import PADDED, PackConfig
from .cost import (CostModel, cost_model_file, model_for_stats, read_cost_model,
                   resolve_cost_model)
from .groups import (Group, GroupedPacking, Refusal, format_group_table, given_groups,
                     group_table, is_grouped, largest_unit, pack_groups, parse_groups,
                     search_groups)
from .metrics import Metrics, format_metrics
from .stats import StatsError, load_stats, read_media_units

log = logging.getLogger(__name__)

RUN_FACTS = "plan.run.json"  # where and when the plan was made: not part of the plan
RUN_METRICS = ("pack_seconds",)  # measured, not computed: kept with the run's facts

PLAN_SCHEMA = pa.schema([
    pa.field("step", pa.int32(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("micro", pa.int16(), nullable=False),
    pa.field("slot", pa.int16(), nullable=False),
    pa.field("sample_id", pa.int64(), nullable=False),
])
# A grouped plan's rows also name their step's packing group (plan.json's ``groups``).
GROUP_FIELD = pa.field("group", pa.int16(), nullable=False)


@dataclass
class PackResult(Result):
    out: str
    metrics: Metrics
    unplaced_by_reason: dict[str, int]
    groups: list[dict]  # plan.json's groups

    @property
    def grouped(self) -> bool:
        return is_grouped(self.groups)

    def summary(self) -> str:
        m = self.metrics
        return (f"{m.samples} samples in {m.steps} steps, cost efficiency "
                f"{m.cost_efficiency:.3f}, LLM dist ratio {m.llm_dist_ratio:.4f} -> {self.out}")

    def text(self) -> str:
        lines = [format_metrics(self.metrics.report())]
        if self.grouped:
            lines += [f"groups (communication_ratio {self.metrics.communication_ratio:.4f}):",
                      format_group_table(self.groups)]
        if self.unplaced_by_reason:
            lines.append("unplaced: " + ", ".join(f"{n} {r}" for r, n in
                                                  self.unplaced_by_reason.items()))
        return "\n".join(lines + [f"plan written to {self.out}/plan.parquet"])

    def to_json(self) -> dict:
        if self.grouped:
            return {**self.metrics.report(),
                    "communication_ratio": self.metrics.communication_ratio,
                    "groups": self.groups}
        return self.metrics.report()


def run_pack(cfg: PackConfig) -> PackResult:
    """Pack (or find already packed) the plan of ``cfg``; see the module docstring. A second job
    on the same ``out`` while this one runs is refused (``ConfigError``)."""
    with locked_output(cfg.out, ConfigError):
        return _pack(cfg)


def _pack(cfg: PackConfig) -> PackResult:
    t0 = time.perf_counter()
    if cfg.cost_model:  # a profile's folder for its cost_model.json; a run's folder, refit
        cfg.cost_model = resolve_cost_model(cfg.cost_model)
    stats = load_stats(cfg.stats)
    lengths = stats.lengths
    cost = (read_cost_model(cfg.cost_model) if cfg.cost_model
            else CostModel.for_stats(cfg.model, stats.family, stats.model_folder, stats.unit_px,
                                     cfg.recipe))
    t_loaded = time.perf_counter()
    fingerprint = job_fingerprint({
        "vlmshard_version": __version__, "stats_sha256": stats.sha256, "cost_model": cost.to_dict(),
        "cost_model_file": cost_model_file(cfg.cost_model) if cfg.cost_model else None,
        "options": {k: v for k, v in asdict(cfg).items() if k not in ("out", "cost_model")}})
    finished = _finished_plan(cfg.out, fingerprint)
    if finished is not None:
        log.info("%s is already complete (same stats, options and cost model): nothing to do",
                 cfg.out)
        return PackResult(cfg.out, Metrics(**finished["metrics"]),
                          finished["unplaced_by_reason"], finished["groups"])
    groups, caps_from, search = choose_groups(cfg, lengths, cost, sp_refusal(cfg, stats, cost))
    epochs, packings = [], []
    first_step = 0
    for epoch in range(cfg.epochs):
        packing = pack_plan_epoch(cfg, lengths, groups, cost, seed=cfg.seed + epoch)
        epochs.append({"epoch": epoch, "seed": cfg.seed + epoch, "first_step": first_step,
                       "steps": packing.steps})
        first_step += packing.steps
        packings.append(packing)
    _check_placed(cfg, lengths, groups, packings[0], caps_from)
    pack_seconds = time.perf_counter() - t_loaded
    plan = GroupedPacking.concat(packings)
    metrics, each = plan.measure(lengths, cost, cfg.dp, cfg.compute_mode,
                                 padded=cfg.algo in PADDED, pack_seconds=pack_seconds)
    media = (read_media_units(cfg.stats)
             if stats.format == "vlmshard" and any(g.sp > 1 for g in groups) else None)
    table = group_table(plan, each, lengths, cfg.ranks, media)
    unplaced = [{"epoch": e, "sample_id": int(s), "reason": r}
                for e, p in enumerate(packings) for s, r in zip(p.unplaced, p.unplaced_reason)]
    by_reason = dict(sorted(Counter(u["reason"] for u in unplaced).items()))

    os.makedirs(cfg.out, exist_ok=True)
    plan_parquet = os.path.join(cfg.out, "plan.parquet")
    write_plan_parquet(plan_parquet, plan)
    # The run's facts first: a plan.json present is a finished plan.
    write_json_atomic(os.path.join(cfg.out, RUN_FACTS), {
        "stats": os.path.abspath(cfg.stats), "out": os.path.abspath(cfg.out),
        "host": socket.gethostname(), "pid": os.getpid(),
        "timings": {"load_seconds": t_loaded - t0, "pack_seconds": pack_seconds,
                    "total_seconds": time.perf_counter() - t0}})
    deterministic = {k: v for k, v in metrics.to_dict().items() if k not in RUN_METRICS}
    write_json_atomic(os.path.join(cfg.out, "plan.json"), {
        "vlmshard_version": __version__,
        "fingerprint": fingerprint,
        "plan_sha256": sha256_file(plan_parquet),
        "algorithm": cfg.algo,
        "stats": stats.describe(),
        "params": {**{k: v for k, v in asdict(cfg).items() if k not in ("stats", "out")},
                   "ranks": cfg.ranks, "qv": groups[-1].qv, "qt": groups[-1].length,
                   "caps_from": caps_from,
                   "balanced": asdict(BalancedOptions()) if cfg.algo == "balanced" else None,
                   "isf_iterations": algorithms.ISF_ITERATIONS if cfg.algo == "isf" else None},
        "cost_model": cost.to_dict(),
        "metrics": deterministic,
        "groups": table,
        "epochs": epochs,
        "unplaced_by_reason": by_reason,
        "unplaced": unplaced,
        "caps_search": search,
    })
    log.info("plan: %d steps x %d ranks x %d micro-batches, %d samples placed, %d unplaced -> %s",
             metrics.steps, cfg.ranks, cfg.micro_batches, metrics.samples, metrics.unplaced,
             cfg.out)
    return PackResult(cfg.out, metrics, by_reason, table)


def _check_placed(cfg: PackConfig, lengths, groups, packing: GroupedPacking,
                  caps_from: str) -> None:
    """Warn of groups too small for a step and of samples over the caps; a plan that places
    nothing, or leaves more than ``--max-unplaced-ratio`` over the caps, is an error."""
    for g, group in zip(groups, packing.packings):
        if len(groups) > 1 and not group.steps:
            log.warning("group %d:%d holds %d sample(s), too few for one step of its %d ranks: "
                        "they are unplaced (remainder)", g.length, g.sp, len(group.unplaced),
                        cfg.ranks // g.sp)
    over_cap = sum(r != "remainder" for r in packing.unplaced_reason)
    if packing.steps == 0:
        raise ConfigError(_places_nothing(cfg, packing, over_cap))
    if over_cap > cfg.max_unplaced_ratio * len(lengths):
        raise ConfigError(_too_many_unplaced(cfg, lengths, packing, caps_from))
    if over_cap:
        log.warning("%d samples exceed the caps on their own and are not placed", over_cap)


def _places_nothing(cfg: PackConfig, packing: GroupedPacking, over_cap: int) -> str:
    """Why a plan has no step: the samples within the caps do not fill one step of the ranks ×
    micro-batches (each micro-batch at least one sample, --target-samples for padded ones)."""
    fit = len(packing.unplaced) - over_cap
    per_micro = cfg.target_samples if cfg.algo in PADDED else 1
    need = cfg.ranks * cfg.micro_batches * per_micro
    ranks = f"{cfg.ranks} rank(s){'' if cfg.virtual_ranks is None else ' (--virtual-ranks)'}"
    step = (f"{ranks} × {cfg.micro_batches} micro-batch(es)"
            f"{f' × {per_micro} samples (--target-samples)' if per_micro > 1 else ''}")
    over = f" ({over_cap} more exceed the caps on their own)" if over_cap else ""
    why = (f"are too few for one step of {step}, which takes "
           f"{'at least ' if per_micro == 1 else ''}{need}" if fit < need
           else f"make no whole step of {step}: all are the remainder")
    return (f"the plan places no sample: {fit} sample(s){over} {why}; lower --dp"
            f"{'/--virtual-ranks' if cfg.virtual_ranks else ''}, --micro-batches"
            f"{', --target-samples' if per_micro > 1 else ''} or pack more samples (no plan "
            f"written to {cfg.out})")


def _too_many_unplaced(cfg: PackConfig, lengths: Lengths, packing: GroupedPacking,
                       caps_from: str) -> str:
    """Why a plan that leaves more than --max-unplaced-ratio of the samples over a cap is not
    written: how many break which cap, and the caps that would place them all."""
    over = [i for i, r in enumerate(packing.unplaced_reason) if r != "remainder"]
    ids = packing.unplaced[over]
    reasons = Counter(packing.unplaced_reason[i] for i in over)
    top, first = packing.groups[-1], packing.groups[0]
    rank_qv = first.qv // first.sp  # pack_groups' bound on one unit
    where = "the largest group's " if packing.grouped else ""
    broken = {"tiles_over_qv": f"over {where}Qv {top.qv}",
              "tokens_over_qt": f"over {where}Qt {top.length}",
              "unit_over_rank_qv": f"with an image or a video's temporal step over one "
                                   f"rank's Qv {rank_qv}"}
    n, total = len(ids), len(lengths)
    return (f"the plan leaves {n} of {total} samples ({n / total:.1%}) out over the caps, more "
            f"than --max-unplaced-ratio {cfg.max_unplaced_ratio:g}: "
            + ", ".join(f"{reasons[r]} {broken[r]} ({r})" for r in broken if reasons[r])
            + f"; to place them, {_caps_to_raise(cfg, lengths, ids, top, rank_qv, caps_from)}"
              f", or raise --max-unplaced-ratio (no plan written to {cfg.out})")


def _caps_to_raise(cfg: PackConfig, lengths: Lengths, ids: np.ndarray, top: Group,
                   rank_qv: int, caps_from: str) -> str:
    """The options, and their values, that would place the samples ``ids`` over the caps of
    the plan whose largest group is ``top``: the caps given, the memory bound searched under,
    isf's caps, or under packing groups one rank's bound (the largest group spreads a sample
    over its SP ranks; a rank encodes each image or video step whole, ``rank_qv`` at most) or the
    largest group's length when ``--groups`` names it."""
    tiles, tokens = lengths.tiles[ids], lengths.tokens[ids]
    over_v = int(tiles[tiles > top.qv].max(initial=0))
    over_t = int(tokens[tokens > top.length].max(initial=0))
    if caps_from == "isf_search":
        return (f"give isf --qv {max(top.qv, int(tiles.max()))} "
                f"--qt {max(top.length, int(tokens.max()))}")
    if cfg.groups is None:
        flags = ("--qv", "--qt") if caps_from == "given" else ("--max-qv", "--max-qt")
        fixes = [(flags[0], over_v), (flags[1], over_t)]
    else:
        unit = (lengths.largest[ids] if lengths.largest is not None
                else np.zeros(len(ids), np.int64))
        rank_v = max(-(-over_v // top.sp), int(unit[unit > rank_qv].max(initial=0)))
        fixes = [("--max-qv", rank_v), ("--max-qt", -(-over_t // top.sp))
                 if parse_groups(cfg.groups) is None else ("the largest --groups length", over_t)]
    return "raise " + " and ".join(f"{flag} to {need}" for flag, need in fixes if need)


def _finished_plan(out: str, fingerprint: str) -> dict | None:
    """``plan.json`` when ``out`` holds the plan this fingerprint names, whole; else None."""
    info_path, parquet = os.path.join(out, "plan.json"), os.path.join(out, "plan.parquet")
    if not (os.path.exists(info_path) and os.path.exists(parquet)):
        return None
    info = read_plan_json(out)
    if info.get("fingerprint") != fingerprint or info.get("plan_sha256") != sha256_file(parquet):
        return None
    return info


def choose_caps(cfg: PackConfig, lengths: Lengths,
                cost: CostModel) -> tuple[Caps, str, dict | None]:
    """The caps, where they came from and what a search tried (its candidates; for balanced
    also the memory bound): given, searched for the best step_efficiency under the memory bound
    (balanced), OmniBal's search (isf), or the padded shape (random, lengthgroup)."""
    if cfg.algo in PADDED:
        return algorithms.padded_caps(lengths, cfg.target_samples), "padded", None
    if cfg.qv is not None:
        return Caps(cfg.qv, cfg.qt), "given", None
    if cfg.algo == "isf":
        caps, tried = algorithms.search_isf_caps(
            lengths, ranks=cfg.ranks, target_samples=cfg.target_samples, seed=cfg.seed, cost=cost)
        return caps, "isf_search", {"tried": tried}
    bound, bound_from = caps_bound(cfg, lengths)
    caps, tried = algorithms.search_balanced_caps(
        lengths, bound, per_step=cfg.ranks * cfg.micro_batches, seed=cfg.seed, cost=cost,
        mode=cfg.compute_mode)
    log.info("caps Qv %d, Qt %d: the best step_efficiency (%s) of %d candidates within Qv <= "
             "%d, Qt <= %d (%s)", caps.qv, caps.qt, cfg.compute_mode, len(tried), bound.qv,
             bound.qt, bound_from)
    return caps, "step_efficiency_search", {
        "bound": {"qv": bound.qv, "qt": bound.qt, "from": bound_from}, "tried": tried}


def caps_bound(cfg: PackConfig, lengths: Lengths) -> tuple[Caps, str]:
    """The memory bound balanced's caps are searched under, and where it came from:
    ``--max-qv/--max-qt``, else the ``max_qv``/``max_qt`` that ``vlmshard train profile`` wrote
    into the ``--cost-model`` file (what the device's memory holds), else ``--target-samples``."""
    profiled = cost_model_file(cfg.cost_model) if cfg.cost_model else {}
    if cfg.max_qv is not None or cfg.max_qt is not None:
        given, origin = (cfg.max_qv, cfg.max_qt), "--max-qv/--max-qt"
    elif "max_qv" in profiled and "max_qt" in profiled:
        given = (int(profiled["max_qv"]), int(profiled["max_qt"]))
        origin = f"the profile's memory model ({cfg.cost_model})"
    else:
        given, origin = (None, None), "--target-samples"
    return algorithms.memory_bound(lengths, cfg.target_samples, *given), origin


def sp_refusal(cfg: PackConfig, stats, cost: CostModel) -> Refusal:
    """Why the model the plan is for (``--model``, else the stats' folder or family preset)
    cannot take an SP degree (``model_sizes.sequence_parallel_refusal``), for the groups to
    avoid what the trainer would refuse."""
    if cfg.groups is None:
        return lambda sp: None
    llm = model_for_stats(cfg.model, stats.family, stats.model_folder, stats.unit_px).llm
    if not cost.c_sp:
        log.warning("the cost model (%s) prices no sequence-parallel exchange (c_sp): the "
                    "groups are chosen as if it were free", cost.origin)
    return lambda sp: sequence_parallel_refusal(llm, sp)


def choose_groups(cfg: PackConfig, lengths: Lengths, cost: CostModel,
                  refusal: Refusal) -> tuple[tuple[Group, ...], str, dict | None]:
    """The plan's groups, where they came from and what a search tried: without --groups one
    group of SP 1 whose caps ``choose_caps`` chooses; else the groups named, or ``auto``'s,
    within one rank's memory bound (``caps_bound``, as plain pack takes it: a default never
    below the largest sample, so only a bound the user or the profile gives sends samples to
    sequence parallelism), at SP degrees the model can take (``refusal``)."""
    if cfg.groups is None:
        caps, caps_from, search = choose_caps(cfg, lengths, cost)
        return (Group(caps.qt, caps.qv, 1, caps.qv),), caps_from, search
    rank, rank_from = caps_bound(cfg, lengths)
    bound = {"rank_bound": {"qv": rank.qv, "qt": rank.qt, "from": rank_from}}
    spec = parse_groups(cfg.groups)
    if spec is not None:
        return (given_groups(spec, rank, cfg.dp, refusal, largest_unit(lengths, rank.qv)),
                "given", bound)
    groups, tried = search_groups(lengths, rank, dp=cfg.dp, ranks=cfg.ranks,
                                  micro_batches=cfg.micro_batches, seed=cfg.seed, cost=cost,
                                  mode=cfg.compute_mode, refusal=refusal)
    log.info("groups %s: the best step_efficiency of %d candidates, one rank holding Qv %d, "
             "Qt %d (%s)", ", ".join(f"{g.length}:{g.sp}" for g in groups), len(tried), rank.qv,
             rank.qt, rank_from)
    return groups, "groups_search", {**bound, "tried": tried}


def pack_plan_epoch(cfg: PackConfig, lengths: Lengths, groups: tuple[Group, ...],
                    cost: CostModel, *, seed: int) -> GroupedPacking:
    """One epoch of the plan: ``pack_epoch`` in its one group, or ``pack_groups``."""
    if cfg.groups is None:
        return GroupedPacking.single(groups[0], pack_epoch(cfg, lengths, groups[0].caps, cost,
                                                           seed=seed))
    return pack_groups(lengths, np.arange(len(lengths), dtype=np.int64), groups,
                       ranks=cfg.ranks, micro_batches=cfg.micro_batches, seed=seed, cost=cost,
                       mode=cfg.compute_mode, order=cfg.group_order)


def pack_epoch(cfg: PackConfig, lengths: Lengths, caps: Caps, cost: CostModel, *,
               seed: int) -> Packing:
    """One epoch of ``cfg.algo``; samples over a cap on their own come first among the unplaced."""
    ids, over, over_reasons = algorithms.split_over_cap(lengths, caps)
    if len(ids) == 0:
        raise ConfigError(f"--qv {caps.qv} --qt {caps.qt} leave out every sample: the smallest "
                          f"has {int(lengths.tiles.min())} tiles and "
                          f"{int(lengths.tokens.min())} tokens")
    common = {"ranks": cfg.ranks, "micro_batches": cfg.micro_batches, "seed": seed}
    if cfg.algo == "random":
        packing = algorithms.pack_random(lengths, ids, samples_per_micro=cfg.target_samples,
                                         **common)
    elif cfg.algo == "lengthgroup":
        packing = algorithms.pack_lengthgroup(lengths, ids, samples_per_micro=cfg.target_samples,
                                              **common)
    elif cfg.algo == "isf":
        packing = algorithms.pack_isf(lengths, ids, caps, **common)
    else:
        packing = algorithms.pack_balanced(lengths, ids, caps, cost=cost, mode=cfg.compute_mode,
                                           **common)
    packing.unplaced = np.r_[over, packing.unplaced].astype(np.int64)
    packing.unplaced_reason = over_reasons + packing.unplaced_reason
    return packing


@dataclass
class Repacked:
    """A plan's samples packed again by another algorithm (``repack``)."""

    packing: Packing  # over the stats' sample ids
    caps: Caps  # what it packed under: ``chosen``, raised to hold the largest of ``samples``
    chosen: Caps  # the algorithm's own caps (isf's search, the padded shape, balanced's search)
    samples: np.ndarray  # int64: the plan's samples (``plan_samples``), which it packed


def plan_samples(info: dict, n: int) -> np.ndarray:
    """The samples a plan (its ``plan.json``) packs, of its stats' ``n``: all but those it
    leaves out over a cap. Those left as a remainder are packed too (each epoch reshuffles
    them in), and the over-cap ones are the same in every epoch."""
    over = [u["sample_id"] for u in info["unplaced"] if u["reason"] != "remainder"]
    return np.setdiff1d(np.arange(n, dtype=np.int64), np.asarray(over, np.int64))


def repack(info: dict, lengths: Lengths, algo: str, mode: str) -> Repacked:
    """The plan's samples packed again with ``algo`` for a trainer computing in ``mode``, with
    the plan's ranks, micro-batches, epochs, seed, cost model and memory bound: what a plan is
    compared with. The comparison holds only over equal samples, so where ``algo``'s own caps
    (isf's search) would leave some of them out, the caps are raised to hold the largest; what
    fills no whole step is its remainder, as in the plan."""
    params = info["params"]
    bound = (info.get("caps_search") or {}).get("bound") or {}  # the plan's memory bound
    cfg = PackConfig(stats=info["run"].get("stats", ""), dp=params["dp"], out="", algo=algo,
                     micro_batches=params["micro_batches"],
                     virtual_ranks=params["virtual_ranks"], epochs=params["epochs"],
                     target_samples=params["target_samples"], seed=params["seed"],
                     compute_mode=mode, max_qv=bound.get("qv"), max_qt=bound.get("qt"))
    cost = CostModel(**info["cost_model"])
    ids = plan_samples(info, len(lengths))
    own = lengths.take(ids)
    chosen, _, _ = choose_caps(cfg, own, cost)
    caps = Caps(max(chosen.qv, int(own.tiles.max(initial=0))),
                max(chosen.qt, int(own.tokens.max(initial=0))))
    packing = concat_steps([pack_epoch(cfg, own, caps, cost, seed=cfg.seed + epoch)
                            for epoch in range(cfg.epochs)])
    return Repacked(replace(packing, items=ids[packing.items], unplaced=ids[packing.unplaced]),
                    caps, chosen, ids)


def write_plan_parquet(path: str, plan: GroupedPacking) -> None:
    """One row per placed sample in (step, rank, micro, slot) order; ``rank`` is the rank among
    the group's data-parallel ranks (the plan's ranks ÷ its SP degree)."""
    columns = []
    for g, packing in enumerate(plan.packings):
        micro_of_item = packing.micro_of_item()
        per_step = packing.ranks * packing.micro_batches
        step = np.flatnonzero(plan.order == g)[micro_of_item // per_step]
        slot = np.arange(len(packing.items)) - packing.offsets[micro_of_item]
        columns.append([step, (micro_of_item // packing.micro_batches) % packing.ranks,
                        micro_of_item % packing.micro_batches, slot, packing.items,
                        np.full(len(packing.items), g)])
    merged = [np.concatenate(c) for c in zip(*columns)]
    order = np.argsort(merged[0], kind="stable")
    schema = PLAN_SCHEMA.append(GROUP_FIELD) if plan.grouped else PLAN_SCHEMA
    table = pa.Table.from_arrays(
        [arrow_column(c[order].astype(f.type.to_pandas_dtype())) for c, f in zip(merged, schema)],
        schema=schema)
    atomic_write(path, lambda tmp: write_parquet(table, tmp))


def read_plan_json(plan_dir: str) -> dict:
    """``plan.json`` with the run's facts from ``plan.run.json`` under ``"run"`` (empty when that
    file is gone) and ``pack_seconds`` back among the metrics (0 then), as readers print them."""
    path = os.path.join(plan_dir, "plan.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{plan_dir}: no plan.json here (write one with vlmshard pack)")
    info = read_json(path)
    if not isinstance(info.get("metrics"), dict):
        raise InputError(f"{path} has no metrics: pack it again with this vlmshard")
    facts = os.path.join(plan_dir, RUN_FACTS)
    info["run"] = read_json(facts) if os.path.exists(facts) else {}
    info["metrics"]["pack_seconds"] = info["run"].get("timings", {}).get("pack_seconds", 0.0)
    return info


def plan_stats_path(info: dict, plan_dir: str) -> str:
    """Where the stats a plan was packed from were (its run facts record them)."""
    if not info["run"].get("stats"):
        raise StatsError(f"{plan_dir}: {RUN_FACTS} is missing, so where its stats are is unknown "
                         "(copy it along with plan.json, or pack again)")
    return info["run"]["stats"]


def read_plan(plan_dir: str) -> tuple[dict, Packing]:
    """``plan.json`` and ``plan.parquet`` read back as the Packing that pack measured, so that
    readers recompute exactly the loads behind the recorded metrics; a grouped plan is refused
    (``read_grouped_plan`` reads it)."""
    info, plan = read_grouped_plan(plan_dir)
    if plan.grouped:
        groups = info["groups"]
        raise InputError(f"{plan_dir} is a plan of {len(groups)} packing group(s) with sequence "
                         f"parallelism up to {max(g['sp'] for g in groups)} (vlmshard pack "
                         f"--groups): report plots and the simulator read one-group plans only "
                         f"so far; its plan.json holds each group's figures")
    return info, replace(plan.packings[0], unplaced=plan.unplaced,
                         unplaced_reason=plan.unplaced_reason)


def read_grouped_plan(plan_dir: str) -> tuple[dict, GroupedPacking]:
    """``plan.json`` and ``plan.parquet`` read back as the plan pack measured: each group's
    Packing over its data-parallel ranks, and the group of each step."""
    import pyarrow.parquet as pq

    info = read_plan_json(plan_dir)
    path = os.path.join(plan_dir, "plan.parquet")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{plan_dir}: no plan.parquet here (write one with vlmshard pack)")
    table = pq.read_table(path)
    micro = info["params"]["micro_batches"]
    one = {"length": info["params"]["qt"], "qv": info["params"]["qv"], "sp": 1,
           "rank_qv": info["params"]["qv"]}
    groups = tuple(Group(g["length"], g["qv"], g["sp"], g["rank_qv"])
                   for g in info.get("groups") or [one])
    step = table["step"].to_numpy().astype(np.int64)
    group = (table["group"].to_numpy().astype(np.int64) if "group" in table.column_names
             else np.zeros(len(step), np.int64))
    steps = info["metrics"]["steps"]
    if len(step) and not (0 <= step.min() and step.max() < steps
                          and 0 <= group.min() and group.max() < len(groups)):
        raise InputError(f"{path}: steps {step.min()}..{step.max()} or groups "
                         f"{group.min()}..{group.max()} fall outside the {steps} steps and "
                         f"{len(groups)} groups plan.json records")
    order = np.zeros(steps, np.int64)
    order[step] = group
    packings = []
    for g, spec in enumerate(groups):
        ranks = info["params"]["ranks"] // spec.sp
        rows = group == g
        local = np.cumsum(order == g) - 1  # each step's place among its group's
        n_micro = int((order == g).sum()) * ranks * micro
        mb = ((local[step[rows]] * ranks + table["rank"].to_numpy()[rows]) * micro
              + table["micro"].to_numpy()[rows])
        if np.any(np.diff(mb) < 0) or (len(mb) and not 0 <= mb[0] <= mb[-1] < n_micro):
            raise InputError(f"{path}: group {g}'s rows are not in (step, rank, micro, slot) "
                             f"order within its {n_micro} micro-batches")
        offsets = np.zeros(n_micro + 1, np.int64)
        np.cumsum(np.bincount(mb, minlength=n_micro), out=offsets[1:])
        packings.append(Packing(table["sample_id"].to_numpy()[rows].astype(np.int64), offsets,
                                ranks, micro, np.array([], np.int64), []))
    unplaced = info["unplaced"]
    return info, GroupedPacking(groups, packings, order,
                                np.array([u["sample_id"] for u in unplaced], np.int64),
                                [u["reason"] for u in unplaced])


def load_plan(plan_dir: str) -> tuple[dict, Packing, Lengths]:
    """A plan with the stats it was packed from, checked by their sha256."""
    info, packing = read_plan(plan_dir)
    path = plan_stats_path(info, plan_dir)
    try:
        stats = load_stats(path)
    except StatsError as e:
        raise StatsError(f"{plan_dir}: cannot read the stats it was packed from: {e}") from e
    if stats.sha256 != info["stats"]["sha256"]:
        raise InputError(f"{path} is no longer the stats {plan_dir} was packed from (sha256 "
                         "differs): pack again")
    return info, packing, stats.lengths
