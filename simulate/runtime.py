"""Runtime re-balancing, as OrchMLLM, VeOmni and LoongForge do it at every step, set beside
offline balance (``vlmshard simulate --compare``). Written from each system's published
description (OrchMLLM, arXiv 2503.23830; VeOmni's ``EncoderDataBalance``; LoongForge's
data-parallel balancing docs), not from their code.

Each starts from the micro-batches as loaded (the plan's samples packed at random) and, for each
micro-batch slot of a step, deals the samples of the D replicas' micro-batches out again over the
D replicas, costliest first onto the least loaded (LPT):

- ``orchmllm``: the ViT's work and the LLM's each on its own, at the cost model's rates;
- ``veomni-vit``: the ViT's only, at a cost of tiles² per sample; the LLM's as loaded;
- ``loongforge``: both, each side on its warm-up fit of a·l² + b·l + c to the samples' true
  costs (``cost_error``; least squares over every sample, the most a warm-up can learn), a
  rank's LLM tokens capped at 1.2 × the slot's mean.

What moves is priced on the cluster's links (NVLink between the ranks of a node, the network
between nodes): pixels to the rank that runs a sample's ViT, its image features on to the rank
that runs its LLM part (with its token ids), and their gradient back in backward. The exchange
and the dispatcher's own time (measured here, in Python) are added to the step: no overlap is
assumed. A sample's images move together: the stats hold a sample's tiles, not each image's.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from vlmshard.hardware import GPU
from vlmshard.model_sizes import ACTIVATION_BYTES, ModelConfig

GPUS_PER_NODE = 8
TOKEN_ID_BYTES = 8  # int64 ids
LOONGFORGE_PACK_CAP = 1.2  # a rank's LLM tokens, over the slot's mean (its pack-length cap)


@dataclass(frozen=True)
class Dispatch:
    """How a strategy deals out one side's samples: by a cost (``model``: the cost model's
    rate; ``square``: tiles²; ``fit``: a·l² + b·l + c fitted to the true costs), or as loaded
    (None); ``cap``: a rank's LLM tokens at most this times the slot's mean."""

    vit: str | None
    llm: str | None
    cap: float | None = None


STRATEGIES = {"orchmllm": Dispatch("model", "model"),
              "veomni-vit": Dispatch("square", None),
              "loongforge": Dispatch("fit", "fit", LOONGFORGE_PACK_CAP)}


@dataclass(frozen=True)
class Rebalanced:
    """What each replica computes after the re-dispatch, and what the dispatch costs a step."""

    # [steps, D, M, 5]: tiles, tokens, Σseq_len², supervised tokens, Σ tiles² over ViT units
    batches: np.ndarray
    true: np.ndarray  # [steps, D, M, 4]: the same, each sample's share times its true factor
    exchange_s: np.ndarray  # [steps]: the all-to-alls' time
    planning_s: np.ndarray  # [steps]: the dispatcher's own time
    moved_share: float  # of the samples' ViT and LLM parts, those run off their loaded rank


def lpt(costs: np.ndarray, bins: int, sizes: np.ndarray, cap: float | None = None
        ) -> np.ndarray:
    """Each item's bin, costliest first onto the least loaded bin; with a ``cap``, onto the
    least loaded whose ``sizes`` stay within it, where one does."""
    heap = [(0.0, b) for b in range(bins)]
    held = np.zeros(bins)
    where = np.empty(len(costs), np.int64)
    for i in np.argsort(-costs, kind="stable"):
        popped = [heapq.heappop(heap)]
        while cap is not None and held[popped[-1][1]] + sizes[i] > cap and heap:
            popped.append(heapq.heappop(heap))
        fits = [p for p in popped if cap is None or held[p[1]] + sizes[i] <= cap]
        load, b = fits[0] if fits else popped[0]  # none fits: the least loaded
        popped.remove((load, b))
        where[i] = b
        held[b] += sizes[i]
        heapq.heappush(heap, (load + costs[i], b))
        for item in popped:
            heapq.heappush(heap, item)
    return where


@dataclass(frozen=True)
class Links:
    """The bytes a tile and a token move, and the links they cross."""

    pixel_bytes: float  # per tile
    feature_bytes: float  # per tile: its image tokens' hidden states
    intra_bytes_per_s: float
    inter_bytes_per_s: float

    @classmethod
    def of(cls, model: ModelConfig, gpu: GPU) -> "Links":
        a = ACTIVATION_BYTES
        return cls(3 * model.vision.image_size ** 2 * a,
                   model.tokens_per_tile * model.llm.hidden * a,
                   gpu.sp_link_bytes_per_s, gpu.link_bytes_per_s)

    def all_to_all(self, source: np.ndarray, target: np.ndarray, size: np.ndarray,
                   ranks: int) -> float:
        """Seconds to move ``size`` bytes of each item from its ``source`` rank to its
        ``target``: the busiest rank's sends or receives, each link at its speed (the ranks of
        a pipeline stage sit ``GPUS_PER_NODE`` to a node)."""
        moved = source != target
        if not moved.any():
            return 0.0
        s, t, b = source[moved], target[moved], size[moved]
        rate = np.where(s // GPUS_PER_NODE == t // GPUS_PER_NODE, self.intra_bytes_per_s,
                        self.inter_bytes_per_s)
        seconds = b / rate
        return float(max(np.bincount(s, seconds, ranks).max(),
                         np.bincount(t, seconds, ranks).max()))


def rebalance(slots: np.ndarray, items: np.ndarray, offsets: np.ndarray, lengths, cost,
              dispatch: Dispatch, links: Links, factors: np.ndarray) -> Rebalanced:
    """The micro-batches ``slots`` [steps, D, M] (numbers of micro-batches of the packing
    ``items``/``offsets``, as loaded) dealt out again by ``dispatch``; the samples'
    ``lengths`` (``packing.batches.Lengths``) costed by ``cost``, their ViT and LLM work really
    ``factors`` [samples, 2] times the model's (``cost_error.true_factors``)."""
    steps, dp, micro = slots.shape
    tiles, tokens, units = lengths.tiles, lengths.tokens, lengths.unit_squares_or_zero()
    squares, supervised = cost.squares(tokens), lengths.supervised_or_tokens()
    batches, true = np.zeros((steps, dp, micro, 5)), np.zeros((steps, dp, micro, 5))
    exchange, planning = np.zeros(steps), np.zeros(steps)
    vit_model = cost.a_v * tiles + cost.a_vs * units
    llm_model = cost.a_t * tokens + cost.b * squares
    vit_costs = _costs(dispatch.vit, tiles, vit_model, vit_model * factors[:, 0])
    llm_costs = _costs(dispatch.llm, tokens, llm_model, llm_model * factors[:, 1])
    moved = parts = 0
    for s in range(steps):
        for m in range(micro):
            chosen = [items[offsets[b]:offsets[b + 1]] for b in slots[s, :, m]]
            owner = np.repeat(np.arange(dp), [len(c) for c in chosen])
            ids = np.concatenate(chosen)
            v, t, q, u, w = tiles[ids], tokens[ids], squares[ids], supervised[ids], units[ids]
            start = time.perf_counter()
            vit = _deal(vit_costs, ids, v, owner, dp)
            llm = _deal(llm_costs, ids, t, owner, dp, dispatch.cap)
            planning[s] += time.perf_counter() - start
            fv, fl = factors[ids, 0], factors[ids, 1]
            batches[s, :, m] = _sums(vit, llm, dp, (v, w), (t, q, u))
            true[s, :, m] = _sums(vit, llm, dp, (v * fv, w * fv), (t * fl, q * fl, u * fl))
            images = v > 0
            exchange[s] += (  # pixels out, features on with the ids, their gradient back
                links.all_to_all(owner, vit, v * links.pixel_bytes, dp)
                + links.all_to_all(vit[images], llm[images],
                                   v[images] * links.feature_bytes, dp)
                + links.all_to_all(owner, llm, t * TOKEN_ID_BYTES, dp)
                + links.all_to_all(llm[images], vit[images],
                                   v[images] * links.feature_bytes, dp))
            moved += int((vit != owner)[images].sum() + (llm != owner).sum())
            parts += int(images.sum()) + len(ids)
    return Rebalanced(batches, true, exchange, planning, moved / max(parts, 1))


def _sums(vit: np.ndarray, llm: np.ndarray, ranks: int, vit_columns: tuple,
          llm_columns: tuple) -> np.ndarray:
    """[ranks, 5]: each rank's tiles and units' tiles² (of the samples whose ViT part it runs,
    ``vit``), tokens, Σseq_len² and supervised tokens (of those whose LLM part it runs,
    ``llm``), in ``Rebalanced.batches``' order."""
    (tiles, units), rest = vit_columns, llm_columns
    by_vit = [np.bincount(vit, x, ranks) for x in (tiles, units)]
    by_llm = [np.bincount(llm, x, ranks) for x in rest]
    return np.stack([by_vit[0], *by_llm, by_vit[1]], axis=1)


def _costs(rule: str | None, sizes: np.ndarray, model_cost: np.ndarray,
           true_cost: np.ndarray) -> np.ndarray | None:
    """Per sample, what ``rule`` deals one side's samples (``sizes``: their tiles or tokens) by;
    None: as loaded."""
    if rule is None:
        return None
    if rule == "square":
        return sizes.astype(np.float64) ** 2
    if rule == "model":
        return model_cost
    return quadratic_fit(sizes, true_cost)


def quadratic_fit(sizes: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """At ``sizes``, a·l² + b·l + c least-squares fitted to ``costs`` (each term scaled to at
    most 1, for the conditioning; a term that is 0 everywhere, as tiles in a text-only plan, is
    left at 0)."""
    length = sizes.astype(np.float64)
    terms = np.stack([length * length, length, np.ones_like(length)], axis=1)
    scale = np.abs(terms).max(axis=0, initial=0.0)
    terms /= np.where(scale > 0, scale, 1.0)
    return terms @ np.linalg.lstsq(terms, costs, rcond=None)[0]


def _deal(costs: np.ndarray | None, ids: np.ndarray, sizes: np.ndarray, owner: np.ndarray,
          bins: int, cap: float | None = None) -> np.ndarray:
    """Each of samples ``ids``' rank for one side (``sizes``: their tiles or tokens): as loaded,
    or by LPT on their ``costs``."""
    if costs is None:
        return owner
    return lpt(costs[ids], bins, sizes, None if cap is None else cap * sizes.sum() / bins)
