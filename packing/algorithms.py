"""Packing algorithms: pure functions from sample lengths to micro-batches in step-major order.

- ``random``: k samples per micro-batch in random order, padded (OmniBal's random baseline).
- ``lengthgroup``: LLaVA's length-grouped megabatches, padded.
- ``isf``: OmniBal's Iterative Sampling and Filtering, faithful to its reference code, plus its
  parameter search when Qv/Qt are not given.
- ``balanced``: ours. Packs near-full on both resources inside shuffled windows, then deals the
  micro-batches to ranks so every step's ranks carry equal tiles, tokens and attention.

Each takes the samples that fit the caps (the caller lists the others as unplaced) and a seed,
and returns a ``Packing``; samples that do not fill a whole step are unplaced ``remainder``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import compiled
from .batches import Lengths, Packing
from .cost import CostModel


@dataclass(frozen=True)
class Caps:
    qv: int  # Σ tiles per micro-batch
    qt: int  # Σ seq_len per micro-batch


def split_over_cap(lengths: Lengths, caps: Caps) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Sample ids that fit the caps on their own, and the others with the cap each breaks."""
    over_v = lengths.tiles > caps.qv
    over_t = lengths.tokens > caps.qt
    fit = np.flatnonzero(~(over_v | over_t))
    out = np.flatnonzero(over_v | over_t)
    reasons = ["tiles_over_qv" if over_v[i] else "tokens_over_qt" for i in out]
    return fit, out, reasons


def whole_steps(items: np.ndarray, group: np.ndarray, ranks: int, micro_batches: int,
                unplaced: np.ndarray, reasons: list[str]) -> Packing:
    """Micro-batches from consecutive runs of ``group`` (already in step-major order).

    Micro-batches past the last whole step are dropped and their samples unplaced as
    ``remainder``, so every step has exactly ranks × micro_batches micro-batches.
    """
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else group
    per_step = ranks * micro_batches
    keep_micro = (len(starts) // per_step) * per_step
    cut = starts[keep_micro] if keep_micro < len(starts) else len(items)
    offsets = np.r_[starts[:keep_micro], cut].astype(np.int64)
    rest = items[cut:]
    return Packing(items[:cut].astype(np.int64), offsets, ranks, micro_batches,
                   np.r_[unplaced, rest].astype(np.int64),
                   list(reasons) + ["remainder"] * len(rest))


# --- random and lengthgroup: fixed samples per micro-batch, padded -------------------------------

def padded_caps(lengths: Lengths, samples_per_micro: int) -> Caps:
    """Static shapes of a padded micro-batch: k times the largest sample on each side."""
    return Caps(int(lengths.tiles.max(initial=0)) * samples_per_micro,
                int(lengths.tokens.max(initial=0)) * samples_per_micro)


def pack_random(lengths: Lengths, ids: np.ndarray, *, ranks: int, micro_batches: int,
                samples_per_micro: int, seed: int) -> Packing:
    order = ids[np.random.default_rng(seed).permutation(len(ids))]
    group = np.arange(len(order)) // samples_per_micro
    return _fixed_size(order, group, ranks, micro_batches, samples_per_micro)


def pack_lengthgroup(lengths: Lengths, ids: np.ndarray, *, ranks: int, micro_batches: int,
                     samples_per_micro: int, seed: int) -> Packing:
    """LLaVA's ``get_length_grouped_indices``: one megabatch per step, sorted by length, split
    into even chunks by greedy assignment to the shortest chunk."""
    order = ids[np.random.default_rng(seed).permutation(len(ids))]
    chunks = ranks * micro_batches
    mega = chunks * samples_per_micro
    out = []
    for start in range(0, len(order), mega):
        megabatch = order[start:start + mega]
        megabatch = megabatch[np.argsort(-lengths.tokens[megabatch], kind="stable")]
        out.extend(_split_to_even_chunks(megabatch, lengths.tokens, chunks))
    items = np.concatenate(out) if out else np.array([], np.int64)
    group = np.repeat(np.arange(len(out)), [len(c) for c in out])
    return _fixed_size(items, group, ranks, micro_batches, samples_per_micro)


def _split_to_even_chunks(indices: np.ndarray, tokens: np.ndarray, n: int) -> list[np.ndarray]:
    if len(indices) % n:
        return [indices[i::n] for i in range(n)]
    per_chunk = len(indices) // n
    chunks: list[list[int]] = [[] for _ in range(n)]
    load = [0.0] * n
    for i in indices:
        c = load.index(min(load))
        chunks[c].append(i)
        load[c] += tokens[i]
        if len(chunks[c]) == per_chunk:
            load[c] = float("inf")
    return [np.array(c, np.int64) for c in chunks]


def _fixed_size(items, group, ranks, micro_batches, samples_per_micro) -> Packing:
    """Drop a short last micro-batch into the remainder, then cut whole steps."""
    sizes = np.bincount(group) if len(group) else np.array([], np.int64)
    full = np.flatnonzero(sizes == samples_per_micro)
    keep = np.isin(group, full)
    short = items[~keep]
    return whole_steps(items[keep], group[keep], ranks, micro_batches, short,
                       ["remainder"] * len(short))


# --- isf: OmniBal's Iterative Sampling and Filtering --------------------------------------------

ISF_ITERATIONS = 50  # OmniBal's itertime
ISF_MARGIN = 128  # keep a group once Σtokens ≥ Qt − 128


def isf_groups(lengths: Lengths, ids: np.ndarray, caps: Caps, *, seed: int,
               iterations: int = ISF_ITERATIONS) -> tuple[np.ndarray, np.ndarray]:
    """OmniBal's ISF grouping: (items, group number per item), groups in output order.

    Shuffle and cut greedily under the caps; keep groups that fill Qv exactly or reach
    Qt − 128 tokens; reshuffle the rest with seed + i and cut again, ``iterations`` times in all.
    """
    thresh = caps.qt - ISF_MARGIN
    kept_items, kept_groups, n_kept = [], [], 0
    pending = ids[np.random.RandomState(seed).permutation(len(ids))]
    group = compiled.greedy_groups(lengths.tiles, lengths.tokens, pending, caps.qv, caps.qt)
    for i in range(iterations - 1):
        n_groups = int(group[-1]) + 1 if len(group) else 0
        gv = np.bincount(group, lengths.tiles[pending], minlength=n_groups)
        gt = np.bincount(group, lengths.tokens[pending], minlength=n_groups)
        full = (gv == caps.qv) | (gt >= thresh)
        keep = full[group]
        kept_items.append(pending[keep])
        kept_groups.append(np.unique(group[keep], return_inverse=True)[1] + n_kept)
        n_kept += int(full.sum())
        rest = pending[~keep]
        pending = rest[np.random.RandomState(seed + i).permutation(len(rest))]
        group = compiled.greedy_groups(lengths.tiles, lengths.tokens, pending, caps.qv, caps.qt)
    kept_items.append(pending)
    kept_groups.append(group + n_kept)
    return np.concatenate(kept_items), np.concatenate(kept_groups)


def pack_isf(lengths: Lengths, ids: np.ndarray, caps: Caps, *, ranks: int, micro_batches: int,
             seed: int, iterations: int = ISF_ITERATIONS) -> Packing:
    items, group = isf_groups(lengths, ids, caps, seed=seed, iterations=iterations)
    return deal_groups(items, group, ranks=ranks, micro_batches=micro_batches, seed=seed)


def deal_groups(items: np.ndarray, group: np.ndarray, *, ranks: int, micro_batches: int,
                seed: int) -> Packing:
    """Groups dealt to ranks in random order (OmniBal's random sampler over ISF's groups)."""
    n_groups = int(group[-1]) + 1 if len(group) else 0
    position = np.empty(n_groups, np.int64)
    position[np.random.default_rng(seed).permutation(n_groups)] = np.arange(n_groups)
    new_group = position[group]
    sort = np.argsort(new_group, kind="stable")
    return whole_steps(items[sort], new_group[sort], ranks, micro_batches,
                       np.array([], np.int64), [])


def search_isf_caps(lengths: Lengths, *, ranks: int, target_samples: int, seed: int,
                    cost: CostModel, max_candidates: int = 40) -> tuple[Caps, list[dict]]:
    """OmniBal's parameter search (``test_balanced_dynamic_batch.py``).

    Start from Qt = 4096 and Qv = 4096 // (mean 256-binned tokens per tile, rounded to 16); step
    both up together while ISF's mean samples per group stays below ``target_samples``, down once
    it passes target + 1; keep candidates whose mean is within [target, target + 1] and choose the
    one with the least pad + ViT dist + LLM dist, each candidate measured over ``ranks`` ranks
    with one micro-batch each, as OmniBal does. (Bounded, where OmniBal's loop can cycle.)
    """
    from .metrics import measure

    binned = np.ceil(lengths.tokens / 256) * 256
    mean_v = max(float(lengths.tiles.mean()), 1e-9)
    per_tile = max(int(((float(binned.mean()) // mean_v + 1) // 16) * 16), 16)
    qt, qv = 4096, max(4096 // per_tile, 1)
    tried: list[dict] = []
    best_mean = 0.0
    for _ in range(max_candidates):
        caps = Caps(qv, qt)
        fit = split_over_cap(lengths, caps)[0]
        items, group = isf_groups(lengths, fit, caps, seed=seed)
        mean_samples = len(fit) / (int(group[-1]) + 1) if len(group) else 0.0
        packing = deal_groups(items, group, ranks=ranks, micro_batches=1, seed=seed)
        m = measure(lengths, packing, qv=qv, qt=qt, cost=cost, padded=False, dp=ranks,
                    pack_seconds=0.0)
        score = m.pad_ratio + m.vit_dist_ratio + m.llm_dist_ratio
        tried.append({"qv": qv, "qt": qt, "mean_samples": mean_samples, "score": score,
                      "accepted": target_samples <= mean_samples <= target_samples + 1})
        best_mean = max(best_mean, mean_samples)
        if best_mean > target_samples + 1:
            if any(t["accepted"] for t in tried):
                break
            qv, qt = qv - 1, qt - per_tile
        else:
            qv, qt = qv + 1, qt + per_tile
        if qv < 1 or qt < 1:
            break
    # Without an accepted candidate, the best that places anything (a tiny or odd dataset can
    # leave every sample over both caps, whose empty packing would score a perfect 0).
    pool = ([t for t in tried if t["accepted"]] or [t for t in tried if t["mean_samples"] > 0]
            or tried)
    best = min(pool, key=lambda t: (t["score"], t["qv"], t["qt"]))
    return Caps(best["qv"], best["qt"]), tried


# --- balanced: ours ------------------------------------------------------------------------------

@dataclass(frozen=True)
class BalancedOptions:
    fill_bins: int = 128  # micro-batches filled together (rounded up to whole steps)
    overfill: float = 0.08  # a window takes this much more than it holds; the rest is carried
    balance_steps: int = 256  # steps whose micro-batches are matched together
    bands: int = 3  # steps per attention band; inside a band micro-batches are matched on tokens
    polish_rounds: int = 1  # swaps per rank and step (compiled.polish_steps); more rarely help


def memory_bound(lengths: Lengths, target_samples: int, max_qv: int | None = None,
                 max_qt: int | None = None) -> Caps:
    """The largest caps automatic caps may take: the given ones, else the tiles and tokens of
    ``target_samples`` mean samples, never below the largest sample: automatic caps, and one
    rank's default budget under packing groups, leave no sample out unless a bound the user or
    a profile gives does (4 mean samples of mostly-text data hold fewer tiles than an image)."""
    def default(x: np.ndarray) -> int:
        return max(int(round(target_samples * float(x.mean()))), int(x.max(initial=0)))

    return Caps(default(lengths.tiles) if max_qv is None else max_qv,
                default(lengths.tokens) if max_qt is None else max_qt)


CAPS_RATIOS = (0.9, 0.95, 1.0, 1.03, 1.06, 1.1, 1.2)  # Qt/Qv over the data's tokens per tile
CAPS_TILE_STEPS = 3  # Qv below the largest tried at the best ratio, one tile apart
CAPS_SEARCH_STEPS = 30  # steps' worth of samples each candidate is packed with, at least
# Candidates this close to the best step_efficiency tie (a subsample's figure is no finer); the
# larger caps win a tie: fewer, fuller micro-batches pay less of the per-micro-batch overhead
# (launches, sends, host reads) that step_efficiency does not count.
CAPS_TIE = 0.001


def caps_at(bound: Caps, low: Caps, per_tile: float, ratio: float, below: int = 0) -> Caps:
    """Caps inside ``bound`` with Qt/Qv = ``ratio`` × ``per_tile`` (the data's tokens per tile,
    so neither cap runs empty while the other binds), ``below`` tiles under the largest Qv that
    allows; never below ``low``, the largest tiles and tokens of a sample the bound admits."""
    tokens_per_tile = ratio * per_tile
    qv = min(max(min(bound.qv, int(bound.qt / tokens_per_tile)) - below, low.qv, 1), bound.qv)
    return Caps(qv, min(max(int(np.ceil(qv * tokens_per_tile)), low.qt), bound.qt))


def search_balanced_caps(lengths: Lengths, bound: Caps, *, per_step: int, seed: int,
                         cost: CostModel, mode: str,
                         options: BalancedOptions = BalancedOptions()) -> tuple[Caps, list[dict]]:
    """The caps inside ``bound`` under which ``balanced`` packing has the highest
    ``step_efficiency`` in compute ``mode``: the bound itself and ``caps_at`` each of
    ``CAPS_RATIOS``, then a few tiles below at the best ratio (whole-tile samples fill some Qv
    better than others). Each candidate packs the same seeded subsample of the data (whole when
    small) into steps of ``per_step`` micro-batches, each counted as a rank of its own (so a
    plan for V virtual ranks and one for a DP size dividing V with the same step shape get the
    same caps); ties (``CAPS_TIE``) go to the larger caps. Returns the caps and every candidate
    tried, with its figures."""
    from .metrics import measure

    rng = np.random.default_rng(seed)
    per_micro = max(float(bound.qv) / max(float(lengths.tiles.mean()), 1e-9),
                    float(bound.qt) / max(float(lengths.tokens.mean()), 1e-9))
    want = max(20000, int(CAPS_SEARCH_STEPS * per_step * per_micro))
    sample = lengths.take(np.sort(rng.permutation(len(lengths))[:want]))
    tried: dict[Caps, dict] = {}

    def score(caps: Caps) -> float:
        if caps not in tried:
            packing = pack_balanced(sample, split_over_cap(sample, caps)[0], caps,
                                    ranks=per_step, micro_batches=1, seed=seed, cost=cost,
                                    mode=mode, options=options)
            m = measure(sample, packing, qv=caps.qv, qt=caps.qt, cost=cost, padded=False,
                        dp=per_step, pack_seconds=0.0, mode=mode)
            tried[caps] = {"qv": caps.qv, "qt": caps.qt, "step_efficiency": m.step_efficiency,
                           "vit_fill": m.vit_fill, "llm_fill": m.llm_fill}
        return tried[caps]["step_efficiency"]

    score(bound)
    total_v = float(lengths.tiles.sum())
    if total_v > 0:  # else text only: the token cap is the only one, and the bound holds it
        admitted = (lengths.tiles <= bound.qv) & (lengths.tokens <= bound.qt)
        low = Caps(int(lengths.tiles[admitted].max(initial=0)),
                   int(lengths.tokens[admitted].max(initial=0)))
        per_tile = float(lengths.tokens.sum()) / total_v
        ratio = max(CAPS_RATIOS, key=lambda r: (score(caps_at(bound, low, per_tile, r)), -r))
        for below in range(1, CAPS_TILE_STEPS + 1):
            score(caps_at(bound, low, per_tile, ratio, below))
    top = max(t["step_efficiency"] for t in tried.values())
    best = max((t for t in tried.values() if t["step_efficiency"] >= top - CAPS_TIE),
               key=lambda t: (t["qv"], t["qt"]))
    return Caps(best["qv"], best["qt"]), sorted(tried.values(), key=lambda t: (t["qv"], t["qt"]))


def pack_balanced(lengths: Lengths, ids: np.ndarray, caps: Caps, *, ranks: int,
                  micro_batches: int, seed: int, cost: CostModel, mode: str = "padding-free",
                  options: BalancedOptions = BalancedOptions()) -> Packing:
    """Fill micro-batches near-full on tiles and tokens inside windows of the shuffled data, then
    deal them to steps and ranks so that each step's ranks carry equal tiles, tokens, attention
    and cost. No global sort: windows follow the shuffled order, and the steps are shuffled.
    The compute ``mode`` decides what the epoch's last samples are worth a step for."""
    rng = np.random.default_rng(seed)
    stream = ids[rng.permutation(len(ids))].astype(np.int64)
    placed, bin_of_item, n_bins = _fill_stream(lengths, stream, caps, ranks * micro_batches,
                                               mode == "padded", options, cost)
    order = _deal_steps(lengths, placed, bin_of_item, n_bins, ranks, micro_batches, cost, rng,
                        options)
    leftover = np.setdiff1d(stream, placed, assume_unique=True)
    packing = Packing.from_bins(placed, bin_of_item, order, ranks, micro_batches,
                                leftover, ["remainder"] * len(leftover))
    compiled.polish_steps(packing.items, packing.offsets, lengths.tiles, lengths.tokens,
                         cost.squares(lengths.tokens), ranks, micro_batches, caps.qt,
                         options.polish_rounds * ranks)
    return packing


def _fill_stream(lengths, stream, caps, per_step, padded, options, cost):
    """Fill windows of micro-batches from the shuffled stream; what does not fit is carried.

    Carried samples go first in the next window (so none waits more than a window); the fresh
    ones follow, largest first. The last window gets whole steps until every sample is placed,
    or what is left is not worth a step (``_worth_a_step``): the remainder.
    Returns (placed sample ids, micro-batch number of each, number of micro-batches).
    """
    n_bins = -(-options.fill_bins // per_step) * per_step
    size = lengths.tiles / max(caps.qv, 1) + lengths.tokens / caps.qt
    cum_v = np.cumsum(lengths.tiles[stream])
    cum_t = np.cumsum(lengths.tokens[stream])
    want = (1 + options.overfill) * n_bins
    placed, bins = [], []
    carry = np.array([], np.int64)
    pos, n, total_bins = 0, len(stream), 0
    while pos < n:
        base_v = cum_v[pos - 1] if pos else 0
        base_t = cum_t[pos - 1] if pos else 0
        need_v = int(want * caps.qv) - int(lengths.tiles[carry].sum())
        need_t = int(want * caps.qt) - int(lengths.tokens[carry].sum())
        end = np.searchsorted(cum_t, base_t + need_t) + 1
        if caps.qv:
            end = min(end, np.searchsorted(cum_v, base_v + need_v) + 1)
        fresh = stream[pos:max(end, pos + 1)]
        pos += len(fresh)
        batch = np.r_[carry[np.argsort(-size[carry], kind="stable")],
                      fresh[np.argsort(-size[fresh], kind="stable")]]
        window = n_bins if pos < n else _last_window_bins(lengths, batch, caps, per_step, padded)
        where = _fill(lengths, batch, caps, window, cost)
        while pos >= n and _worth_a_step(lengths, batch, where, window, caps, per_step, padded):
            window += per_step  # one more step rather than a remainder
            where = _fill(lengths, batch, caps, window, cost)
        ok = where >= 0
        sort = np.argsort(where[ok], kind="stable")
        placed.append(batch[ok][sort])
        bins.append(where[ok][sort] + total_bins)
        total_bins += window
        carry = batch[~ok]
    if not placed:
        return np.array([], np.int64), np.array([], np.int64), 0
    return np.concatenate(placed), np.concatenate(bins), total_bins


def _fill(lengths, batch, caps, window, cost):
    """``compiled.fill_bins`` with the window's mean attention per micro-batch as the soft target
    for Σseq_len² (``cost.squares``), so long samples spread out instead of meeting in a few
    micro-batches."""
    if window == 0:
        return np.full(len(batch), -1, np.int64)
    tokens = lengths.tokens[batch]
    mean_attn = float(cost.squares(tokens).sum()) / window
    return compiled.fill_bins(lengths.tiles[batch], tokens, cost.squares(tokens), caps.qv, caps.qt,
                             mean_attn, window)


def _volume(lengths, items, caps) -> float:
    """The micro-batches ``items`` would fill at best: their larger share of the two caps."""
    return max(lengths.tiles[items].sum() / max(caps.qv, 1), lengths.tokens[items].sum() / caps.qt)


def _worth_a_step(lengths, batch, where, window, caps, per_step, padded) -> bool:
    """Whether the last window's unplaced samples get one more step: when some are left and
    every micro-batch would still hold a sample; padded, only when they would fill the step too
    (a padded micro-batch costs its caps however empty, so a mostly empty step would cost every
    rank a full step for a fraction of one). Padding-free, a step costs only its samples."""
    left = batch[where < 0]
    if len(left) == 0 or len(batch) < window + per_step:
        return False
    return not padded or _volume(lengths, left, caps) >= per_step


def _last_window_bins(lengths, items, caps, per_step, padded) -> int:
    """Whole steps' worth of micro-batches for the final samples: as many as they would fill
    (rounded down when padded, up when padding-free), and no more than they have samples."""
    if len(items) < per_step:
        return 0
    volume = _volume(lengths, items, caps) / per_step
    steps = min(int(volume) if padded else int(np.ceil(volume)), len(items) // per_step)
    return max(steps, 1) * per_step


def _deal_steps(lengths, placed, bin_of_item, n_bins, ranks, micro_batches, cost, rng, options):
    """Order micro-batches step-major so that each step's ranks carry equal load.

    Per window of ``balance_steps`` steps: order by tiles, then attention; cut into bands of
    ``bands`` steps and order each band by tokens; cut into steps; deal each step's micro-batches
    to ranks largest cost first in snake order; finally shuffle the epoch's steps.
    """
    per_step = ranks * micro_batches
    tokens = lengths.tokens[placed].astype(np.float64)
    V = np.bincount(bin_of_item, lengths.tiles[placed], minlength=n_bins)
    L = np.bincount(bin_of_item, tokens, minlength=n_bins)
    A = np.bincount(bin_of_item, cost.squares(tokens), minlength=n_bins)
    S = np.bincount(bin_of_item, lengths.supervised_or_tokens()[placed].astype(np.float64),
                    minlength=n_bins)
    U = np.bincount(bin_of_item, lengths.unit_squares_or_zero()[placed], minlength=n_bins)
    C = cost.cost(V, L, A, S, U)
    index = np.arange(n_bins)
    window = index // (options.balance_steps * per_step)
    by_attn = np.lexsort((A, -V, window))
    band = np.empty(n_bins, np.int64)
    band[by_attn] = window[by_attn] * n_bins + np.arange(n_bins) // (per_step * options.bands)
    by_tokens = np.lexsort((L[by_attn], band[by_attn]))
    in_steps = by_attn[by_tokens]  # consecutive runs of per_step micro-batches form a step
    step = np.empty(n_bins, np.int64)
    step[in_steps] = np.arange(n_bins) // per_step
    # Deal: within a step, largest cost first, snake order over ranks.
    dealt = np.lexsort((-C, step))
    k = np.arange(n_bins) % per_step
    rnd, pos = np.divmod(k, ranks)
    rank = np.where(rnd % 2 == 0, pos, ranks - 1 - pos)
    slot = np.empty(n_bins, np.int64)
    slot[dealt] = rank * micro_batches + rnd
    # Shuffle all steps: windows differ a little at the ends of the epoch (the first has no
    # carried samples, the last takes them all), so shuffling within windows would leave a trend.
    new_step = rng.permutation(n_bins // per_step)
    return np.lexsort((slot, new_step[step]))
