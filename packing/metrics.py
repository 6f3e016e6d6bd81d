"""The balance metrics of ``docs/design.md`` ("Metrics"), computed from a plan.

For step s and rank r let V, L, A be the rank's Σtiles, Σtokens and Σseq_len², C its cost:

- ``dist_ratio(X) = mean_s Σ_r (max_r X − X[s,r]) / (max_r X · R)``: OmniBal's Dist Ratio for
  X = V (``vit_dist_ratio``), L (``llm_dist_ratio``) and A (``attn_dist_ratio``, HBP's ABR).
- ``pad_ratio``: padded tokens / all tokens the LLM processes. Packed micro-batches are padded
  to Qt; padded ones (the ``random`` and ``lengthgroup`` baselines) pad each sample to the
  longest in its micro-batch.
- ``vit_fill = ΣV / (micro-batches · Qv)``, ``llm_fill = ΣL / (micro-batches · Qt)``.
- ``cost_efficiency = Σ_s mean_r C / Σ_s max_r C`` (1: no rank ever waits).
- ``step_efficiency = Σ_s Σ_r C / Σ_s (R · max_r E)``, the headline figure: useful work (the
  cost of the real tiles, tokens and per-sample attention) over what the ranks spend, each step
  lasting as long as its busiest rank's executed work E. E is what the trainer computes in the
  plan's compute mode (``executed_sizes``; padded baselines pad each sample to the longest
  in its micro-batch), so throughput is proportional to it. In ``padding-free`` mode a packed
  plan's E is C, and step_efficiency equals cost_efficiency.
- ``communication_ratio``: the share of tokens in sequence-parallel steps (HBP's CR), all of
  which pay its exchange.
- ``order_spearman``: Spearman ρ between step index and the step's mean seq_len (balance must
  not sort the data); ``source_mix_tv``: mean total-variation distance between each step's
  source mix and the global mix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from .batches import Lengths, Packing
from .cost import CostModel

# The keys ``vlmshard report --json`` prints, in this order.
REPORT_KEYS = ("step_efficiency", "pad_ratio", "vit_dist_ratio", "llm_dist_ratio",
               "attn_dist_ratio", "vit_fill", "llm_fill", "cost_efficiency", "order_spearman",
               "steps", "micro_batches", "samples", "unplaced", "qv", "qt", "pack_seconds")


def format_value(value) -> str:
    """A metric as pack and report print it: floats to 4 decimals, counts as they are, "-"
    for one not known."""
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def format_metrics(report: dict) -> str:
    """The ``REPORT_KEYS`` of a metrics report, one aligned line each."""
    return "\n".join(f"{k:<16} {format_value(report[k])}" for k in REPORT_KEYS)


@dataclass
class Metrics:
    step_efficiency: float
    pad_ratio: float
    vit_dist_ratio: float
    llm_dist_ratio: float
    attn_dist_ratio: float
    vit_fill: float
    llm_fill: float
    cost_efficiency: float
    order_spearman: float
    source_mix_tv: float
    steps: int
    micro_batches: int
    samples: int
    unplaced: int
    qv: int
    qt: int
    pack_seconds: float
    # the share of tokens in sequence-parallel steps, which pay its exchange (HBP's CR)
    communication_ratio: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def report(self) -> dict:
        return {k: getattr(self, k) for k in REPORT_KEYS}


def dist_ratio_per_step(x: np.ndarray) -> np.ndarray:
    """Each step's Σ_r (max_r X − X[s,r]) / (max_r X · R) = 1 − mean_r X / max_r X of a
    [steps, ranks] load table: the share of the step the ranks spend waiting
    (0 where all loads are 0)."""
    peak = x.max(axis=1).astype(np.float64)
    waste = (peak[:, None] - x).sum(axis=1)
    return np.divide(waste, peak * x.shape[1], out=np.zeros_like(peak), where=peak > 0)


def dist_ratio(x: np.ndarray) -> float:
    """OmniBal's Dist Ratio of a [steps, ranks] load table: the mean of ``dist_ratio_per_step``."""
    return float(dist_ratio_per_step(x).mean()) if x.size else 0.0


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman ρ with average ranks for ties; 0 when either side is constant or too short."""
    if len(x) < 2:
        return 0.0
    rx, ry = average_ranks(np.asarray(x)), average_ranks(np.asarray(y))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank (``scipy.stats.rankdata``'s default, without
    importing SciPy: that import alone took longer than packing)."""
    order = np.argsort(x, kind="stable")
    ordered = x[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


@dataclass(frozen=True)
class Loads:
    """A packing's loads, per micro-batch and per (step, real rank): what every metric and every
    report plot reads, so that the plots show exactly what the metrics average."""

    micro_tiles: np.ndarray  # [micro-batches] Σtiles, step-major
    micro_tokens: np.ndarray  # [micro-batches] Σseq_len
    tiles: np.ndarray  # [steps, dp] V
    tokens: np.ndarray  # [steps, dp] L
    squares: np.ndarray  # [steps, dp] A
    cost: np.ndarray  # [steps, dp] C
    sources: np.ndarray  # [steps, sources] samples of each source


def step_loads(lengths: Lengths, packing: Packing, cost: CostModel, dp: int) -> Loads:
    """Loads of ``packing`` as ``dp`` real ranks see it (each takes ranks/dp virtual ranks)."""
    if packing.ranks % dp:
        raise ValueError(f"dp={dp} does not divide the plan's {packing.ranks} virtual ranks")
    n_micro, steps = packing.n_micro, packing.steps
    per_step = packing.ranks * packing.micro_batches
    micro = packing.micro_of_item()
    tiles = lengths.tiles[packing.items].astype(np.float64)
    tokens = lengths.tokens[packing.items].astype(np.float64)
    V = np.bincount(micro, tiles, minlength=n_micro)
    L = np.bincount(micro, tokens, minlength=n_micro)
    A = np.bincount(micro, cost.squares(tokens), minlength=n_micro)
    S = np.bincount(micro, lengths.supervised_or_tokens()[packing.items].astype(np.float64),
                    minlength=n_micro)
    U = np.bincount(micro, lengths.unit_squares_or_zero()[packing.items], minlength=n_micro)

    Vr, Lr, Ar, Sr, Ur = (per_rank(x, packing, dp) for x in (V, L, A, S, U))
    n_sources = len(lengths.sources)
    sources = np.bincount((micro // per_step) * n_sources + lengths.source[packing.items],
                          minlength=steps * n_sources).reshape(steps, n_sources)
    return Loads(V, L, Vr, Lr, Ar, cost.cost(Vr, Lr, Ar, Sr, Ur), sources)


# the columns of ``micro_batch_sizes``: tiles, tokens, Σseq_len², supervised tokens, Σ tiles²
# over ViT units (``CostModel.cost``'s arguments in order)
SIZE_COLUMNS = 5


def per_rank(micro: np.ndarray, packing: Packing, dp: int) -> np.ndarray:
    """[steps, dp]: a per-micro-batch quantity (step-major) summed over each real rank's
    micro-batches of each step."""
    per_step = packing.ranks * packing.micro_batches
    return micro.reshape(packing.steps, dp, per_step // dp).sum(axis=2)


def executed_sizes(sizes: np.ndarray, *, qv: int, qt: int, mode: str) -> np.ndarray:
    """[micro-batches, 5]: the sizes (``SIZE_COLUMNS``) the trainer computes on for each
    micro-batch of ``micro_batch_sizes``, in compute ``mode`` (``cost.ComputeMode``): the real
    ones (``padding-free``), or Qv tiles and Qt tokens with attention (the LLM's and the ViT's)
    and the LM head's rows within the real samples and units (``padded``). The metrics and the
    simulator both cost these."""
    if mode == "padding-free":
        return sizes
    executed = sizes.copy()
    executed[:, 0], executed[:, 1] = qv, qt
    return executed


def executed_work(sizes: np.ndarray, packing: Packing, cost: CostModel, dp: int, *, qv: int,
                  qt: int, mode: str, sp: int = 1) -> np.ndarray:
    """[steps, dp]: the cost of what each real rank's trainer computes each step, from the
    micro-batches' ``micro_batch_sizes``; at sequence-parallel degree ``sp`` a "rank" is the
    ``sp`` ranks that share its micro-batches, their work with the exchange between them
    (``CostModel.sp_exchange``), so that it lasts 1/``sp`` of this."""
    executed = [per_rank(executed_sizes(sizes, qv=qv, qt=qt, mode=mode)[:, i], packing, dp)
                for i in range(SIZE_COLUMNS)]
    return cost.cost(*executed) + cost.sp_exchange(executed[1], sp)


def micro_batch_sizes(lengths: Lengths, packing: Packing, padded: bool,
                      cost: CostModel | None = None) -> np.ndarray:
    """[micro-batches, 5]: the tiles, tokens, Σseq_len² (``cost.squares`` where given),
    supervised tokens (``Lengths.supervised_or_tokens``) and Σ tiles² over ViT units
    (``Lengths.unit_squares``) each micro-batch makes the model process: the sums of its
    samples' ``item_sizes``."""
    return per_micro_batch(packing, item_sizes(lengths, packing, padded, cost))


def item_sizes(lengths: Lengths, packing: Packing, padded: bool,
               cost: CostModel | None = None) -> np.ndarray:
    """[items, 5]: ``micro_batch_sizes``' columns for each placed sample, in ``packing.items``
    order. Padded (``random``, ``lengthgroup``): the sample as long as its micro-batch's
    longest (its padding supervises nothing)."""
    tokens = lengths.tokens[packing.items].astype(np.float64)
    if padded and len(tokens):
        tokens = np.maximum.reduceat(tokens, packing.offsets[:-1])[packing.micro_of_item()]
    return np.stack([lengths.tiles[packing.items].astype(np.float64), tokens,
                     cost.squares(tokens) if cost else tokens * tokens,
                     lengths.supervised_or_tokens()[packing.items].astype(np.float64),
                     lengths.unit_squares_or_zero()[packing.items]], axis=1)


def per_micro_batch(packing: Packing, per_item: np.ndarray) -> np.ndarray:
    """[micro-batches, columns]: ``per_item`` [items, columns] summed over each micro-batch."""
    micro = packing.micro_of_item()
    return np.stack([np.bincount(micro, column, minlength=packing.n_micro)
                     for column in per_item.T], axis=1)


@dataclass(frozen=True)
class StepFigures:
    """Per step of a packing, every sum the metrics take (``metrics_of``): steps of several
    packings (a grouped plan's groups) concatenate into one, in the plan's step order."""

    useful: np.ndarray  # Σ_r C: the cost of the real tiles, tokens and attention
    spent: np.ndarray  # R · max_r E: what the ranks spend, R real ranks (groups of sp ranks)
    cost_mean: np.ndarray  # mean over the real ranks of C, per rank (÷ sp)
    cost_max: np.ndarray  # the largest C per rank (÷ sp)
    dist: np.ndarray  # [steps, 3]: ``dist_ratio_per_step`` of V, L and A
    tiles: np.ndarray  # ΣV
    tokens: np.ndarray  # ΣL
    processed: np.ndarray  # the tokens the LLM processes, padding included
    vit_capacity: np.ndarray  # micro-batches · Qv
    llm_capacity: np.ndarray  # micro-batches · Qt
    micro_batches: np.ndarray
    samples: np.ndarray
    sources: np.ndarray  # [steps, sources]: samples of each source
    sp: np.ndarray  # the step's sequence-parallel degree

    @classmethod
    def concat(cls, parts: list["StepFigures"], order: np.ndarray) -> "StepFigures":
        """The steps of ``parts`` in one order: step t is ``order[t]``'s next unused step."""
        rank = np.empty(len(order), np.int64)
        for g in range(len(parts)):
            rank[order == g] = np.arange(int((order == g).sum()))
        index = np.r_[0, np.cumsum([len(p.useful) for p in parts])][order] + rank
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts])[index]
                     for f in fields(cls)))


def step_figures(lengths: Lengths, packing: Packing, *, qv: int, qt: int, cost: CostModel,
                 padded: bool, dp: int, mode: str = "padding-free", sp: int = 1) -> StepFigures:
    """The per-step sums of ``packing`` as ``dp`` real ranks see it (each takes ranks/dp
    virtual ranks), its trainer computing in ``mode``; at sequence-parallel degree ``sp``, ``dp``
    counts the groups of ``sp`` ranks that share micro-batches (``executed_work``)."""
    loads = step_loads(lengths, packing, cost, dp)
    sizes = micro_batch_sizes(lengths, packing, padded, cost)
    executed = executed_work(sizes, packing, cost, dp, qv=qv, qt=qt, mode=mode, sp=sp)
    steps, per_step = packing.steps, packing.ranks * packing.micro_batches
    micro = np.full(steps, per_step, np.int64)
    processed = (sizes[:, 1].reshape(steps, per_step).sum(axis=1) if padded
                 else micro * float(qt))
    return StepFigures(
        useful=loads.cost.sum(axis=1), spent=executed.max(axis=1) * dp,
        cost_mean=loads.cost.mean(axis=1) / sp, cost_max=loads.cost.max(axis=1) / sp,
        dist=np.stack([dist_ratio_per_step(x) for x in (loads.tiles, loads.tokens,
                                                         loads.squares)], axis=1).reshape(steps, 3),
        tiles=loads.tiles.sum(axis=1), tokens=loads.tokens.sum(axis=1), processed=processed,
        vit_capacity=micro * float(qv), llm_capacity=micro * float(qt), micro_batches=micro,
        samples=loads.sources.sum(axis=1), sources=loads.sources, sp=np.full(steps, sp, np.int64))


def measure(lengths: Lengths, packing: Packing, *, qv: int, qt: int, cost: CostModel,
            padded: bool, dp: int, pack_seconds: float, mode: str = "padding-free",
            sp: int = 1) -> Metrics:
    """Metrics of ``packing`` as ``dp`` real ranks see it (``step_figures``)."""
    figures = step_figures(lengths, packing, qv=qv, qt=qt, cost=cost, padded=padded, dp=dp,
                           mode=mode, sp=sp)
    return metrics_of(figures, unplaced=len(packing.unplaced), qv=qv, qt=qt,
                      pack_seconds=pack_seconds)


def metrics_of(f: StepFigures, *, unplaced: int, qv: int, qt: int,
               pack_seconds: float) -> Metrics:
    """The metrics of the module docstring from a plan's ``StepFigures``."""
    spent, processed = float(f.spent.sum()), float(f.processed.sum())
    total_tokens = float(f.tokens.sum())
    vit_capacity, llm_capacity = float(f.vit_capacity.sum()), float(f.llm_capacity.sum())
    cost_max = float(f.cost_max.sum())
    steps = len(f.useful)
    mean_len = np.divide(f.tokens, f.samples, out=np.zeros(steps), where=f.samples > 0)
    dist = f.dist.mean(axis=0) if steps else np.zeros(3)
    return Metrics(
        step_efficiency=float(f.useful.sum()) / spent if spent else 1.0,
        pad_ratio=(processed - total_tokens) / processed if processed else 0.0,
        vit_dist_ratio=float(dist[0]),
        llm_dist_ratio=float(dist[1]),
        attn_dist_ratio=float(dist[2]),
        vit_fill=float(f.tiles.sum()) / vit_capacity if vit_capacity else 1.0,
        llm_fill=total_tokens / llm_capacity if llm_capacity else 0.0,
        cost_efficiency=float(f.cost_mean.sum()) / cost_max if cost_max else 1.0,
        order_spearman=spearman(np.arange(steps), mean_len),
        source_mix_tv=source_mix_tv(f.sources),
        steps=steps,
        micro_batches=int(f.micro_batches.sum()),
        samples=int(f.samples.sum()),
        unplaced=unplaced,
        qv=int(qv),
        qt=int(qt),
        pack_seconds=float(pack_seconds),
        communication_ratio=(float(f.tokens[f.sp > 1].sum()) / total_tokens if total_tokens
                             else 0.0),
    )


def source_shares(sources: np.ndarray) -> np.ndarray:
    """Each step's source mix: a [steps, sources] count table divided by its row sums."""
    return sources / sources.sum(axis=1, keepdims=True)


def source_mix_tv(sources: np.ndarray) -> float:
    """Mean over steps of the total-variation distance between the step's and the global mix,
    from a [steps, sources] count table."""
    if len(sources) == 0 or sources.shape[1] < 2:
        return 0.0
    overall = sources.sum(axis=0) / sources.sum()
    return float(0.5 * np.abs(source_shares(sources) - overall).sum(axis=1).mean())
