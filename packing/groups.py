"""Packing groups: Hierarchical Balance Packing (Yao et al., arXiv 2503.07680; ModelTC/HBP).

One packing length cannot serve short and long samples: a cap long enough for the longest
sample sends every micro-batch through sequence parallelism (SP) and leaves ranks that drew a
long sample's quadratic attention far behind the others. A grouped plan has several groups, each
with its own packing length (its Qt), ViT cap (Qv) and SP degree s: a micro-batch of the group
is shared by s ranks, each holding 1/s of its tokens, so its caps are s times one rank's memory
budget. Each sample goes to the smallest group that holds it; each group is packed with
``balanced`` over its data-parallel ranks (the plan's ranks ÷ s), and every step belongs to one
group, in the order ``order_steps`` gives.
"""

from __future__ import annotations

import heapq
import itertools
import re
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from vlmshard.errors import ConfigError

from .algorithms import CAPS_TIE, Caps, pack_balanced, split_over_cap
from .batches import Lengths, MediaUnits, Packing, concat_steps
from .cost import CostModel
from .metrics import Metrics, StepFigures, metrics_of, step_figures

# ``mixed``: each group's steps spread evenly over the epoch, in proportion to its share of the
# steps; ``short-first``: the groups one after another, shortest first (HBP's curriculum).
GroupOrder = Literal["mixed", "short-first"]
AUTO = "auto"
# Samples the automatic search packs each candidate with, at most (a seeded subsample).
SEARCH_SAMPLES = 50000


@dataclass(frozen=True)
class Group:
    length: int  # Qt: the LLM tokens a micro-batch holds over its sp ranks
    qv: int  # the ViT tiles a micro-batch holds over its sp ranks
    sp: int  # sequence-parallel degree: the ranks that share each micro-batch
    rank_qv: int  # the tiles one of its ranks encodes at most, units dealt whole (``rank_tiles``)

    @property
    def caps(self) -> Caps:
        return Caps(self.qv, self.length)


def parse_groups(text: str) -> list[tuple[int, int | None]] | None:
    """``--groups``: None for ``auto``, else (length, SP degree or None) per group, from
    ``LENGTH[:SP],...`` in increasing length (``8192,32768:4``)."""
    if text.strip() == AUTO:
        return None
    spec = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", part)
        if not m:
            raise ConfigError(f"--groups {text!r}: {part.strip()!r} is not LENGTH or "
                              f"LENGTH:SP (e.g. --groups 8192,32768:4, or --groups auto)")
        length, sp = int(m[1]), None if m[2] is None else int(m[2])
        if length < 1 or sp == 0:
            raise ConfigError(f"--groups {text!r}: lengths and SP degrees must be positive")
        spec.append((length, sp))
    lengths = [length for length, _ in spec]
    if lengths != sorted(set(lengths)):
        raise ConfigError(f"--groups {text!r}: give each length once, shortest first")
    return spec


Refusal = Callable[[int], "str | None"]  # why the model cannot take an SP degree, or None


def sp_degrees(dp: int, refusal: Refusal = lambda sp: None) -> list[int]:
    """The SP degrees a plan for ``dp`` real ranks can use: the divisors of ``dp`` the model
    can split over (``model_sizes.sequence_parallel_refusal``)."""
    return [d for d in range(1, dp + 1) if dp % d == 0 and refusal(d) is None]


def rank_tiles(qv: int, sp: int, largest: int) -> int:
    """The most tiles one of ``sp`` ranks encodes of a micro-batch of at most ``qv`` tiles: its
    ViT units (an image, a video's temporal step) are dealt whole, largest first, each to the
    least-loaded rank (``shards.sequence.media_pieces``), and such a deal gives no rank more
    than qv/sp + (1 - 1/sp)·largest (the last unit the fullest rank took found it the least
    loaded; Graham's list-scheduling bound), ``largest`` the largest unit of the data. What
    the trainer's memory check takes for a rank's ViT (``default_partition.shard_sizes``)."""
    return min(qv, -(-(qv + (sp - 1) * largest) // sp))


def deal_units(media: list[tuple[int, int]], sp: int) -> list[list[int]]:
    """How many units of each medium of (tiles, units) each of ``sp`` ranks encodes: units
    dealt largest first, each to the least-loaded rank (ties: the lower rank, the earlier
    medium), the deal ``rank_tiles`` bounds; a video's units are equal, so how many each rank
    takes is the whole of it."""
    heap = [(0, r) for r in range(sp)]
    counts = [[0] * sp for _ in media]
    for i in sorted(range(len(media)), key=lambda i: (-(media[i][0] // media[i][1]), i)):
        tiles, units = media[i]
        for _ in range(units):
            load, rank = heapq.heappop(heap)
            counts[i][rank] += 1
            heapq.heappush(heap, (load + tiles // units, rank))
    return counts


def rank_balance(packing: Packing, media: MediaUnits | None, lengths: Lengths,
                 sp: int) -> tuple[float | None, float]:
    """Within a group of ``sp`` ranks, over the micro-batches of ``packing``: the ViT's and the
    LLM's Σ fullest rank over Σ mean rank (1: even), the ViT's as ``deal_units`` deals each
    micro-batch's units (None without media sizes: OmniBal's length files), the LLM's as
    the loader cuts its tokens (contiguous shares of ⌈n/sp⌉, the last short)."""
    vit_max = vit_mean = llm_max = llm_mean = 0.0
    for b in range(packing.n_micro):
        items = packing.items[packing.offsets[b]:packing.offsets[b + 1]]
        n = int(lengths.tokens[items].sum())
        llm_max, llm_mean = llm_max + -(-n // sp), llm_mean + n / sp
        if media is not None:
            units = media.of(items)
            loads = np.zeros(sp)
            for (tiles, count), ranks in zip(units, deal_units(units, sp)):
                loads += np.array(ranks) * (tiles // count)
            vit_max, vit_mean = vit_max + loads.max(), vit_mean + loads.mean()
    vit = None if media is None else (vit_max / vit_mean if vit_mean else 1.0)
    return vit, llm_max / llm_mean if llm_mean else 1.0


def largest_unit(lengths: Lengths, rank_qv: int) -> int:
    """The largest ViT unit of ``lengths`` (``Lengths.largest``) that one rank can encode
    (larger ones are not placed: ``pack_groups``); 0 where the input does not say (OmniBal's
    length files)."""
    if lengths.largest is None:
        return 0
    return int(lengths.largest[lengths.largest <= rank_qv].max(initial=0))


def given_groups(spec: list[tuple[int, int | None]], rank: Caps, dp: int,
                 refusal: Refusal = lambda sp: None, largest: int = 0) -> tuple[Group, ...]:
    """The groups ``--groups`` names, within one rank's memory budget ``rank`` (tiles, tokens):
    a group of length L takes the SP degree given, else the least of ``sp_degrees`` that keeps
    L/s tokens on a rank; its Qv is s ranks' tiles, of which a rank may get more than its share
    (``rank_tiles``, ``largest`` the largest unit)."""
    degrees = sp_degrees(dp, refusal)
    groups = []
    for length, sp in spec:
        if sp is None:
            sp = next((d for d in degrees if d * rank.qt >= length), None)
            if sp is None:
                refused = [d for d in sp_degrees(dp) if d * rank.qt >= length]
                why = (f"; the model cannot take SP {refused[0]}: {refusal(refused[0])}"
                       if refused else "")
                raise ConfigError(f"group length {length} needs more than the {dp} ranks' "
                                  f"{dp * rank.qt} tokens (one rank holds {rank.qt}, "
                                  f"--max-qt){why}: lower it or raise --max-qt")
        elif dp % sp:
            raise ConfigError(f"group {length}:{sp}: SP degree {sp} does not divide --dp {dp}")
        elif refusal(sp):
            raise ConfigError(f"group {length}:{sp}: the model cannot take SP {sp}: "
                              f"{refusal(sp)}")
        elif sp * rank.qt < length:
            raise ConfigError(f"group {length}:{sp} puts {-(-length // sp)} tokens on a rank, "
                              f"over one rank's {rank.qt} (--max-qt): raise its SP degree")
        groups.append(Group(length, sp * rank.qv, sp, rank_tiles(sp * rank.qv, sp, largest)))
    return tuple(groups)


def ladder(lengths: Lengths, rank: Caps, dp: int,
           refusal: Refusal = lambda sp: None) -> tuple[Group, ...]:
    """``auto``'s candidate levels: one per SP degree s of ``sp_degrees``, of s ranks' budget,
    up to the first that holds the longest sample (HBP's levels double: so do these where
    ``dp`` is a power of two)."""
    out, largest = [], largest_unit(lengths, rank.qv)
    for sp in sp_degrees(dp, refusal):
        out.append(Group(sp * rank.qt, sp * rank.qv, sp, rank_tiles(sp * rank.qv, sp, largest)))
        if (out[-1].length >= lengths.tokens.max(initial=0)
                and out[-1].qv >= lengths.tiles.max(initial=0)):
            break
    return tuple(out)


def assign(lengths: Lengths, ids: np.ndarray, groups: tuple[Group, ...]) -> np.ndarray:
    """The group of each of ``ids``: the first (smallest) that holds it; -1 for none."""
    where = np.full(len(ids), -1, np.int64)
    for g in reversed(range(len(groups))):
        fits = (lengths.tiles[ids] <= groups[g].qv) & (lengths.tokens[ids] <= groups[g].length)
        where[fits] = g
    return where


def order_steps(steps: list[int], order: str) -> np.ndarray:
    """The group of each step of an epoch whose groups have ``steps`` steps each.

    ``mixed``: group g's k-th step sits at (k + ½)/steps[g] of the epoch (ties to the smaller
    group), so every prefix of the epoch holds each group's share to within a step or so.
    ``short-first``: group 0's steps, then group 1's, and so on."""
    group = np.repeat(np.arange(len(steps), dtype=np.int64), steps)
    if order == "short-first":
        return group
    k = np.concatenate([np.arange(n) for n in steps]) if steps else np.array([], np.int64)
    position = (k + 0.5) / np.maximum(np.asarray(steps, np.float64), 1)[group]
    return group[np.lexsort((group, position))]


@dataclass
class GroupedPacking:
    """A plan's micro-batches in groups: ``packings[g]`` holds group g's steps (its ranks: the
    plan's ranks ÷ its SP degree), and ``order`` the group of each step of the plan, whose
    steps take each group's steps in their order."""

    groups: tuple[Group, ...]
    packings: list[Packing]
    order: np.ndarray  # int64 [steps]
    unplaced: np.ndarray  # int64 sample ids
    unplaced_reason: list[str]

    @property
    def steps(self) -> int:
        return len(self.order)

    @property
    def grouped(self) -> bool:
        return is_grouped([describe(g) for g in self.groups])

    @classmethod
    def single(cls, group: Group, packing: Packing) -> "GroupedPacking":
        """A plan of one group: ``packing`` as it is."""
        return cls((group,), [packing], np.zeros(packing.steps, np.int64), packing.unplaced,
                   packing.unplaced_reason)

    @classmethod
    def concat(cls, epochs: list["GroupedPacking"]) -> "GroupedPacking":
        """One plan whose steps run through the epochs in order."""
        first = epochs[0]
        return cls(first.groups,
                   [concat_steps([e.packings[g] for e in epochs])
                    for g in range(len(first.groups))],
                   np.concatenate([e.order for e in epochs]),
                   np.concatenate([e.unplaced for e in epochs]),
                   [r for e in epochs for r in e.unplaced_reason])

    def measure(self, lengths: Lengths, cost: CostModel, dp: int, mode: str, *,
                padded: bool = False, pack_seconds: float = 0.0) -> tuple[Metrics, list[Metrics]]:
        """The plan's metrics and each group's, as ``dp`` real ranks (dp ÷ sp groups of sp in
        a group of SP degree sp) see them; ``padded`` micro-batches for ``random`` and
        ``lengthgroup`` (``metrics.micro_batch_sizes``)."""
        parts = [step_figures(lengths, p, qv=g.qv, qt=g.length, cost=cost, padded=padded,
                              dp=dp // g.sp, mode=mode, sp=g.sp)
                 for g, p in zip(self.groups, self.packings)]
        top = self.groups[-1]
        whole = metrics_of(StepFigures.concat(parts, self.order), unplaced=len(self.unplaced),
                           qv=top.qv, qt=top.length, pack_seconds=pack_seconds)
        each = [metrics_of(f, unplaced=0, qv=g.qv, qt=g.length, pack_seconds=0.0)
                for g, f in zip(self.groups, parts)]
        return whole, each


def pack_groups(lengths: Lengths, ids: np.ndarray, groups: tuple[Group, ...], *, ranks: int,
                micro_batches: int, seed: int, cost: CostModel, mode: str,
                order: str) -> GroupedPacking:
    """One epoch of ``ids`` in ``groups``: each sample in the smallest group that holds it, each
    group packed with ``balanced`` over ranks ÷ sp, the steps in ``order`` (``order_steps``).
    Samples no group holds come first among the unplaced: ``unit_over_rank_qv`` for an image or
    a video's temporal step over one rank's tiles (a rank encodes each unit whole, so no
    degree places it; a clip's steps spread over the group), else the cap of the largest group
    they break."""
    fit, over, reasons = split_over_cap(lengths.take(ids), groups[-1].caps)
    if lengths.largest is not None:
        big = lengths.largest[ids] > groups[0].qv // groups[0].sp  # one rank: Qv / sp
        reasons = ["unit_over_rank_qv" if big[i] else r for i, r in zip(over, reasons)]
        reasons += ["unit_over_rank_qv"] * int(big[fit].sum())
        over, fit = np.r_[over, fit[big[fit]]], fit[~big[fit]]
    where = assign(lengths, ids[fit], groups)
    packings = [pack_balanced(lengths, ids[fit][where == g], g_.caps, ranks=ranks // g_.sp,
                              micro_batches=micro_batches, seed=seed, cost=cost, mode=mode)
                for g, g_ in enumerate(groups)]
    unplaced = np.concatenate([ids[over]] + [p.unplaced for p in packings]).astype(np.int64)
    return GroupedPacking(groups, packings, order_steps([p.steps for p in packings], order),
                          unplaced, reasons + [r for p in packings for r in p.unplaced_reason])


def search_groups(lengths: Lengths, rank: Caps, *, dp: int, ranks: int, micro_batches: int,
                  seed: int, cost: CostModel, mode: str, refusal: Refusal = lambda sp: None
                  ) -> tuple[tuple[Group, ...], list[dict]]:
    """``--groups auto``: of the ``ladder``'s levels, the set (always with the top level, which
    holds the longest samples) whose plan has the highest step_efficiency, SP exchange counted.
    Each candidate packs the same seeded subsample (the whole data when small); levels no
    sample would go to are not tried, nor SP degrees the model cannot split over
    (``refusal``); ties (``algorithms.CAPS_TIE``) go to fewer groups.
    Returns the groups and every candidate tried, with its figures."""
    rng = np.random.default_rng(seed)
    sample = lengths.take(np.sort(rng.permutation(len(lengths))[:SEARCH_SAMPLES]))
    levels = ladder(lengths, rank, dp, refusal)
    ids = np.arange(len(sample), dtype=np.int64)
    used = set(assign(sample, ids, levels).tolist()) - {-1, len(levels) - 1}
    tried = []
    for k in range(len(used) + 1):
        for lower in itertools.combinations(sorted(used), k):
            groups = tuple(levels[g] for g in lower) + (levels[-1],)
            packed = pack_groups(sample, ids, groups, ranks=ranks, micro_batches=micro_batches,
                                 seed=seed, cost=cost, mode=mode, order="mixed")
            m, _ = packed.measure(sample, cost, dp, mode)
            tried.append({"groups": [describe(g) for g in groups],
                          "step_efficiency": m.step_efficiency,
                          "communication_ratio": m.communication_ratio,
                          "placed": m.samples / len(sample)})
    top = max(t["step_efficiency"] for t in tried)
    best = min((t for t in tried if t["step_efficiency"] >= top - CAPS_TIE),
               key=lambda t: (len(t["groups"]), -t["step_efficiency"]))
    return tuple(Group(**g) for g in best["groups"]), tried


def is_grouped(groups: list[dict]) -> bool:
    """Whether a plan of these groups (``describe``'s, plan.json's) is more than one plain plan:
    several groups, or sequence parallelism."""
    return len(groups) > 1 or any(g["sp"] > 1 for g in groups)


def describe(group: Group) -> dict:
    return {"length": group.length, "qv": group.qv, "sp": group.sp, "rank_qv": group.rank_qv}


def group_table(packed: GroupedPacking, each: list[Metrics], lengths: Lengths,
                plan_ranks: int, media: MediaUnits | None = None) -> list[dict]:
    """Per group, what ``plan.json`` records and ``vlmshard pack`` prints: its caps and SP
    degree, its data-parallel ranks, and its steps, samples, tokens, ABR, CR, fill, and the
    balance of the ViT's and the LLM's work over its SP ranks (``rank_balance``)."""
    table = []
    for g, p, m in zip(packed.groups, packed.packings, each):
        vit, llm = rank_balance(p, media, lengths, g.sp) if g.sp > 1 else (1.0, 1.0)
        table.append({**describe(g), "dp": plan_ranks // g.sp, "steps": m.steps,
                      "samples": m.samples, "tokens": int(lengths.tokens[p.items].sum()),
                      "attn_dist_ratio": m.attn_dist_ratio,
                      "communication_ratio": m.communication_ratio, "llm_fill": m.llm_fill,
                      "vit_fill": m.vit_fill, "step_efficiency": m.step_efficiency,
                      "vit_rank_balance": vit, "llm_rank_balance": llm})
    return table


def format_group_table(table: list[dict]) -> str:
    """``group_table`` as aligned text (vit_bal: the ViT's fullest SP rank over the mean)."""
    head = (f"{'length':>8} {'sp':>3} {'qv':>7} {'dp':>4} {'steps':>6} {'samples':>8} "
            f"{'tokens':>11} {'ABR':>7} {'CR':>5} {'fill':>6} {'step_eff':>8} {'vit_bal':>7}")
    rows = [f"{t['length']:>8} {t['sp']:>3} {t['qv']:>7} {t['dp']:>4} {t['steps']:>6} "
            f"{t['samples']:>8} {t['tokens']:>11} {t['attn_dist_ratio']:>7.4f} "
            f"{t['communication_ratio']:>5.2f} {t['llm_fill']:>6.3f} {t['step_efficiency']:>8.4f} "
            + ("      -" if t["vit_rank_balance"] is None else f"{t['vit_rank_balance']:>7.3f}")
            for t in table]
    return "\n".join([head] + rows)
