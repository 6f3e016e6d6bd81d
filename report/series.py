"""What ``vlmshard report`` shows, as arrays: a plan's per-step series, and the check that a
training log trained that plan. Pure functions of data already read; ``vlmshard.report.report``
does the IO.

Every series comes from ``metrics.step_loads`` and ``metrics.dist_ratio_per_step``, the same
functions that compute plan.json's metrics, so a plot's mean is the metric next to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlmshard.packing.batches import Lengths, Packing
from vlmshard.packing.cost import CostModel
from vlmshard.packing.metrics import dist_ratio_per_step, source_shares, step_loads

from ..errors import InputError


class ReportError(InputError):
    """An input the report cannot use; the message names it and what is wrong."""


@dataclass(frozen=True)
class PlanSeries:
    """One plan as the report plots it (steps and ranks as the plan's real DP size sees them)."""

    label: str
    metrics: dict  # plan.json's metrics
    vit_imbalance: np.ndarray  # [steps] dist ratio of Σtiles per step
    llm_imbalance: np.ndarray  # [steps] dist ratio of Σtokens
    attn_imbalance: np.ndarray  # [steps] dist ratio of Σseq_len²
    tile_fill: np.ndarray  # [micro-batches] Σtiles / Qv
    token_fill: np.ndarray  # [micro-batches] Σseq_len / Qt
    rank_cost: np.ndarray  # [steps, dp] C
    source_shares: np.ndarray  # [steps, sources]
    sources: tuple[str, ...]


def plan_series(label: str, info: dict, packing: Packing, lengths: Lengths) -> PlanSeries:
    """The series of a plan from its plan.json (``info``), its packing and its stats."""
    loads = step_loads(lengths, packing, CostModel(**info["cost_model"]), info["params"]["dp"])
    qv, qt = info["metrics"]["qv"], info["metrics"]["qt"]
    # As in the metrics: with Qv = 0 (text-only data) every micro-batch counts as full of tiles.
    tile_fill = loads.micro_tiles / qv if qv else np.ones_like(loads.micro_tiles)
    return PlanSeries(label, info["metrics"], dist_ratio_per_step(loads.tiles),
                      dist_ratio_per_step(loads.tokens), dist_ratio_per_step(loads.squares),
                      tile_fill, loads.micro_tokens / qt, loads.cost,
                      source_shares(loads.sources), lengths.sources)


def check_train_log(records: list[tuple[int, dict]], name: str, packing: Packing) -> None:
    """Check that every record of a train log (line number, record) trained the plan's own
    micro-batches at a data-parallel size dividing the plan's ranks."""
    first_line, first = records[0]
    try:
        dp = len(first["data"])
        world = len(first["ranks"])
    except (KeyError, TypeError) as e:
        raise ReportError(f"{name} line {first_line}: not a train_log record (needs 'data' and "
                          "'ranks' lists)") from e
    if dp == 0 or packing.ranks % dp:
        raise ReportError(f"{name}: trained on {dp} data-parallel rank(s), which does not divide "
                          f"the plan's {packing.ranks} ranks: this log is not from this plan")
    for number, record in records:
        try:
            _check_data(record["data"], dp, packing)
            ranks = len(record["ranks"])
        except ReportError as e:
            raise ReportError(f"{name} line {number}: {e}: this log is not from this plan") \
                from e
        except (KeyError, TypeError, ValueError) as e:
            detail = f"missing {e}" if isinstance(e, KeyError) else str(e)
            raise ReportError(f"{name} line {number}: not a train_log record ({detail})") from e
        if ranks != world:
            raise ReportError(f"{name} line {number}: {ranks} ranks, line {first_line} "
                              f"has {world}")


def _check_data(data: list[dict], dp: int, packing: Packing) -> None:
    """Check that each DP rank of a record trained exactly the micro-batches the plan gives its
    virtual ranks at the plan steps it names."""
    if sorted(d["dp_rank"] for d in data) != list(range(dp)):
        raise ReportError(f"data of dp ranks {sorted(d['dp_rank'] for d in data)}, expected "
                          f"0..{dp - 1}")
    if not any(d["plan_steps"] for d in data):
        raise ReportError("no plan_steps: the record names no plan step it trained")
    per_dp = packing.ranks // dp
    for d in data:
        plan_steps = sorted(set(d["plan_steps"]))
        bad = [s for s in plan_steps if not 0 <= s < packing.steps]
        if bad:
            raise ReportError(f"plan step {bad[0]} is outside the plan's {packing.steps} steps")
        first_micro = np.array([(s * packing.ranks + d["dp_rank"] * per_dp) * packing.micro_batches
                                for s in plan_steps], np.int64)
        micro = (first_micro[:, None]
                 + np.arange(per_dp * packing.micro_batches)[None, :]).ravel()
        want = sorted(tuple(packing.items[packing.offsets[b]:packing.offsets[b + 1]].tolist())
                      for b in micro)
        if sorted(tuple(ids) for ids in d["sample_ids"]) != want:
            raise ReportError(f"dp rank {d['dp_rank']} trained other samples than the plan "
                              f"places at step(s) {plan_steps}")
