"""Caps chosen by step_efficiency hold on any data mix.

For each mix of ``tests/length_mixes.py`` (five synthetic shapes and OmniBal's two real files),
at equal memory: ``balanced`` may choose its caps only inside the caps OmniBal's own search gives
``isf`` (``--max-qv/--max-qt``), and must beat ``isf`` on step_efficiency. The expected figures
are not taken from the packer: step_efficiency, fills and the remainder are recounted here from
the micro-batches by hand.

Fills must reach 0.95 where the granularity allows it. The bound used: a micro-batch closes with,
on average, half a sample's room left on the cap that stops it, so a cap that holds few samples
cannot be filled beyond ``1 − (mean sample / cap) / 2``; the test asks each fill for
``min(0.95, that bound)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from vlmshard.families import presets
from vlmshard.packing.config import PackConfig
from vlmshard.packing.cost import CostModel
from vlmshard.packing.plan import choose_caps, pack_epoch

from length_mixes import MIXES, mix

COST = CostModel.from_sizes(presets()["internvl2-2b"])
DP = 8


def pack(lengths, algo, mode, **bound):
    cfg = PackConfig(stats="", out="", dp=DP, algo=algo, compute_mode=mode, **bound)
    caps = choose_caps(cfg, lengths, COST)[0]
    return caps, pack_epoch(cfg, lengths, caps, COST, seed=cfg.seed)


def by_hand(lengths, caps, packing, mode):
    """step_efficiency and fills recounted from the micro-batches' samples, one at a time: the
    work of each micro-batch's tiles, tokens, squared lengths and supervised tokens."""
    useful, spent, tiles, tokens = 0.0, 0.0, 0, 0
    per_step = packing.ranks * packing.micro_batches
    for step in range(packing.steps):
        busiest = 0.0
        for rank in range(packing.ranks):
            executed = 0.0
            for micro in range(packing.micro_batches):
                b = step * per_step + rank * packing.micro_batches + micro
                ids = packing.items[packing.offsets[b]:packing.offsets[b + 1]]
                v, t = int(lengths.tiles[ids].sum()), int(lengths.tokens[ids].sum())
                a = float((lengths.tokens[ids].astype(float) ** 2).sum())
                assert v <= caps.qv and t <= caps.qt
                tiles, tokens = tiles + v, tokens + t
                head = COST.a_s * t  # the LM head's rows: every real token (the mixes say no
                # fewer are supervised), in either mode
                useful += COST.a_v * v + COST.a_t * t + COST.b * a + head
                if mode == "padded":
                    v, t = caps.qv, caps.qt
                executed += COST.a_v * v + COST.a_t * t + COST.b * a + head
            busiest = max(busiest, executed)
        spent += packing.ranks * busiest
    return useful / spent, tiles / (packing.n_micro * caps.qv), tokens / (packing.n_micro * caps.qt)


@pytest.mark.parametrize("name", MIXES)
def test_balanced_beats_isf_at_equal_memory(name):
    lengths = mix(name)
    for mode in ("padded", "padding-free"):
        isf_caps, isf = pack(lengths, "isf", mode)
        caps, bal = pack(lengths, "balanced", mode, max_qv=isf_caps.qv, max_qt=isf_caps.qt)
        assert caps.qv <= isf_caps.qv and caps.qt <= isf_caps.qt

        efficiency, vit_fill, llm_fill = by_hand(lengths, caps, bal, mode)
        isf_efficiency = by_hand(lengths, isf_caps, isf, mode)[0]
        assert efficiency > isf_efficiency, (name, mode, efficiency, isf_efficiency)

        # Nothing lost: every sample placed once, or unplaced over the bound or as a remainder
        # too small to fill one more step.
        assert sorted(np.r_[bal.items, bal.unplaced].tolist()) == list(range(len(lengths)))
        over = (lengths.tiles > isf_caps.qv) | (lengths.tokens > isf_caps.qt)
        rest = np.array([s for s, r in zip(bal.unplaced, bal.unplaced_reason)
                         if r == "remainder"], np.int64)
        assert set(bal.unplaced.tolist()) - set(rest.tolist()) == set(np.flatnonzero(over))
        assert (len(rest) < DP or lengths.tiles[rest].sum() < DP * caps.qv
                and lengths.tokens[rest].sum() < DP * caps.qt)

        if mode == "padded":
            placed = bal.items
            for fill, mean, cap in ((vit_fill, lengths.tiles[placed].mean(), caps.qv),
                                    (llm_fill, lengths.tokens[placed].mean(), caps.qt)):
                assert fill >= min(0.95, 1 - mean / cap / 2), (name, fill, mean, cap)
