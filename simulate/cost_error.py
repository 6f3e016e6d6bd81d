"""The true per-sample cost set against the cost model the plans were packed with
(``vlmshard simulate``'s ``cost_error``): every strategy is placed by what it knows and scored at
what the samples really cost, so a plan's lead can be read under a model that is wrong.

A sample's work has a ViT part (its tiles) and an LLM part (its tokens, squared lengths and
supervised tokens); each is multiplied by its own factor: a seeded noise per sample, a
systematic bias per side, or both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlmshard.errors import ConfigError


@dataclass(frozen=True)
class CostError:
    """How the true work departs from the cost model: each sample's ViT part and LLM part times
    its own factor uniform in [1 − ``noise``, 1 + ``noise``] (drawn from ``seed``), then every
    ViT part times 1 + ``vit`` and every LLM part times 1 + ``llm`` (``vit=0.3``: the ViT 30%
    slower than modelled). All zero: the model is exact."""

    noise: float = 0.0
    vit: float = 0.0
    llm: float = 0.0
    seed: int = 0
    __pydantic_config__ = {"extra": "forbid"}  # a YAML key misspelt is an error, not ignored

    def __post_init__(self) -> None:
        if not 0 <= self.noise < 1 or min(self.vit, self.llm) <= -1:
            raise ConfigError(f"cost_error: noise must be in [0, 1) and vit, llm above -1, got "
                              f"{self}")


def true_factors(error: CostError, samples: int) -> np.ndarray:
    """[samples, 2]: what each sample's ViT and LLM work really costs over what the model
    says (exactly 1.0 where ``error`` is all zero)."""
    noise = np.random.default_rng(error.seed).uniform(1 - error.noise, 1 + error.noise,
                                                      (samples, 2))
    return noise * np.array([1 + error.vit, 1 + error.llm])


def true_sizes(lengths, packing, padded: bool, factors: np.ndarray) -> np.ndarray:
    """[micro-batches, 5]: ``packing.metrics.micro_batch_sizes`` (tiles, tokens, Σseq_len²,
    supervised tokens, Σ tiles² over ViT units) with each sample's share times its
    ``factors``: tiles and units by its ViT factor, the rest by its LLM factor."""
    from vlmshard.packing.metrics import item_sizes, per_micro_batch

    scale = factors[packing.items][:, [0, 1, 1, 1, 0]]
    return per_micro_batch(packing, item_sizes(lengths, packing, padded) * scale)
